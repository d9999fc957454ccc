"""Stopping cleanly when the scheduler is about to end the job.

Slurm sends USR1 (or whichever signal ``#SBATCH --signal=SIG@T`` names) some seconds before a
time limit, and TERM before it kills a job (``scancel``, preemption). A handler only notes
the signal; the training then agrees on it at the next step boundary (the flag travels in
the step's control reduction, so every rank stops at the same step), saves its state and
exits with ``EXIT_REQUEUE`` so that the job script can requeue the job. Without a checkpoint
the job stops the same way, says that nothing was saved, and exits with 1 (nothing to
requeue from); Ctrl-C is always a stop signal."""

from __future__ import annotations

import logging
import os
import signal
from typing import Callable, Dict, Optional, Sequence

__all__ = ["StopSignals", "EXIT_REQUEUE", "ALWAYS_STOP", "parse_signal", "block_stop_signals",
           "unblock_stop_signals"]

log = logging.getLogger(__name__)

# EX_TEMPFAIL from sysexits.h: a temporary failure, to be retried (the job script requeues).
EXIT_REQUEUE = 75

# Blocked (not ignored) from the first line of the entry point until the handlers are in
# place: a signal that comes while torch loads stays pending instead of killing the process.
# Slurm can send the time-limit signal right after a requeued job starts.
EARLY_BLOCKED = (signal.SIGUSR1, signal.SIGTERM)


def block_stop_signals() -> None:
    """Block the early stop signals in this thread and in every thread started after it;
    call it before anything starts threads (importing numpy starts its BLAS pool), or a
    signal may be delivered to such a thread and kill the process."""
    signal.pthread_sigmask(signal.SIG_BLOCK, EARLY_BLOCKED)


def unblock_stop_signals() -> None:
    """Deliver what came while blocked: to the handlers, or (none installed) by default."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, EARLY_BLOCKED)


def parse_signal(name: str) -> signal.Signals:
    """``USR1``, ``SIGUSR1`` or ``10`` -> signal.SIGUSR1; ValueError otherwise."""
    text = name.strip().upper()
    if text.isdigit():
        return signal.Signals(int(text))
    if not text.startswith("SIG"):
        text = "SIG" + text
    try:
        return signal.Signals[text]
    except KeyError:
        raise ValueError(f"unknown signal {name!r}; use a name like USR1 or TERM") from None


# Ctrl-C (SIGINT to mpiexec, which forwards it to every rank) stops like a stop signal: at
# the next step boundary, saving with --checkpoint; never a KeyboardInterrupt traceback from
# each rank.
ALWAYS_STOP = (signal.SIGINT,)


class StopSignals:
    """Remembers the first of ``signals`` received; ``received`` is its name (or None).
    ``saves``: whether the job saves its state when it stops (it has a --checkpoint); without
    one the receipt is not logged, rank 0's single line at the stop says nothing was saved."""

    def __init__(self, signals: Sequence[signal.Signals] = (signal.SIGUSR1, signal.SIGTERM),
                 *, saves: bool = True):
        self.signals = tuple(dict.fromkeys(signals))
        self.saves = saves
        self.received: Optional[str] = None
        self._previous: Dict[signal.Signals, object] = {}
        self._pid: Optional[int] = None
        # Whether this process says it received the signal: the launcher forwards it to every
        # rank, and one line per job is enough (the job sets it to "rank 0").
        self.announce: Callable[[], bool] = lambda: True

    @classmethod
    def named(cls, names: Sequence[str], *, saves: bool) -> "StopSignals":
        """The signals ``names`` (--stop-signals) and Ctrl-C's."""
        return cls([parse_signal(n) for n in names] + list(ALWAYS_STOP), saves=saves)

    def _handle(self, signum: int, _frame) -> None:
        # A process forked from the rank (a DataLoader worker) inherits this handler; the
        # launcher's signal reaches it too, but the rank decides the stop: ignore it there.
        if os.getpid() != self._pid:
            return
        if self.received is None:
            self.received = signal.Signals(signum).name
            if self.saves and self.announce():
                log.warning("%s received: the job saves its state at the next step boundary",
                            self.received)

    def install(self) -> "StopSignals":
        self._pid = os.getpid()
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        unblock_stop_signals()
        return self

    def leave_instead(self, why: str) -> None:
        """This process is a worker in an allocation of its own (a Slurm companion job): a
        signal to it ends that allocation, not the training (the training's own job gets
        the scheduler's stop signals). So it leaves: one line, and the process exits at
        once, a worker's death the training survives; it never stops the whole job."""
        def leave(signum: int, _frame) -> None:
            if os.getpid() != self._pid:
                return
            log.warning("%s received: %s; this worker exits and the training goes on without "
                        "it", signal.Signals(signum).name, why)
            os._exit(128 + signum)   # the log handler flushed its line; nothing else to keep

        for sig in self.signals:
            if sig not in ALWAYS_STOP:
                signal.signal(sig, leave)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
