"""Elastic membership: grow by starting workers that initialise while training goes on and
join at an agreed step boundary; shrink by splitting the leavers off at a step boundary.

Growing (stop-free). Rank 0 opens an MPI port and asks the allocator for workers; they start,
build their model, write a ready file and call ``MPI_Comm_connect``. At every step boundary
rank 0 broadcasts the grow's status; when all joiners are ready, every rank of the running job
calls ``MPI_Comm_accept`` (once per joiner) and merges, and the state (parameters, optimizer,
data cursor, hyper-parameters, monitor and RNG state) is broadcast from rank 0. A joiner that
dies before it is ready, or a grow that times out, is abandoned: the job goes on at its size.

Shrinking. The leavers (the highest ranks, or the ones named) take ``Split(UNDEFINED)`` and
leave; the data cursor is global, so nothing is lost. A process that was launched alone (every
joiner) exits at once; one launched together with others waits, sleeping, for its siblings.

Growing on Open MPI. A worker started apart from the job cannot connect to it there (no
shared runtime between two ``mpirun``s), so the running job starts its joiners itself: a
collective ``MPI_Comm_spawn`` of every rank per joiner, in a thread of each so that training
goes on while they start (about 1.2 s each), over a duplicate of the world's communicator.
The joiners build their model, say they are ready to rank 0 over their spawn's
intercommunicator and wait for its word; at the boundary where all are ready, the job merges
with them, one after the other, and rank 0 sends the state. A joiner that dies first, a spawn that fails, or one that takes
longer than the join timeout is given up: the job goes on at its size.

Warm spares (``--warm-spares K``). Rank 0 starts K workers ahead, each with a folder of its
own marked ``spare``: they import, build the model and load the data like any joiner, say
they are warm, and idle (a sleep loop, watching rank 0's pid and their folder) until a grow
takes them by writing the port into their folder. A grow that finds enough warm spares joins
those instead of starting workers, so it waits for no start-up; new spares are started after
it, in the background. Spares hold slots (or nodes): opt-in.

The cluster version goes up exactly once per successful resize."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from hpcadapt.comm import world as _rt  # noqa: F401 (first: it sets MPI's environment)
from mpi4py import MPI  # noqa: E402

from hpcadapt.elastic.allocator import Allocator, Worker
from hpcadapt.base.config import JOIN_DIR_VARIABLE, SPARE_OF_VARIABLE, SPAWNED_VARIABLE
from hpcadapt.base.errors import AllocationError, ConfigurationError, MembershipError
from hpcadapt.comm.mpiflavour import flavour
from hpcadapt.comm.world import PeerFailure as PeerFailureType
from hpcadapt.comm.world import ABANDONED, PeerWatch, World, wait_request

__all__ = ["ElasticController", "JoinTicket", "join_running_job", "join_spawning_job",
           "accept_joiners", "split_leavers", "ResizeOutcome", "JoinAborted"]

log = logging.getLogger(__name__)

WAITING, JOIN, ABANDON = 0, 1, 2


@dataclass
class _PendingGrow:
    target: int
    reason: str
    port: str
    tickets: List["JoinTicket"]   # where each joiner finds the port and says it is ready
    workers: List[Worker]
    decided_at: float
    deadline: float


@dataclass(frozen=True)
class ResizeOutcome:
    """What a resize did, for the metrics line and the policies."""

    old_size: int
    new_size: int
    reason: str
    pause_s: float
    ok: bool
    decision_to_first_step_s: float = float("nan")


@dataclass(frozen=True)
class JoinTicket:
    """Where a joining worker finds the port and writes its ready file. The folder reaches
    the worker through its environment (``HPCADAPT_JOIN_DIR``); the id it claims there."""

    directory: str
    worker_id: int

    def port_file(self) -> str:
        return os.path.join(self.directory, "port")

    def ready_file(self) -> str:
        return os.path.join(self.directory, f"ready-{self.worker_id}")

    def turn_file(self) -> str:
        return os.path.join(self.directory, f"turn-{self.worker_id}")

    def wait_for_port(self) -> str:
        """The port to connect to: at once for a worker started for a grow. A warm spare (a
        ``spare`` file in its folder, naming rank 0's node and pid) first says it is warm
        and idles until a grow takes it (the port file appears), or until the job is gone
        (its folder removed, or rank 0's process gone): MembershipError."""
        marker = os.path.join(self.directory, SPARE_FILE)
        if os.path.exists(marker):
            with open(marker, encoding="utf-8") as f:
                node, owner = (int(x) for x in f.read().split())
            _write_atomic(os.path.join(self.directory, f"warm-{self.worker_id}"),
                          str(os.getpid()))
            while not os.path.exists(self.port_file()):
                if not os.path.isdir(self.directory) or (node == _rt.node_key()
                                                         and not _rt.pid_alive(owner)):
                    raise MembershipError("the job this spare waited for has ended")
                time.sleep(SPARE_POLL_S)
        try:
            with open(self.port_file(), encoding="utf-8") as f:
                return f.read().strip()
        except FileNotFoundError:
            raise MembershipError(f"no port file in {self.directory}: the job this worker "
                                  f"was started for has ended or given up the grow") from None

    @classmethod
    def claim(cls, directory: str, limit: int = 4096) -> "JoinTicket":
        """The first worker id in ``directory`` no other joiner has claimed (an exclusive
        create: two joiners never get the same id)."""
        for i in range(limit):
            try:
                fd = os.open(os.path.join(directory, f"claim-{i}"),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                continue
            except FileNotFoundError:
                raise MembershipError(f"the join folder {directory} is gone: the job this "
                                      f"worker was started for has ended or given up the "
                                      f"grow") from None
            os.close(fd)
            return cls(directory, i)
        raise MembershipError(f"no free worker id in {directory}")


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


SPARE_FILE = "spare"
SPARE_POLL_S = 0.005   # how often an idle spare looks for its port (a stat call)

_JOIN_TAG = 7707
_PING_TAG = 7708
ACCEPT_TIMEOUT = 30.0   # seconds a joiner given its turn may take to connect


class JoinAborted(Exception):
    """A join given up on every rank taking part (a joiner died or never connected); the
    running job's communicator is unchanged."""


def _release_accept(port: str, thread: threading.Thread) -> float:
    """End an ``MPI_Comm_accept`` blocked in ``thread`` whose joiner will never connect.
    MPICH cannot cancel an accept, and connecting to one's own port from the same process
    hangs; a tiny process of its own (``mpiexec -n 1``, mpi4py only, about 0.3 s) connects
    and disconnects. Returns the seconds it took (NaN when the accept stayed blocked)."""
    from hpcadapt.elastic.allocator import find_mpiexec, launcher_free_environ

    t0 = time.perf_counter()
    code = ("import sys\nfrom mpi4py import MPI\n"
            "c = MPI.COMM_SELF.Connect(sys.argv[1])\nc.Disconnect()\n")
    try:
        proc = subprocess.Popen([find_mpiexec(None), "-n", "1", sys.executable, "-c", code, port],
                                env=launcher_free_environ(), stdin=subprocess.DEVNULL)
    except OSError as exc:
        log.error("could not start the process that releases a pending accept: %s", exc)
        return float("nan")
    thread.join(timeout=30)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return float("nan") if thread.is_alive() else time.perf_counter() - t0


def _accept_watched(port: str, worker: Optional[Worker], timeout: float):
    """Rank 0: accept one joiner while watching it (its launcher's exit) and the clock.
    Returns (intercommunicator, "") or (None, why)."""
    box = {}

    def accept() -> None:
        box["inter"] = MPI.COMM_SELF.Accept(port, root=0)

    thread = threading.Thread(target=accept, name="hpcadapt-accept", daemon=True)
    t0 = time.perf_counter()
    thread.start()
    why = ""
    while thread.is_alive():
        thread.join(0.01)
        if not thread.is_alive():
            break
        dead = worker.failed() if worker is not None else None
        if dead:
            why = f"joining worker {dead.replace(' during start-up', '')} before it connected"
        elif time.perf_counter() - t0 > timeout:
            why = f"joining worker did not connect within {timeout:.0f} s"
            if worker is not None:
                worker.stop()
        if why:
            took = _release_accept(port, thread)
            log.info("pending accept released in %.2f s", took)
            inter = box.get("inter")
            if inter is not None:
                inter.Disconnect()
            return None, why
    return box["inter"], ""


def accept_joiners(comm: MPI.Intracomm, port: str, count: int,
                   tickets: Sequence[JoinTicket] = (), workers: Sequence[Worker] = (),
                   watch: Optional[PeerWatch] = None,
                   accept_timeout: float = ACCEPT_TIMEOUT,
                   on_bridge=None) -> MPI.Intracomm:
    """Collective over ``comm`` (running job plus joiners merged so far): admit ``count``
    joiners one at a time; returns the merged communicator (``comm`` itself is kept).

    Only rank 0 accepts (on its own), which gives a two-process bridge to the joiner; the
    whole job then builds an intercommunicator to the joiner across that bridge. (A
    collective Accept over a job whose processes came from several launches crashed MPICH
    here; the bridge needs the new connection on rank 0 only.)

    Rank 0 accepts in a helper thread while it watches the joiner (``workers``: its
    launcher's exit) and a deadline, and hears from the joiner (a ping) before anything
    collective involves it; the others wait (bounded) for rank 0's word. ``on_bridge(bridge,
    watch)`` (rank 0) then sends the joiner the state over the two-process bridge, with waits
    bounded by ``watch`` (the joiner's pid and launcher), before anything involves the whole
    job: a joiner dying until then (the state transfer included) raises JoinAborted on every
    rank, and ``comm`` still works. What is left unpolled (Create_intercomm, Merge: a few
    milliseconds) is the caller's to guard (``runtime.Watchdog``)."""
    current = comm
    remaining = np.array([count], dtype=np.int64)
    while True:
        wait_request(current.Ibcast(remaining, root=0), watch, "a join")
        if remaining[0] == 0:
            return current
        bridge = MPI.COMM_SELF
        status = np.array([1], dtype=np.int64)
        why = ""
        if current.Get_rank() == 0:
            index = count - int(remaining[0])
            worker = workers[index] if index < len(workers) else None
            # Joiners connect one at a time, in their id order, when given the turn:
            # concurrent connects to one port crashed MPICH here.
            _write_atomic(tickets[index].turn_file(), "go")
            inter, why = _accept_watched(port, worker, accept_timeout)
            if inter is not None:
                ping = np.zeros(1, dtype=np.int64)
                try:
                    wait_request(inter.Irecv(ping, source=0, tag=_PING_TAG),
                                 _JoinerWatch(worker), "a joiner's first word",
                                 deadline_s=accept_timeout)
                except PeerFailureType as exc:
                    why = f"joining worker lost after it connected: {exc}"
                    inter = None  # not disconnected: its peer is gone
            if inter is None:
                status[0] = 0
            else:
                bridge = inter.Merge(high=False)
                inter.Disconnect()
                if on_bridge is not None:
                    bridge_watch = PeerWatch(0, [(1, int(ping[0]))], blind=False)
                    if worker is not None:
                        bridge_watch.sources.append(
                            lambda: (-1, f"joining worker {worker.failed()}")
                            if worker.failed() else None)
                    try:
                        on_bridge(bridge, bridge_watch)
                    except PeerFailureType as exc:
                        why = f"joining worker lost during the state transfer: {exc}"
                        status[0] = 0
                        bridge = MPI.COMM_SELF  # not freed: its peer is gone
        wait_request(current.Ibcast(status, root=0), watch, "a join")
        if not status[0]:
            if current is not comm:
                current.Free()
            raise JoinAborted(why or "rank 0 gave the join up")
        inter = current.Create_intercomm(0, bridge, 1, tag=_JOIN_TAG)
        merged = inter.Merge(high=False)
        inter.Disconnect()
        if bridge != MPI.COMM_SELF:
            bridge.Free()
        if current is not comm:
            current.Free()
        current = merged
        if current.Get_rank() == 0:
            remaining[0] -= 1


def join_running_job(ticket: JoinTicket, on_bridge=None,
                     port: Optional[str] = None) -> MPI.Intracomm:
    """In a joining worker: say it is ready, connect to rank 0 of the running job, receive
    the state over that bridge (``on_bridge(bridge)``), join the whole job across it, and
    take part in admitting the joiners after it; returns the job's new communicator.
    ``port``: already read (``ticket.wait_for_port()``)."""
    if port is None:
        port = ticket.wait_for_port()
    try:
        _write_atomic(ticket.ready_file(), str(os.getpid()))
    except FileNotFoundError:
        raise MembershipError(f"the join folder {ticket.directory} is gone: the job gave up "
                              f"the grow") from None
    turn = ticket.turn_file()
    while not os.path.exists(turn):
        if not os.path.isdir(ticket.directory):
            raise MembershipError(f"the join folder {ticket.directory} is gone: the job "
                                  f"gave up the grow")
        time.sleep(0.005)
    inter = MPI.COMM_WORLD.Connect(port, root=0)
    ping = np.array([os.getpid()], dtype=np.int64)
    wait_request(inter.Isend(ping, dest=0, tag=_PING_TAG), None, "the first word to the job")
    bridge = inter.Merge(high=True)
    inter.Disconnect()
    if on_bridge is not None:
        on_bridge(bridge)
    inter = MPI.COMM_WORLD.Create_intercomm(0, bridge, 0, tag=_JOIN_TAG)
    merged = inter.Merge(high=True)
    inter.Disconnect()
    bridge.Free()
    return accept_joiners(merged, port, 0)


class _JoinerWatch:
    """A PeerWatch-like view of one joining worker: dead when its launcher has exited."""

    blind = True

    def __init__(self, worker: Optional[Worker]):
        self.worker = worker

    def wait(self, request, what, deadline_s=None):
        watch = PeerWatch(-1, [])
        if self.worker is not None:
            worker = self.worker
            watch.sources.append(lambda: (-1, f"joining worker {worker.failed()}")
                                 if worker.failed() else None)
        watch.wait(request, what, deadline_s)


_READY_TAG = 7709   # a spawned joiner to rank 0: ready (its pid)
_WORD_TAG = 7710    # rank 0 to a spawned joiner: [GO or GIVE_UP, its place, joiners]
_CHAIN_TAG = 7711   # the intercommunicators that chain the joiners into one world
_PORT_TAG = 7712    # rank 0 to a warm spare (Open MPI): the port to connect to
GO, GIVE_UP = 1, 0


class _SpawnedGrow:
    """Open MPI: the joiners of one grow, each started by a collective ``MPI_Comm_spawn`` of
    its own (Open MPI's runtime ends every process of a spawn when one of them dies, so
    one spawn per joiner keeps their deaths apart), over a duplicate of the world's
    communicator, from a thread on every rank (a spawn blocks until the joiner's MPI has
    started; training goes on meanwhile on the world's own communicator)."""

    def __init__(self, comm: MPI.Intracomm, argv: Sequence[str], count: int):
        self.count = count
        self.comm = comm.Dup()
        self.inters: List[MPI.Intercomm] = []
        self.error = ""
        self._pids = np.zeros(count, dtype=np.int64)
        self._ready: Optional[list] = None
        self.thread = threading.Thread(target=self._spawn, args=(list(argv),),
                                       name="hpcadapt-spawn", daemon=True)
        self.thread.start()

    def _spawn(self, argv: List[str]) -> None:
        info = MPI.Info.Create()
        try:
            info.Set("PMIX_ENVAR", f"{SPAWNED_VARIABLE}=1")  # Open MPI's key for one variable
            info.Set("wdir", os.getcwd())
            for _ in range(self.count):
                inter = self.comm.Spawn(sys.executable, args=argv, maxprocs=1, info=info,
                                        root=0)
                inter.Set_errhandler(MPI.ERRORS_RETURN)
                self.inters.append(inter)
        except MPI.Exception as exc:
            self.error = f"MPI_Comm_spawn failed: {exc.Get_error_string()}"
        finally:
            info.Free()

    def ready(self) -> Tuple[bool, str]:
        """Rank 0: (all joiners ready, why the grow cannot go on: "" while it can)."""
        if self.thread.is_alive():
            return False, ""
        if self.error:
            return False, self.error
        if self._ready is None:
            self._ready = [inter.Irecv(self._pids[i:i + 1], source=0, tag=_READY_TAG)
                           for i, inter in enumerate(self.inters)]
        try:
            done = [req.Test() for req in self._ready]
        except MPI.Exception as exc:
            return False, f"a spawned joiner died before it was ready ({exc.Get_error_string()})"
        return all(done), ""

    def merge(self) -> MPI.Intracomm:
        """Every rank of the running job: tell the joiners to go and merge with them, one
        after the other (each merge gives the parents and one joiner a communicator over
        which the world so far and that joiner build an intercommunicator), letting go of
        each spawn's intercommunicator (both sides must, or the joiners hang at exit)."""
        self.thread.join()  # returned or about to: the spawn is collective
        if self.error or len(self.inters) < self.count:
            raise JoinAborted(self.error or "the spawn did not return")
        _parents_all_alive(self)
        parents = self.comm.Get_size()
        current = self.comm
        try:
            if self.comm.Get_rank() == 0:
                # Completed before the merge: a request left on a spawn's intercommunicator
                # after its Disconnect crashed Open MPI's revoke when a joiner later died.
                for i, inter in enumerate(self.inters):
                    inter.Send(np.array([GO, i, self.count], dtype=np.int64), dest=0,
                               tag=_WORD_TAG)
            for inter in self.inters:
                pair = inter.Merge(high=False)   # the parents, then this joiner
                current = _chain(current, pair, parents, self.count, self.comm)
                inter.Disconnect()
        except MPI.Exception as exc:
            self.give_up()
            raise JoinAborted(f"a spawned joiner died while it merged "
                              f"({exc.Get_error_string()})") from None
        self.comm.Free()
        return current

    def give_up(self, wait_s: float = 0.0) -> None:
        """Every rank: the joiners are told to exit (rank 0); the spawn's communicators are
        left unfreed (a dead joiner would make freeing wait). ``wait_s``: for a spawn still
        under way to return first (a process that exits during its spawn fails the launch)."""
        t_end = time.perf_counter() + wait_s
        self.thread.join(timeout=wait_s)
        if self.comm.Get_rank() == 0 and not self.thread.is_alive():
            # A joiner that reaches its first word after this process has gone blocks in
            # Open MPI's connection set-up (PMIx_Get) for good: wait (bounded) for each
            # joiner's ready word, then tell it, completing the send.
            while wait_s and time.perf_counter() < t_end:
                ready, why = self.ready()
                if ready or why:
                    break
                time.sleep(0.01)
            _tell_give_up(self.inters, t_end)
        ABANDONED.extend([self.inters, self.comm, self.thread])


def _parents_all_alive(grow) -> None:
    """Before a grow (spawned joiners or warm spares) merges: MPI_Intercomm_merge stays
    blocked on a parent that died (revoking does not release it), so the parents first agree
    that all of them live (under ULFM: the same outcome on every survivor). A death is the
    job's own failure, raised for the caller to recover from; the joiners are let go."""
    try:
        _rt.agree_all_alive(grow.comm)
    except MPI.Exception:
        grow.give_up()
        raise


def _give_up_bounded(grow_or_pool, wait_s: float) -> None:
    """``give_up(wait_s)`` of a pending grow or of the spare pool, bounded by the kernel too
    when it waits: a joiner's crash has deadlocked Open MPI itself in such a wait (the Open
    MPI soak), below any deadline of this code."""
    with _rt.KernelDeadline(wait_s + 30.0) if wait_s > 0 else nullcontext():
        grow_or_pool.give_up(wait_s)


def _chain(current: MPI.Intracomm, pair: MPI.Intracomm, parents: int, count: int,
           base: MPI.Intracomm) -> MPI.Intracomm:
    """The running job's side of one joiner's merge: ``pair`` (the parents, then that
    joiner) joins the world so far (``current``: the joiners before it too) into one; with
    a single joiner the pair is the new world. ``base`` (the parents' own) is kept."""
    if count == 1:
        return pair
    link = current.Create_intercomm(0, pair, parents, tag=_CHAIN_TAG)
    merged = link.Merge(high=False)
    link.Free()
    pair.Free()
    if current is not base:
        current.Free()
    return merged


class _SparePool:
    """Open MPI, rank 0: warm spares for ``--warm-spares``. Each is spawned by rank 0 alone
    (``MPI_COMM_SELF``; one spawn at a time, in a background thread), so a later death of
    another rank leaves it usable: a grow hands it a port to connect to the world of that
    moment. (A spare spawned by the whole world is tied to that world, and crashed or hung
    at its exit once a rank of it had died: measured on Open MPI 5.0.11.)"""

    def __init__(self, argv: Sequence[str]):
        self.argv = list(argv)
        self.spares: List[list] = []   # [intercommunicator, ready request, pid buffer]
        self.thread: Optional[threading.Thread] = None
        self.error = ""
        self.reported = 0              # spares said ready so far (the log line)

    def fill(self, want: int) -> None:
        """Start one more spare when fewer than ``want`` are up or starting."""
        if self.error or (self.thread is not None and self.thread.is_alive()):
            return
        if len(self.spares) < want:
            self.thread = threading.Thread(target=self._spawn, name="hpcadapt-spare",
                                           daemon=True)
            self.thread.start()

    def _spawn(self) -> None:
        info = MPI.Info.Create()
        try:
            info.Set("PMIX_ENVAR", f"{SPAWNED_VARIABLE}=1\n"
                                   f"{SPARE_OF_VARIABLE}={_rt.node_key()}:{os.getpid()}")
            info.Set("wdir", os.getcwd())
            inter = MPI.COMM_SELF.Spawn(sys.executable, args=self.argv, maxprocs=1, info=info,
                                        root=0)
            inter.Set_errhandler(MPI.ERRORS_RETURN)
            pid = np.zeros(1, dtype=np.int64)
            self.spares.append([inter, inter.Irecv(pid, source=0, tag=_READY_TAG), pid])
        except MPI.Exception as exc:
            self.error = f"MPI_Comm_spawn failed: {exc.Get_error_string()}"
        finally:
            info.Free()

    def ready(self) -> List[list]:
        """The spares ready now; one that died is dropped (one line)."""
        out = []
        for spare in list(self.spares):
            try:
                if spare[1].Test():
                    out.append(spare)
            except MPI.Exception as exc:
                log.error("a warm spare died before it was used (%s)", exc.Get_error_string())
                self.spares.remove(spare)
                ABANDONED.append(spare[0])
        if len(out) > self.reported:
            log.info("warm spares ready: %d (pids %s)", len(out),
                     [int(sp[2][0]) for sp in out])
        self.reported = len(out)
        return out

    def take(self, count: int) -> List[list]:
        taken = self.ready()[:count]
        for spare in taken:
            self.spares.remove(spare)
        self.reported -= len(taken)
        return taken

    def give_up(self, wait_s: float) -> None:
        """Tell every spare to exit (each once it is ready, bounded by ``wait_s``: one that
        hears the word before its start-up is done blocks in Open MPI's connection set-up)."""
        t_end = time.perf_counter() + wait_s
        if self.thread is not None:
            self.thread.join(timeout=wait_s)
        while self.spares and len(self.ready()) < len(self.spares) and \
                time.perf_counter() < t_end:
            time.sleep(0.01)
        _tell_give_up([sp[0] for sp in self.spares], t_end)
        self.spares = []


def _tell_give_up(inters: Sequence[MPI.Intercomm], t_end: float) -> None:
    """Rank 0: GIVE_UP to each joiner or spare behind ``inters`` (a completed send where it
    completes by ``t_end``; a dead one is skipped)."""
    for inter in inters:
        word = np.array([GIVE_UP, 0, 0], dtype=np.int64)
        try:
            request = inter.Isend(word, dest=0, tag=_WORD_TAG)
            while not request.Test() and time.perf_counter() < t_end:
                time.sleep(0.001)
            ABANDONED.extend([word, request])
        except MPI.Exception:
            pass  # that process is dead
    ABANDONED.extend(inters)


class _SpareGrow:
    """Open MPI: a grow served by warm spares (rank 0 holds them): rank 0 sends each its
    place and a port, the world accepts them one after the other on that port and chains
    them into one world as spawned joiners are; then rank 0 lets go of each spare's spawn."""

    def __init__(self, comm: MPI.Intracomm, spares: List[list], count: int):
        self.comm = comm
        self.spares = spares   # rank 0's; empty elsewhere
        self.count = count

    def ready(self) -> Tuple[bool, str]:
        return True, ""

    def merge(self) -> MPI.Intracomm:
        _parents_all_alive(self)
        root = self.comm.Get_rank() == 0
        port = MPI.Open_port() if root else ""
        current, parents = self.comm, self.comm.Get_size()
        try:
            for i, spare in enumerate(self.spares):
                spare[0].Send(np.array([GO, i, self.count], dtype=np.int64), dest=0,
                              tag=_WORD_TAG)
                spare[0].Send(np.frombuffer(port.encode(), dtype=np.uint8), dest=0,
                              tag=_PORT_TAG)
            for _ in range(self.count):
                bridge = self.comm.Accept(port, root=0)
                current = _chain(current, bridge.Merge(high=False), parents, self.count,
                                 self.comm)
                bridge.Disconnect()
            for spare in self.spares:
                spare[0].Disconnect()
        except MPI.Exception as exc:
            raise JoinAborted(f"a warm spare died while it merged "
                              f"({exc.Get_error_string()})") from None
        finally:
            if root:
                MPI.Close_port(port)
        return current

    def give_up(self, wait_s: float = 0.0) -> None:
        _tell_give_up([sp[0] for sp in self.spares], time.perf_counter() + wait_s)
        self.spares = []


def _spare_parent_gone(spare_of: str) -> bool:
    """A warm spare: whether the rank 0 that spawned it is known dead (its pid gone from
    this node; from another node nothing is known until the job's end)."""
    try:
        node, pid = (int(x) for x in spare_of.split(":"))
    except ValueError:
        return False
    return node == _rt.node_key() and not _rt.pid_alive(pid)


def join_spawning_job(deadline_s: float, spare_of: str = "") -> MPI.Intracomm:
    """In a worker the job spawned (Open MPI): say it is ready to rank 0, wait for its word
    (bounded by ``deadline_s``; the job's death is an MPI error under ULFM), merge with the
    job and then take part in merging the joiners after it; returns the job's new
    communicator. The state comes next, from rank 0."""
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise MembershipError(f"{SPAWNED_VARIABLE} is set but this process was not started "
                              f"by MPI_Comm_spawn")
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    pid = np.array([os.getpid()], dtype=np.int64)
    word = np.array([GIVE_UP, 0, 0], dtype=np.int64)
    try:
        sent = parent.Isend(pid, dest=0, tag=_READY_TAG)
        heard = parent.Irecv(word, source=0, tag=_WORD_TAG)
        t_end = time.perf_counter() + deadline_s
        while not heard.Test():
            if time.perf_counter() > t_end:
                raise MembershipError(f"no word from the job within {deadline_s:.0f} s")
            if spare_of and _spare_parent_gone(spare_of):
                raise MembershipError("the rank that started this warm spare is gone")
            time.sleep(0.05 if spare_of else 0.005)
        sent.Wait()
    except MPI.Exception as exc:
        raise MembershipError(f"the job that spawned this worker is gone "
                              f"({exc.Get_error_string()})") from None
    if word[0] != GO:
        raise MembershipError("the job gave the grow up")
    place, count = int(word[1]), int(word[2])
    try:
        bridge = parent
        if spare_of:   # a warm spare connects to the world of this moment through a port
            port = np.zeros(MPI.MAX_PORT_NAME, dtype=np.uint8)
            status = MPI.Status()
            parent.Recv(port, source=0, tag=_PORT_TAG, status=status)
            bridge = MPI.COMM_SELF.Connect(port[:status.Get_count()].tobytes().decode(),
                                           root=0)
        pair = bridge.Merge(high=True)
        if count == 1:
            current = pair
        else:
            link = MPI.COMM_WORLD.Create_intercomm(0, pair, 0, tag=_CHAIN_TAG)
            current = link.Merge(high=True)
            link.Free()
            pair.Free()
        bridge.Disconnect()
        for _ in range(place + 1, count):   # the joiners after this one
            link = current.Create_intercomm(0, MPI.COMM_SELF, 0, tag=_CHAIN_TAG)
            merged = link.Merge(high=False)
            link.Free()
            current.Free()
            current = merged
        if spare_of:
            parent.Disconnect()   # rank 0 lets go of the spare's spawn last
    except MPI.Exception as exc:
        raise JoinAborted(f"the merge with the job failed ({exc.Get_error_string()})") \
            from None
    return current


def split_leavers(comm: MPI.Intracomm, leavers: Sequence[int]) -> Optional[MPI.Intracomm]:
    """Collective: the ranks in ``leavers`` get None, the others a communicator in rank order."""
    me = comm.Get_rank()
    color = MPI.UNDEFINED if me in leavers else 0
    new = comm.Split(color, key=me)
    return None if new == MPI.COMM_NULL else new


class ElasticController:
    """Carries out resize requests for a trainer at step boundaries.

    ``joiner_argv`` is what a joining worker runs (``python ARGV``: the job's own script and
    arguments); the join folder reaches it as ``HPCADAPT_JOIN_DIR`` in its environment. ``on_joined(old_size, new_size)`` runs on every rank of
    the new world right after the join (state sync); ``on_left`` on every remaining rank.
    ``join_root`` holds the folders joiners find the port in: it must be visible from every
    node a joiner may start on (Slurm: the job's working folder, not /tmp)."""

    def __init__(self, world: World, allocator: Allocator, joiner_argv: Sequence[str], *,
                 join_timeout: float = 120.0, min_workers: int = 1,
                 join_root: Optional[str] = None):
        self.world = world
        self.allocator = allocator
        self.joiner_argv = list(joiner_argv)
        self.join_timeout = join_timeout
        self.min_workers = min_workers
        self.join_root = join_root
        self.accept_timeout = ACCEPT_TIMEOUT
        self.pending: Optional[_PendingGrow] = None
        self.warm_spares = 0   # spares to keep (rank 0 keeps them; see keep_spares)
        self.spares: List[Tuple[JoinTicket, Worker]] = []
        self._clip_logged = False
        self.growing = False   # known on every rank: a grow is pending
        # Open MPI: joiners are spawned by the job (every rank holds the pending spawn)
        self.spawns = flavour().open_mpi
        self._spawned = None   # the pending _SpawnedGrow or _SpareGrow (Open MPI)
        # Open MPI, --warm-spares: known on every rank (whether a grow asks rank 0 for
        # spares); the pool is rank 0's
        self.spare_pool_used = False
        self._pool = _SparePool(self.joiner_argv) if self.spawns else None

    # -- requests (every rank, at the same point) -----------------------------------------
    def clip(self, new_size: int, reason: str) -> Optional[int]:
        """The size a request can get, or None when it cannot be carried out (logged)."""
        cap = self.allocator.capacity()
        if new_size < self.min_workers:
            self._refuse(f"resize to {new_size} refused ({reason}): the job keeps at least "
                         f"{self.min_workers} worker(s) (--min-workers)")
            return None
        if new_size > cap:
            self._refuse(f"resize to {new_size} clipped to {cap} ({reason}): the allocator "
                         f"provides at most {cap} workers")
            new_size = cap
        if new_size == self.world.size:
            return None
        if self.growing:
            self._refuse(f"resize to {new_size} refused ({reason}): a grow is still pending")
            return None
        return new_size

    def _refuse(self, message: str) -> None:
        if self.world.rank == 0:
            log.warning(message)

    def start_grow(self, target: int, reason: str) -> Optional[ResizeOutcome]:
        """Every rank: mark the grow pending; rank 0 takes its spares (``--warm-spares``)
        and launches joiners for the rest. A launch that fails is reported on every rank
        (rank 0 broadcasts it) and nothing changes."""
        if self.spawns:
            return self._start_spawned_grow(target, reason)
        error = ""
        if self.world.rank == 0:
            count = target - self.world.size
            port = MPI.Open_port()
            now = time.perf_counter()
            # Spares first (warm ones before those still starting), started workers for
            # the rest.
            live = [sp for sp in self.spares if sp[1].failed() is None]
            warm = self._warm_spares()
            taken = (warm + [sp for sp in live if sp not in warm])[:count]
            tickets, workers = [t for t, _ in taken], [w for _, w in taken]
            directory = None
            try:
                if len(taken) < count:
                    directory = self._folder("hpcadapt-join-")
                    _write_atomic(os.path.join(directory, "port"), port)
                    cold = count - len(taken)
                    workers += self.allocator.launch([list(self.joiner_argv)] * cold,
                                                     {JOIN_DIR_VARIABLE: directory})
                    tickets += [JoinTicket(directory, i) for i in range(cold)]
            except AllocationError as exc:
                MPI.Close_port(port)
                _remove_folder(directory)
                error = str(exc)
            else:
                self.spares = [sp for sp in self.spares if sp not in taken]
                for ticket, _ in taken:
                    _write_atomic(ticket.port_file(), port)
                log.info("grow %d -> %d: started %d joining workers, took %d spare(s) (%d "
                         "warm) (%s)", self.world.size, target, count - len(taken),
                         len(taken), len([sp for sp in taken if sp in warm]), reason)
                self.pending = _PendingGrow(target, reason, port, tickets, workers, now,
                                            now + self.join_timeout)
        failed = _bcast_flag(self.world.comm, bool(error), self.world.watch)
        if failed:
            if self.world.rank == 0:
                log.error("grow to %d abandoned: %s; training goes on with %d workers",
                          target, error, self.world.size)
            return ResizeOutcome(self.world.size, target, f"{reason}; failed: {error}", 0.0, False)
        self.growing = True
        return None

    def _start_spawned_grow(self, target: int, reason: str) -> Optional[ResizeOutcome]:
        """Every rank (Open MPI): start the collective spawn of the joiners in the
        background (a worker started from outside cannot connect to this launch there)."""
        count = target - self.world.size
        now = time.perf_counter()
        spares: List[list] = []
        from_spares = False
        if self.spare_pool_used:
            # Rank 0 says whether its warm spares serve the whole grow (else it spawns).
            enough = self.world.rank == 0 and len(self._pool.ready()) >= count
            from_spares = _bcast_flag(self.world.comm, enough, self.world.watch)
        if from_spares:
            spares = self._pool.take(count) if self.world.rank == 0 else []
            reason = f"{reason}; from warm spares"
            self._spawned = _SpareGrow(self.world.comm, spares, count)
        else:
            self._spawned = _SpawnedGrow(self.world.comm, self.joiner_argv, count)
        self.pending = _PendingGrow(target, reason, "", [], [], now, now + self.join_timeout)
        if self.world.rank == 0:
            log.info("grow %d -> %d: %s %d joining workers (%s)", self.world.size, target,
                     "taking" if spares else "spawning", count, reason)
        self.growing = True
        return None

    # -- at every step boundary ---------------------------------------------------------------
    def poll_grow(self) -> Tuple[int, int, str]:
        """Every rank: (status, joiners, detail) agreed through rank 0. JOIN: accept now."""
        status = np.array([WAITING, 0], dtype=np.int64)
        detail = ""
        if self.world.rank == 0 and self._spawned is not None:
            ready, why = self._spawned.ready()
            if why:
                status[0], detail = ABANDON, why
            elif ready:
                status[:] = (JOIN, self._spawned.count)
            elif time.perf_counter() > self.pending.deadline:
                status[0] = ABANDON
                detail = (f"the spawned joining workers were not ready after "
                          f"{self.join_timeout:.0f} s")
        elif self.world.rank == 0 and self.pending is not None:
            p = self.pending
            dead = [(i, w.failed()) for i, w in enumerate(p.workers) if w.failed()]
            ready = [os.path.exists(t.ready_file()) for t in p.tickets]
            if dead:
                i, why = dead[0]
                status[0], detail = ABANDON, f"joining worker {i} {why}"
            elif all(ready):
                status[:] = (JOIN, len(p.workers))
            elif time.perf_counter() > p.deadline:
                status[0] = ABANDON
                detail = (f"{sum(not r for r in ready)} of {len(ready)} joining workers not "
                          f"ready after {self.join_timeout:.0f} s")
        wait_request(self.world.comm.Ibcast(status, root=0), self.world.watch,
                     "the grow's status")
        return int(status[0]), int(status[1]), detail

    def join(self, count: int, on_bridge=None) -> MPI.Intracomm:
        """Every rank of the running job: accept the joiners; returns the new communicator.
        Joiners that were spawned (Open MPI) merge at once; the caller then sends them the
        state (``on_bridge`` is for joiners that connect through the port)."""
        if self._spawned is not None:
            try:
                return self._spawned.merge()
            finally:
                self._spawned = None
                self._finish_grow()
        port = self.pending.port if self.pending is not None else ""
        tickets = self.pending.tickets if self.pending is not None else []
        workers = self.pending.workers if self.pending is not None else []
        new = accept_joiners(self.world.comm, port, count, tickets, workers,
                             self.world.watch, min(self.accept_timeout, self.join_timeout),
                             on_bridge)
        self._finish_grow()
        return new

    def abandon(self, detail: str, wait_s: float = 0.0) -> ResizeOutcome:
        """Every rank: give the pending grow up. ``wait_s``: how long a spawn still under way
        (Open MPI) may take to return, so that its joiners hear the word before this
        process exits (at the end of training; a recovery cannot wait on it)."""
        target = self.pending.target if self.pending is not None else -1
        reason = self.pending.reason if self.pending is not None else ""
        if self.world.rank == 0:
            log.error("grow to %d abandoned (%s): %s; training goes on with %d workers",
                      target, reason, detail, self.world.size)
            for w in self.pending.workers:
                w.stop()
        if self._spawned is not None:
            _give_up_bounded(self._spawned, wait_s)
            self._spawned = None
        self._finish_grow()
        return ResizeOutcome(self.world.size, target, f"{reason}; abandoned: {detail}", 0.0, False)

    def remove_join_folders(self) -> None:
        """Rank 0: the pending grow's join folders go (also when the job ends by a failure:
        the port and the communicators are then left to the exit)."""
        for directory in sorted({t.directory for t in self.pending.tickets}
                                if self.pending is not None else ()):
            if os.path.isdir(directory):
                _remove_folder(directory)

    def _finish_grow(self) -> None:
        if self.pending is not None and self.pending.port:
            MPI.Close_port(self.pending.port)
        self.remove_join_folders()
        self.pending = None
        self.growing = False

    # -- warm spares (rank 0) -----------------------------------------------------------------
    def _folder(self, prefix: str) -> str:
        if self.join_root:
            os.makedirs(self.join_root, mode=0o700, exist_ok=True)
        return tempfile.mkdtemp(prefix=prefix, dir=self.join_root)

    def _warm_spares(self) -> List[Tuple[JoinTicket, Worker]]:
        return [(t, w) for t, w in self.spares
                if w.failed() is None and os.path.exists(
                    os.path.join(t.directory, f"warm-{t.worker_id}"))]

    def keep_spares(self) -> None:
        """Rank 0, between steps: start spares until ``warm_spares`` are up or starting,
        within the allocator's free slots (a request beyond them is clipped, logged once).
        A spare that died is dropped; one that dies before it was ever warm stops the
        spares altogether (the same start-up would fail again), with the reason."""
        if self.world.rank != 0 or self.warm_spares <= 0 or self.growing:
            return
        if self.spawns:
            self._keep_spawned_spares()
            return
        for ticket, worker in list(self.spares):
            why = worker.failed()
            if why is None:
                continue
            self.spares.remove((ticket, worker))
            was_warm = os.path.exists(os.path.join(ticket.directory,
                                                   f"warm-{ticket.worker_id}"))
            _remove_folder(ticket.directory)
            if not was_warm:
                log.error("a warm spare %s before it was ready: no more spares are started "
                          "(--warm-spares)", why)
                self.warm_spares = 0
                self.stop_spares()
                return
        free = self.allocator.capacity() - self.world.size
        want = min(self.warm_spares, max(free, 0))
        if want < self.warm_spares and not self._clip_logged:
            # said once, at the start (later, a full job simply has no room for spares)
            log.warning("--warm-spares %d clipped to %d: the allocator has %d free slot(s) "
                        "beside the %d workers", self.warm_spares, want, max(free, 0),
                        self.world.size)
        self._clip_logged = True
        while len(self.spares) < want:
            directory = self._folder("hpcadapt-spare-")
            with open(os.path.join(directory, SPARE_FILE), "w", encoding="utf-8") as f:
                f.write(f"{_rt.node_key()} {os.getpid()}")
            try:
                worker = self.allocator.launch([list(self.joiner_argv)],
                                               {JOIN_DIR_VARIABLE: directory})[0]
            except AllocationError as exc:
                _remove_folder(directory)
                log.error("a warm spare could not be started (%s): no more spares", exc)
                self.warm_spares = 0
                return
            self.spares.append((JoinTicket(directory, 0), worker))

    def _keep_spawned_spares(self) -> None:
        """Open MPI, rank 0: spawn spares until ``warm_spares`` are up or starting, within
        the launch's free slots; a spawn that fails stops the spares (one line)."""
        self._pool.fill(min(self.warm_spares,
                            max(self.allocator.capacity() - self.world.size, 0)))
        self._pool.ready()   # drops the dead, says when more are ready
        if self._pool.error:
            log.error("a warm spare could not be started (%s): no more spares",
                      self._pool.error)
            self.warm_spares = 0

    def stop_spares(self, wait_s: float = 10.0) -> None:
        """Rank 0: stop the spares and remove their folders (at the end of training);
        Open MPI's spawned spares are told to exit (bounded by ``wait_s``, and by the
        kernel: a spare's crash has deadlocked Open MPI itself in such a wait)."""
        if self._pool is not None and (self._pool.spares or self._pool.thread is not None):
            _give_up_bounded(self._pool, wait_s)
        for ticket, worker in self.spares:
            worker.stop()
            if os.path.isdir(ticket.directory):
                _remove_folder(ticket.directory)
        self.spares = []

    def decided_at(self) -> float:
        return self.pending.decided_at if self.pending is not None else float("nan")


def _remove_folder(directory: str) -> None:
    """Remove a join folder and what is in it; a joiner may still be writing a file there
    (its claim, its ready file) while it goes: list again then."""
    for _ in range(5):
        for name in os.listdir(directory):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(directory)
            return
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
    log.warning("could not remove %s: a worker keeps writing into it", directory)


def _bcast_flag(comm: MPI.Intracomm, flag: bool, watch) -> bool:
    buf = np.array([int(flag)], dtype=np.int64)
    wait_request(comm.Ibcast(buf, root=0), watch, "a grow's start")
    return bool(buf[0])


def joiner_argv() -> List[str]:
    """How this process was started (``-m module`` or a script, with its arguments): a
    joining worker runs the same, so it builds the same model and data."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        name = spec.name[:-len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return ["-m", name] + sys.argv[1:]
    if not sys.argv or sys.argv[0] in ("", "-c", "-"):
        raise ConfigurationError("a job that may grow must run from a script or a module "
                                 "(python script.py or python -m module), not python -c or "
                                 "stdin: joining workers re-run it")
    return [os.path.abspath(sys.argv[0])] + sys.argv[1:]
