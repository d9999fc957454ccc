"""The world: which processes train together now, and the cluster version that names it.

A resize replaces the communicator and bumps the version; everything that caches
per-world resources (fusion buckets, NCCL communicators) compares versions to rebuild."""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import numpy as np

from hpcadapt.base import config
from hpcadapt.base.errors import ConfigurationError
from hpcadapt.base.lifecycle import node_key, pid_alive  # noqa: F401  (node_key: re-exported)
from hpcadapt.base.options import FailureOptions
from hpcadapt.comm.mpi import MPI
from hpcadapt.comm.mpiflavour import flavour

__all__ = ["WorldInfo", "World", "init", "world", "is_initialized", "shutdown", "PeerFailure",
           "PeerWatch", "wait_request", "PEER_TIMEOUT_FLOOR", "ULFM", "FAILURES", "as_failure"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorldInfo:
    """A snapshot of one process's place in the world."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_name: str
    cluster_version: int


class World:
    """The communicator of the current workers and what is derived from it.

    The world owns its communicator (a duplicate, so user traffic on COMM_WORLD never
    matches ours) and frees it on ``replace`` or ``free``."""

    def __init__(self, comm: MPI.Intracomm, *, cluster_version: int = 0, own: bool = True):
        self._comm: Optional[MPI.Intracomm] = comm
        self._own = own
        self._abandoned = False
        self._version = cluster_version
        # Per-world resources freed collectively by the ranks they were made for (an RMA
        # window's free is a barrier of them all), called with ``abandon`` before the
        # communicator changes or goes: in a shrink the leavers come here through ``free``
        # at the point where the survivors come through ``replace``.
        self.releases: List[Callable[[bool], None]] = []
        self._derive()

    def _derive(self) -> None:
        comm = self.comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        # Every rank learns where every other one runs (node, pid): processes on one node
        # form the node (rank order decides local ranks), and a peer on this node whose pid
        # is gone is known dead while we wait for it (liveness without heartbeats).
        mine = np.array([node_key(), os.getpid(), launch_id()], dtype=np.int64)
        table = np.empty((self.size, 3), dtype=np.int64)
        old = getattr(self, "watch", None)
        # A new member's pid is not known yet: this wait has a plain deadline.
        wait_request(comm.Iallgather(mine, table), old, "the world's start",
                     deadline_s=old.floor if old is not None else None)
        self.peers: List[Tuple[int, int, int]] = [(r, int(k), int(p))
                                                  for r, (k, p, _) in enumerate(table)]
        # Ranks started by one launch (mpiexec/srun) live and die together: the launcher
        # ends them all when one dies, so only a rank alone in its launch can be lost alone.
        self.launches: List[int] = [int(x) for x in table[:, 2]]
        self.pids: List[int] = [int(x) for x in table[:, 1]]
        same = [r for r, k, _ in self.peers if k == mine[0]]
        self.local_rank: int = same.index(self.rank)
        self.local_size: int = len(same)
        self.node_name: str = config.slurm_node_name() or MPI.Get_processor_name()
        previous = getattr(self, "watch", None)
        self.watch = PeerWatch(self.rank, [(r, p) for r, k, p in self.peers
                                           if k == mine[0] and r != self.rank],
                               blind=len(same) < self.size)
        if previous is not None:
            self.watch.inherit(previous)
        # A side channel for failure notices: point-to-point messages that reach a survivor
        # while the world's collectives are stuck on a dead peer (hpcadapt.elastic.recovery).
        self.notices: MPI.Intracomm = comm.Dup()
        self.watch.sources.append(self._notice)

    def _notice(self) -> Optional[Tuple[int, str]]:
        """A failure notice from another rank, if one waits (PeerWatch source). Under ULFM
        the notice is the revoke of the world's communicator by the rank that saw a death
        (it reaches ranks waiting on other communicators: a node's, a pair's)."""
        if ULFM:
            if self._comm is not None and self._comm.Is_revoked():
                return NOTICE, "another rank revoked the world after a death"
            return None
        status = MPI.Status()
        if self.notices.Iprobe(source=MPI.ANY_SOURCE, tag=NOTICE_TAG, status=status):
            return NOTICE, f"rank {status.Get_source()} reports a dead peer"
        return None

    @property
    def comm(self) -> MPI.Intracomm:
        if self._comm is None:
            raise ConfigurationError("this world has been shut down; call hpcadapt.init() again")
        return self._comm

    @property
    def cluster_version(self) -> int:
        return self._version

    def info(self) -> WorldInfo:
        return WorldInfo(self.rank, self.size, self.local_rank, self.local_size,
                         self.node_name, self._version)

    def replace(self, comm: MPI.Intracomm, *, version: Optional[int] = None,
                keep_old: bool = False) -> Optional[MPI.Intracomm]:
        """Adopt a new communicator after a resize; the version goes up exactly once (or
        becomes ``version``: a joining worker takes the running job's). With ``keep_old``
        the old communicator is returned instead of freed (to fall back to it when the
        resize fails before it is confirmed)."""
        self._release(abandon=self._abandoned)
        old, old_notices = self._comm, getattr(self, "notices", None)
        self._comm = comm
        self._version = self._version + 1 if version is None else version
        self._derive()
        if old_notices is not None and not self._abandoned:
            old_notices.Free()
        owned, self._own = self._own and not self._abandoned, True
        self._abandoned = False
        log.debug("world replaced: size %d, cluster version %d", self.size, self._version)
        if keep_old:
            return old if owned else None
        if old is not None and owned and old != MPI.COMM_NULL:
            old.Free()
        return None

    def adopt_version(self, version: int) -> None:
        """The cluster version the others hold: after a recovery every survivor takes the
        highest one any of them held; a joiner the one its state came with."""
        self._version = int(version)

    def bump_version(self) -> int:
        """A change of configuration without a new communicator (a strategy switch): the
        version goes up on every rank at the same boundary, so that what caches per-world
        resources rebuilds and a plan decided before it is refused."""
        self._version += 1
        return self._version

    def abandon(self) -> None:
        """Give up this world's communicators because a dead peer belongs to them: never
        freed (freeing waits on the dead), kept referenced until exit. Call ``replace``
        next."""
        self._release(abandon=True)
        ABANDONED.extend([self._comm, self.notices])
        self._abandoned = True
        # The dead are known and agreed on: until the next world has formed, waits watch the
        # living only (a dead pid, or a notice left on the old notice channel, would end the
        # new world's start at once: seen when rank 0 died and a survivor came late).
        self.watch.local_peers = [(r, p) for r, p in self.watch.local_peers if pid_alive(p)]
        self.watch.sources = [s for s in self.watch.sources if s != self._notice]

    def _release(self, abandon: bool) -> None:
        releases, self.releases = self.releases, []
        for release in releases:
            release(abandon)

    def free(self) -> None:
        if self._comm is not None:
            self._release(abandon=False)
        if self._comm is not None and self._own:
            self._comm.Free()
            self.notices.Free()
        self._comm = None

    def __repr__(self) -> str:
        return (f"World(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
                f"node={self.node_name!r}, version={self._version})")


_world: Optional[World] = None
NOTICE_TAG = 0x6E6F   # failure notices on World.notices
NOTICE = -2           # PeerFailure.rank of a failure another rank reported
# Communicators, requests and buffers that a dead peer may still name: never freed, never
# reused (MPICH neither completes nor errors an operation with a dead peer).
ABANDONED: list = []
_launch_id: Optional[int] = None


def launch_id() -> int:
    """The same number on every process of one launch (mpiexec/srun): the pid and node of
    its first process. Computed once (a broadcast among the launch's processes)."""
    global _launch_id
    if _launch_id is None:
        mine = (node_key() << 22) ^ os.getpid()
        comm = MPI.COMM_WORLD
        _launch_id = int(comm.bcast(mine, root=0)) if comm.Get_size() > 1 else mine
    return _launch_id


def init(comm: Optional[MPI.Intracomm] = None) -> World:
    """Join the world: from ``mpiexec``/``srun`` ranks, or as a single rank with no launcher.

    Idempotent: a second call returns the same world. A process started by
    ``MPI.Comm.Spawn`` (a joining worker) should use ``hpcadapt.elastic.membership`` instead."""
    global _world
    if _world is not None:
        return _world
    from hpcadapt.base.lifecycle import install_abort_on_exception

    install_abort_on_exception()  # an exception on one rank ends them all, never a hang
    if ULFM:
        import atexit

        atexit.register(_bound_finalize)  # runs before mpi4py's MPI_Finalize (LIFO)
    base = comm if comm is not None else MPI.COMM_WORLD
    _world = World(base.Dup())
    return _world


FINALIZE_BOUND_S = 60


def _bound_finalize() -> None:
    """Under ULFM, survivors of a recovery sometimes hung in MPI_Finalize (field notes: 8 of
    55 exits without ``--mca async_mpi_finalize 1``): at the interpreter's exit the kernel
    ends the process FINALIZE_BOUND_S seconds later should MPI_Finalize not return (SIGALRM,
    exit 142), instead of a job that never ends."""
    import signal
    import threading

    from hpcadapt.base import lifecycle

    if any(isinstance(x, threading.Thread) and x.is_alive() for x in ABANDONED):
        # A spawn that never returned (its joiner died before its MPI started) is still
        # inside MPI in a thread: MPI_Finalize crashed under it (SIGSEGV in opal_progress).
        # The job's output and files are done by now; end with the code it chose.
        lifecycle.end_process(lifecycle.planned_exit_code())
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_REAL, FINALIZE_BOUND_S)
    except (ValueError, OSError):
        pass


class KernelDeadline:
    """``with KernelDeadline(s):`` the kernel ends this process (SIGALRM's default action,
    exit 142) should the block still run ``s`` seconds later: a bound that holds even when a
    thread is stuck inside the MPI library, where no Python-level deadline can act (seen:
    Open MPI's ULFM revoke deadlocked in a survivor after a joiner crashed). Main thread
    only; the previous SIGALRM handling comes back after the block."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._previous = None

    def __enter__(self) -> "KernelDeadline":
        import signal

        try:
            self._previous = signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        except (ValueError, OSError):  # not the main thread: no bound
            self._previous = None
        return self

    def __exit__(self, *exc) -> None:
        import signal

        if self._previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)


def is_initialized() -> bool:
    return _world is not None


def world() -> World:
    """The world set up by ``init()``; raises ConfigurationError before it."""
    if _world is None:
        raise ConfigurationError("hpcadapt is not initialised: call hpcadapt.init() first")
    return _world


def shutdown() -> None:
    """Free hpcadapt's communicators, then wait (idly) for the processes this one was
    launched with. MPI itself is finalised by mpi4py at exit."""
    global _world
    if _world is not None:
        if _world._comm is not None:
            _world.free()
        _world = None
    wait_for_launch_siblings()


class Watchdog:
    """A last resort around blocking MPI calls that cannot be polled (MPI_Comm_accept's
    followers: Create_intercomm, Merge, Split with a joiner): while the block runs, a thread
    checks ``check()`` (a reason, or None) and the clock every 0.1 s and calls
    ``on_expire(reason)`` when either fires. ``on_expire`` ends the process (it cannot
    unblock MPI); a block that finishes first disarms it. ``phase(what)`` names where the
    block is and restarts the clock."""

    def __init__(self, seconds: float, what: str, on_expire: Callable[[str], None],
                 check: Optional[Callable[[], Optional[str]]] = None):
        import threading

        self.seconds, self.what, self.base = seconds, what, what
        self.on_expire, self.check = on_expire, check
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpcadapt-watchdog",
                                        daemon=True)

    def __enter__(self) -> "Watchdog":
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def phase(self, what: str) -> None:
        """A new phase of the block starts: its name goes into the message, and the clock
        starts again (each phase has ``seconds``: a join's phases each have their own
        bounded waits, and the sum of them must not read as one block)."""
        self.what = f"{self.base}: {what}"
        self._t0 = time.perf_counter()

    def _run(self) -> None:
        while not self._done.wait(0.1):
            reason = self.check() if self.check is not None else None
            waited = time.perf_counter() - self._t0
            if reason is None and waited > self.seconds:
                reason = f"{self.what} still blocked after {waited:.1f} s"
            if reason is not None and not self._done.is_set():
                self.on_expire(f"{reason} (in {self.what})")
                return


def leave_with_launch_siblings(timeout_s: float) -> None:
    """On the way out after a failure: wait (at most ``timeout_s``) for the processes this one
    was launched with, so that they all exit together and none is killed by the launcher
    before it has said why it ends (a dead sibling: the launcher ends them all anyway).
    Under ULFM the launcher ends nobody, and COMM_WORLD may hold the dead: no wait."""
    if ULFM or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    try:
        wait_request(MPI.COMM_WORLD.Ibarrier(), None, "the launch siblings' exit",
                     deadline_s=timeout_s)
    except PeerFailure:
        pass


def wait_for_launch_siblings(poll_s: float = 0.05) -> None:
    """Processes started together by one mpiexec/srun share COMM_WORLD and cannot finalise
    before each other; one that left the training early waits here, sleeping, instead of
    spinning inside MPI_Finalize. Processes that joined alone pass at once, and so does
    every process under ULFM (COMM_WORLD may hold the dead; Open MPI finalises alone)."""
    import time

    if ULFM or MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    request = MPI.COMM_WORLD.Ibarrier()
    while not request.Test():
        time.sleep(poll_s)


# -- failures as one exception ----------------------------------------------------------------
# Under Open MPI with ULFM (``mpirun --with-ft ulfm``) an operation that involves a dead
# peer, or a communicator another rank revoked, raises MPI.Exception (PROC_FAILED, REVOKED,
# and sometimes OTHER or TRUNCATE); each is a peer failure. Under any other MPI an
# MPI.Exception is an error, never a failure.
ULFM: bool = flavour().ulfm


def as_failure(exc: BaseException, what: str = "an MPI operation") -> "PeerFailure":
    """``exc`` as the one failure exception (PeerFailure passes through)."""
    if isinstance(exc, PeerFailure):
        return exc
    if isinstance(exc, MPI.Exception) and ULFM:
        name = {MPI.ERR_PROC_FAILED: "MPI_ERR_PROC_FAILED",
                MPI.ERR_REVOKED: "MPI_ERR_REVOKED"}.get(exc.Get_error_class(),
                                                         f"MPI error class "
                                                         f"{exc.Get_error_class()}")
        return PeerFailure(f"{name} in {what}", cause="dead" if name.endswith("FAILED")
                           else "notice")
    raise exc


# -- waiting on peers, bounded -----------------------------------------------------------------
# seconds: a watch's floor until the job sets --peer-timeout's (its default, written once)
PEER_TIMEOUT_FLOOR = FailureOptions.peer_timeout
PEER_TIMEOUT_STEPS = 20     # times the median step time, when that is longer


class PeerFailure(Exception):
    """A peer this process waits on is dead (``rank`` in the world, -1 when unknown) or did
    not answer within the deadline. Raised from a bounded wait; the communicator involved
    is no longer usable."""

    def __init__(self, message: str, *, rank: int = -1, waited_s: float = 0.0,
                 cause: str = "dead"):
        super().__init__(message)
        self.rank = rank
        self.waited_s = waited_s
        self.cause = cause            # "dead", "notice" (another rank saw one), "timeout",
        #                               "stop" or "join"
        self.detected_at = time.time()


# What a failure can be raised as: catch these, then ``as_failure``.
FAILURES: tuple = (PeerFailure, MPI.Exception) if ULFM else (PeerFailure,)


def agree_all_alive(comm: MPI.Intracomm) -> None:
    """ULFM: returns on every member when all of ``comm`` live; otherwise raises the same
    MPI error (ERR_PROC_FAILED) on every survivor, so that all take the same path (a plain
    collective may complete on some members and fail on others). Blocking: callers hold a
    watchdog. Without ULFM: nothing (a death ends the job there)."""
    if ULFM:
        comm.Agree(1)


class CommView:
    """The little of a World that the broadcasts use (``comm``, ``rank``, ``size``,
    ``version``, ``watch``), for another communicator: a part of the world, or the bridge
    between rank 0 and one joiner."""

    def __init__(self, comm, version: int, watch: "PeerWatch"):
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.version = version
        self.watch = watch


class PeerWatch:
    """How long a wait on peers may last, and how to tell that a peer is dead.

    Liveness: the pids of the world's peers on this node (checked every ``check_s`` while a
    wait lasts; a pid gone or a zombie is a dead rank, noticed within a fraction of a
    second) and any ``sources`` added (callables returning why a peer is dead, or None:
    rank 0 adds the joiners' launchers). Deadline: ``max(floor, PEER_TIMEOUT_STEPS x the
    median step time)``, applied only where some peer's liveness cannot be seen (``blind``:
    peers on other nodes): a slow peer that is alive on this node is waited for. A stop
    signal noticed while waiting blind (``stop_signals.received``, the job's
    ``StopSignals``: state the watch reads, no call back into the job) shortens the deadline to
    ``stop_grace_s``: the job then ends, saving what it holds, instead of waiting on."""

    check_s = 0.05
    spin_s = 0.01        # busy polling first, as MPI_Wait does: short waits cost nothing
    stop_grace_s = 5.0

    def __init__(self, rank: int, local_peers: List[Tuple[int, int]], *, blind: bool = True):
        self.rank = rank
        self.local_peers = local_peers
        self.blind = blind
        self.floor = PEER_TIMEOUT_FLOOR
        self.steps: deque = deque(maxlen=64)
        self.stop_signals = None  # anything with ``received``: a signal's name or None
        self.sources: List[Callable[[], Optional[Tuple[int, str]]]] = []

    def inherit(self, other: "PeerWatch") -> None:
        self.floor, self.stop_signals = other.floor, other.stop_signals
        self.steps = other.steps

    def dead_ranks(self) -> List[int]:
        """The ranks on this node known dead now (pid gone)."""
        return [rank for rank, _ in self._gone()]

    def _gone(self) -> List[Tuple[int, int]]:
        return [(rank, pid) for rank, pid in self.local_peers if not pid_alive(pid)]

    def note_step(self, seconds: float) -> None:
        self.steps.append(seconds)

    def deadline_s(self) -> float:
        median = statistics.median(self.steps) if self.steps else 0.0
        return max(self.floor, PEER_TIMEOUT_STEPS * median)

    def dead(self) -> Optional[Tuple[int, str]]:
        """(rank, why) of a peer known dead now, or None."""
        for rank, pid in self._gone()[:1]:
            return rank, f"rank {rank} (pid {pid} on this node) is gone"
        for source in self.sources:
            found = source()
            if found is not None:
                return found
        return None

    def wait(self, request: MPI.Request, what: str, deadline_s: Optional[float] = None) -> None:
        """Wait for ``request`` to complete, polling (a 10 ms spin, then short sleeps), or
        raise PeerFailure."""
        try:
            self._wait(request, what, deadline_s)
        except PeerFailure:
            ABANDONED.append(request)  # it keeps its buffer: MPI may still write into it
            raise

    def wait_any(self, requests: List[MPI.Request], what: str) -> int:
        """Wait until one of ``requests`` completes and return its index (polled like
        ``wait``; a receive per peer instead of one from MPI.ANY_SOURCE, which MPICH does
        not match across dynamically joined processes), or raise PeerFailure."""
        done: List[int] = []

        def test() -> bool:
            for i, request in enumerate(requests):
                if request.Test():
                    done.append(i)
                    return True
            return False

        self._wait_until(test, what, None)
        return done[0]

    def _wait(self, request: MPI.Request, what: str, deadline_s: Optional[float]) -> None:
        self._wait_until(request.Test, what, deadline_s)

    def _wait_until(self, test: Callable[[], bool], what: str,
                    deadline_s: Optional[float]) -> None:
        t0 = time.perf_counter()
        spin_until = t0 + self.spin_s
        next_check = t0 + self.check_s
        limit = t0 + (self.deadline_s() if deadline_s is None else deadline_s)
        while not _test(test, what):
            now = time.perf_counter()
            if now < spin_until:
                continue
            # Naps of 5% of the time waited so far (50 us to 2 ms): a wait ends at most
            # 5% late, and a long one leaves the core to others.
            time.sleep(min(0.002, max(5e-5, (now - t0) * 0.05)))
            if now < next_check:
                continue
            next_check = now + self.check_s
            waited = now - t0
            found = self.dead()
            if found is not None:
                raise PeerFailure(f"{found[1]}; noticed after {waited:.2f} s waiting in {what}",
                                  rank=found[0], waited_s=waited,
                                  cause="notice" if found[0] == NOTICE else "dead")
            if now > limit and (self.blind or deadline_s is not None):
                raise PeerFailure(f"no answer from a peer for {waited:.1f} s in {what} "
                                  f"(deadline {limit - t0:.1f} s: --peer-timeout)",
                                  waited_s=waited, cause="timeout")
            if self.blind and self.stop_signals is not None \
                    and self.stop_signals.received and waited > self.stop_grace_s:
                raise PeerFailure(f"a stop signal arrived while waiting {waited:.1f} s in "
                                  f"{what}", waited_s=waited, cause="stop")


def _test(test: Callable[[], bool], what: str) -> bool:
    try:
        return test()
    except MPI.Exception as exc:
        raise as_failure(exc, what) from None


def wait_request_done(request: MPI.Request, what: str) -> bool:
    """``request.Test()``, with an MPI error under ULFM raised as a PeerFailure."""
    return _test(request.Test, what)


def wait_request(request: MPI.Request, watch: Optional[PeerWatch], what: str,
                 deadline_s: Optional[float] = None) -> None:
    """Complete ``request``: at once when it is done, else a bounded wait through ``watch``
    (a plain deadline of PEER_TIMEOUT_FLOOR when there is none)."""
    if _test(request.Test, what):
        return
    if watch is None:
        watch = PeerWatch(-1, [])
    watch.wait(request, what, deadline_s)
