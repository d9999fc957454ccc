"""How a process of the job ends, in one place: an uncaught exception on any rank ends the
whole job at once (instead of leaving the other ranks waiting in a collective forever),
whether the process uses ``Job`` or only ``hpcadapt.init()`` and the collectives.

This module knows no ``Job``: a job registers its failure handler (``set_failure_handler``)
and the hook calls it first. It does not load MPI either: a process that never started MPI
is named by its launcher's rank variables and simply exits."""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import traceback
import zlib
from typing import Callable, Optional, Tuple

from hpcadapt.base import config

__all__ = ["install_abort_on_exception", "set_failure_handler", "is_first_rank", "end_process",
           "is_rank_process", "pid_alive"]

_failure_handler: Optional[Callable[[BaseException], None]] = None
_ABORT_GRACE_S = 10.0  # how long MPI_Abort may take before the process ends itself
# The process that installed the hook: the rank. A process forked from it (a DataLoader
# worker) inherits ``sys.excepthook`` but is the user's, not a rank: it must never abort
# the job's communicator (MPI in a forked child hangs) nor speak for the rank.
_rank_pid: Optional[int] = None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` (on this node) is a live process (not gone, not a zombie: a process
    killed with its parent waits as one until someone reaps it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def node_key() -> int:
    """This node, as a number: the host name, the boot and the pid namespace (so pids of
    two containers on one host are never compared)."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path, encoding="ascii") as f:
                parts.append(f.read().strip())
        except OSError:
            pass
    try:
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        pass
    return zlib.crc32("|".join(parts).encode()) & 0x7FFFFFFF


def is_first_rank() -> bool:
    """Whether this process speaks for its launch (rank 0, or no launcher)."""
    return config.launch_rank() in (None, 0)


_planned_exit_code = 0


def plan_exit(code: int) -> None:
    """The exit code the job chose at its end (``Stops.finish``), for an end that must skip
    the interpreter's own exit (``end_process`` at exit)."""
    global _planned_exit_code
    _planned_exit_code = code


def planned_exit_code() -> int:
    return _planned_exit_code


def end_process(code: int) -> None:
    """End this process now with ``code``: the log and the standard streams flushed, then
    ``os._exit`` (no interpreter teardown: a call blocked on a dead peer, or MPI's exit with
    one, cannot be left any other way). Never returns."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def set_failure_handler(handler: Optional[Callable[[BaseException], None]]) -> None:
    """``handler(exception)`` runs first when an exception is uncaught (a job saves its state
    on a peer's failure there); it may end the process itself. One at a time: the latest."""
    global _failure_handler
    _failure_handler = handler


def _where() -> Tuple[int, int, object]:
    """(rank, size, communicator to abort or None): hpcadapt's world when it is up, else
    MPI's world when MPI is, else what the launcher says."""
    runtime = sys.modules.get("hpcadapt.comm.world")
    if runtime is not None and runtime.is_initialized():
        w = runtime.world()
        return w.rank, w.size, w.comm
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size(), mpi.COMM_WORLD
    # No launcher variable: a single process, rank 0 of 1.
    return (config.launch_rank() or 0), (config.launch_size() or 1), None


def _end_children() -> None:
    """Kill this process's multiprocessing children (DataLoader workers): they would keep
    the launcher's output pipes open until their own watchdog noticed the parent gone
    (torch checks every 5 s), and the launcher waits for those pipes to close."""
    import multiprocessing

    for child in multiprocessing.active_children():
        try:
            child.kill()
        except (OSError, ValueError):  # pragma: no cover - gone already
            pass


def _report(kind, value, tb, rank, size, ours: bool, together: bool) -> None:
    if ours:
        if not together or rank == 0:
            sys.stderr.write(f"[rank {rank}] hpcadapt: {value}\n")
    else:
        text = "".join(traceback.format_exception(kind, value, tb))
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
    if not together:
        ending = f"aborting all {size} ranks" if size > 1 else "ending the job"
        sys.stderr.write(f"[rank {rank}] hpcadapt: {'error' if ours else 'uncaught exception'}"
                         f" on rank {rank}; {ending}\n")
    sys.stderr.flush()
    sys.stdout.flush()


def _hook(kind, value, tb) -> None:
    """hpcadapt's own errors as one line (exit 2), anything else with that rank's traceback
    (exit 1). An error every rank raised together (rank 0's verdict, shared) ends the job
    cleanly, printed once; any other aborts all ranks."""
    if issubclass(kind, (KeyboardInterrupt, SystemExit)) or os.getpid() != _rank_pid:
        return sys.__excepthook__(kind, value, tb)
    if _failure_handler is not None:
        _failure_handler(value)  # may save a checkpoint: not bounded here
    _arm_last_resort()
    from hpcadapt.base.errors import HpcAdaptError

    rank, size, comm = _where()
    ours = isinstance(value, HpcAdaptError)
    together = ours and value.all_ranks
    _report(kind, value, tb, rank, size, ours, together)
    code = 2 if ours else 1
    _end_children()
    timer = threading.Timer(_ABORT_GRACE_S, os._exit, args=(code,))
    timer.daemon = True
    timer.start()
    try:
        if comm is not None and together:
            runtime = sys.modules.get("hpcadapt.comm.world")  # loaded: it gave the comm
            if runtime is not None:
                runtime.shutdown()
            sys.modules["mpi4py.MPI"].Finalize()
        elif comm is not None:
            comm.Abort(code)
    finally:
        os._exit(code)


def _arm_last_resort() -> None:
    """End this process ``_ABORT_GRACE_S`` seconds from now whatever it is doing: MPI_Abort
    (and the clean Finalize of a shared verdict) normally ends it at once; should either
    block inside a call that holds the interpreter, the timer thread below could not run,
    while SIGALRM's default action ends the process in the kernel. Its launcher then ends
    the others."""
    import signal

    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, _ABORT_GRACE_S)
    except (ValueError, OSError):  # not the main thread: the timer thread below remains
        pass


def is_rank_process() -> bool:
    """Whether this process is the rank itself, not a process forked from it (a loader
    worker), which must not run the rank's handlers."""
    return _rank_pid is None or os.getpid() == _rank_pid


def install_abort_on_exception() -> None:
    """Make an uncaught exception in this process end every rank (idempotent)."""
    global _rank_pid
    _rank_pid = os.getpid()
    sys.excepthook = _hook
