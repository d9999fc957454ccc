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
