"""Looking at processes through /proc (the failure and soak tests' leak and liveness checks)."""

from __future__ import annotations

import os


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def _environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
    except OSError:
        return {}


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def zombie_children(parents):
    """Zombie processes whose parent is one of ``parents`` (unreaped launchers)."""
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit():
            try:
                with open(f"/proc/{e}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] == b"Z" and int(fields[1]) in parents:
                out.append(int(e))
    return out


def processes_mentioning(text):
    """Live processes whose command line holds ``text`` (the run's unique metrics path)."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()
            and any(text.encode() in part for part in _cmdline(e)) and alive(int(e))]


def python_ranks(text):
    """{pid: join folder or None} of the training processes (not their launchers)."""
    out = {}
    for pid in processes_mentioning(text):
        cmd = _cmdline(pid)
        if cmd and os.path.basename(cmd[0].decode()).startswith("python"):
            out[pid] = _environ(pid).get(b"HPCADAPT_JOIN_DIR", b"").decode() or None
    # A rank's loader workers are forks of it (same command line and environment): not ranks.
    return {pid: d for pid, d in out.items() if _parent(pid) not in out}


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def launch_ranks(text):
    """{rank in its launch: pid} of the training processes (the launcher's rank variable)."""
    out = {}
    for pid in python_ranks(text):
        env = _environ(pid)
        for name in (b"OMPI_COMM_WORLD_RANK", b"PMI_RANK"):
            if env.get(name, b"").isdigit():
                out[int(env[name])] = pid
                break
    return out


class ChildOutput:
    """A child's pipe read with a deadline on every wait: ``readline`` never blocks past it
    (a child that stops writing, or whose lines never match, fails the test, never hangs it)."""

    def __init__(self, stream):
        self._fd = stream.fileno()
        self._buffer = b""
        self._ended = False

    def readline(self, deadline: float) -> str | None:
        """The next whole line, '' at the end of the output, None when ``deadline``
        (a ``time.monotonic()`` value) passes first."""
        import select
        import time

        while b"\n" not in self._buffer and not self._ended:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._fd], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(self._fd, 65536)
                self._buffer += chunk
                self._ended = not chunk
        if b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            return line.decode(errors="replace") + "\n"
        line, self._buffer = self._buffer, b""
        return line.decode(errors="replace")

    def read_all(self, deadline: float) -> str:
        """What the child wrote until it ended or ``deadline`` passed (orphans that keep
        the pipe open cannot hold the reader past it)."""
        out = []
        while (line := self.readline(deadline)):
            out.append(line)
        return "".join(out)
