"""Rank 0's progress, as a person reads it: on a terminal one tqdm bar (samples done of the
run's total, percent, rate, time left; the epoch, step, loss, batch and workers beside it)
that log lines print above, never onto; elsewhere (a Slurm output file, a pipe) a plain line
every ``every_s`` seconds and one at the end. Off with ``--no-progress`` (``--quiet``)."""

from __future__ import annotations

import sys
import time
from typing import IO, Optional, Tuple

__all__ = ["ProgressLine"]


class ProgressLine:
    """Follows the committed steps on rank 0 (``update``); the total comes from
    ``job.epochs(N)`` (``expect``)."""

    def __init__(self, enabled: bool, every_s: float = 30.0, stream: Optional[IO[str]] = None):
        self.enabled = enabled
        self.every_s = every_s
        self.stream = stream if stream is not None else sys.stderr
        self.total: Optional[int] = None
        self._bar = None
        self._last_line = -float("inf")
        self._started = time.monotonic()
        self._start_seen: Optional[int] = None
        self._last: Optional[Tuple[int, str]] = None  # the last step's samples and text
        self._terminal: Optional[bool] = None

    @property
    def on_terminal(self) -> bool:
        """Whether a person watches: this stream is a terminal, or (under mpiexec, whose
        ranks write into pipes) the launcher's is."""
        if self._terminal is None:
            try:
                self._terminal = self.stream.isatty() or (
                    self.stream is sys.stderr and _launcher_on_terminal())
            except (AttributeError, ValueError):
                self._terminal = False
        return self._terminal

    def expect(self, total_samples: int) -> None:
        """The run's length in samples (epochs x the epoch's samples)."""
        self.total = int(total_samples)
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def update(self, *, seen: int, epoch: int, step: int, loss: float, batch: int,
               workers: int) -> None:
        """A committed step: ``seen`` samples of the run are done."""
        if not self.enabled:
            return
        if self._start_seen is None:
            self._start_seen, self._started = seen, time.monotonic()
        about = f"epoch {epoch} step {step} loss {loss:.4f} batch {batch} on {workers} workers"
        self._last = (seen, about)
        if self.on_terminal:
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(total=self.total, initial=seen, unit="sample",
                                 unit_scale=True, file=self.stream, dynamic_ncols=True,
                                 leave=True, mininterval=0.5, smoothing=0.1)
            self._bar.set_postfix_str(about, refresh=False)
            self._bar.update(seen - self._bar.n)
            return
        now = time.monotonic()
        if now - self._last_line >= self.every_s:
            self._last_line = now
            self._write_line(seen, now, about)

    def _write_line(self, seen: int, now: float, about: str) -> None:
        done = seen - (self._start_seen or 0)
        rate = done / (now - self._started) if now > self._started else 0.0
        if self.total:
            left = (self.total - seen) / rate if rate > 0 else float("inf")
            share = (f"{100.0 * seen / self.total:.0f}% ({seen:,}/{self.total:,} samples), "
                     f"{_duration(left)} left")
        else:
            share = f"{seen:,} samples"
        self.stream.write(f"progress: {share}, {rate:,.0f} samples/s, {about}\n")
        self.stream.flush()

    def close(self) -> None:
        """The bar ends on its own line; elsewhere one last line."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.enabled and self._last is not None and not self.on_terminal:
            seen, about = self._last
            self._write_line(seen, time.monotonic(), about)
        self._last = None


def _launcher_on_terminal(levels: int = 4) -> bool:
    """Whether this process's stderr is a pipe that a launcher above it (mpiexec, mpirun,
    their proxies: each copies its children's pipes to its own stderr) ends in a terminal
    (Linux /proc). Any step of the chain that is not a pipe (a file: ``2>run.log``, a Slurm
    output) means no terminal."""
    import os

    def stderr_of(pid: str) -> str:
        return os.readlink(f"/proc/{pid}/fd/2")

    try:
        if not stderr_of("self").startswith("pipe:"):
            return False
        pid = os.getppid()
        for _ in range(levels):
            if pid <= 1:
                return False
            target = stderr_of(str(pid))
            if target.startswith(("/dev/pts/", "/dev/tty")):
                return True
            if not target.startswith("pipe:"):
                return False
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    return False


def _duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
