"""Joins through a port (MPICH, and warm spares started as their own launches): a joiner
claims a ticket in the join folder, waits for the port, connects; the running job accepts
its joiners one after the other, every wait bounded."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np

from hpcadapt.comm import world as _rt
from hpcadapt.comm.mpi import MPI

from hpcadapt.base.errors import MembershipError
from hpcadapt.comm.world import PeerFailure as PeerFailureType, PeerWatch, wait_request
from hpcadapt.elastic.allocator import Worker

__all__ = ["JoinTicket", "JoinAborted", "accept_joiners", "join_running_job", "wait_for_turn",
           "write_atomic", "SPARE_FILE", "OWNER_FILE", "ACCEPT_TIMEOUT"]

log = logging.getLogger(__name__)


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

    def job_gone(self) -> bool:
        """Whether the job that made this folder is gone: rank 0's process (named in the
        folder's ``owner`` or ``spare`` file, node and pid) ended on this node."""
        for name in (OWNER_FILE, SPARE_FILE):
            try:
                with open(os.path.join(self.directory, name), encoding="utf-8") as f:
                    node, owner = (int(x) for x in f.read().split())
            except (OSError, ValueError):
                continue
            return node == _rt.node_key() and not _rt.pid_alive(owner)
        return False

    def wait_for_port(self) -> str:
        """The port to connect to: at once for a worker started for a grow. A warm spare (a
        ``spare`` file in its folder, naming rank 0's node and pid) first says it is warm
        and idles until a grow takes it (the port file appears), or until the job is gone
        (its folder removed, or rank 0's process gone): MembershipError."""
        marker = os.path.join(self.directory, SPARE_FILE)
        if os.path.exists(marker):
            with open(marker, encoding="utf-8") as f:
                node, owner = (int(x) for x in f.read().split())
            write_atomic(os.path.join(self.directory, f"warm-{self.worker_id}"),
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


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


SPARE_FILE = "spare"
OWNER_FILE = "owner"   # a grow's join folder: rank 0's node and pid


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


def _no_phase(what: str) -> None:
    pass


def accept_joiners(comm: MPI.Intracomm, port: str, count: int,
                   tickets: Sequence[JoinTicket] = (), workers: Sequence[Worker] = (),
                   watch: Optional[PeerWatch] = None,
                   accept_timeout: float = ACCEPT_TIMEOUT,
                   on_bridge=None,
                   on_phase: Callable[[str], None] = _no_phase) -> MPI.Intracomm:
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
    milliseconds) is the caller's to guard (``runtime.Watchdog``); ``on_phase(what)`` names
    each phase as it starts (the watchdog's message says where a join blocked)."""
    current = comm
    remaining = np.array([count], dtype=np.int64)
    while True:
        on_phase("the joiners' count")
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
            write_atomic(tickets[index].turn_file(), "go")
            on_phase(f"the accept of joiner {index}")
            inter, why = _accept_watched(port, worker, accept_timeout)
            if inter is not None:
                ping = np.zeros(1, dtype=np.int64)
                on_phase(f"joiner {index}'s first word")
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
                on_phase(f"the merge of the bridge to joiner {index}")
                bridge = inter.Merge(high=False)
                inter.Disconnect()
                if on_bridge is not None:
                    on_phase(f"the state transfer to joiner {index}")
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
        on_phase("rank 0's word on the joiner")
        wait_request(current.Ibcast(status, root=0), watch, "a join")
        if not status[0]:
            if current is not comm:
                current.Free()
            raise JoinAborted(why or "rank 0 gave the join up")
        on_phase("the intercommunicator with the joiner")
        inter = current.Create_intercomm(0, bridge, 1, tag=_JOIN_TAG)
        on_phase("the merge with the joiner")
        merged = inter.Merge(high=False)
        inter.Disconnect()
        if bridge != MPI.COMM_SELF:
            bridge.Free()
        if current is not comm:
            current.Free()
        current = merged
        if current.Get_rank() == 0:
            remaining[0] -= 1


def wait_for_turn(ticket: JoinTicket, timeout_s: float = float("inf")) -> None:
    """In a joining worker: say it is ready, then wait until rank 0 gives it its turn to
    connect (joiners connect one at a time). MembershipError when the job gives the grow up
    (the folder goes) or after ``timeout_s`` (the job is gone without removing it)."""
    try:
        write_atomic(ticket.ready_file(), str(os.getpid()))
    except FileNotFoundError:
        raise MembershipError(f"the join folder {ticket.directory} is gone: the job gave up "
                              f"the grow") from None
    turn = ticket.turn_file()
    start = time.perf_counter()
    looked = start
    while not os.path.exists(turn):
        if not os.path.isdir(ticket.directory):
            raise MembershipError(f"the join folder {ticket.directory} is gone: the job "
                                  f"gave up the grow")
        now = time.perf_counter()
        if now - looked > 0.2:
            looked = now
            if ticket.job_gone():
                raise MembershipError("the job this worker was started for has ended")
        if now - start > timeout_s:
            raise MembershipError(f"no turn to connect after {timeout_s:.0f} s: the job "
                                  f"is gone")
        time.sleep(0.005)


def join_running_job(ticket: JoinTicket, on_bridge=None,
                     port: Optional[str] = None,
                     on_phase: Callable[[str], None] = _no_phase) -> MPI.Intracomm:
    """In a joining worker: connect to rank 0 of the running job when given the turn
    (``wait_for_turn``, done here unless the caller did), receive the state over that
    bridge (``on_bridge(bridge)``), join the whole job across it, and take part in
    admitting the joiners after it; returns the job's new communicator. ``port``: already
    read (``ticket.wait_for_port()``); ``on_phase`` as in ``accept_joiners``."""
    if port is None:
        port = ticket.wait_for_port()
    if not os.path.exists(ticket.turn_file()):
        wait_for_turn(ticket)
    on_phase("the connect to rank 0")
    inter = MPI.COMM_WORLD.Connect(port, root=0)
    ping = np.array([os.getpid()], dtype=np.int64)
    on_phase("the first word to rank 0")
    wait_request(inter.Isend(ping, dest=0, tag=_PING_TAG), None, "the first word to the job")
    on_phase("the merge of the bridge to rank 0")
    bridge = inter.Merge(high=True)
    inter.Disconnect()
    if on_bridge is not None:
        on_phase("the state transfer from rank 0")
        on_bridge(bridge)
    on_phase("the intercommunicator with the job")
    inter = MPI.COMM_WORLD.Create_intercomm(0, bridge, 0, tag=_JOIN_TAG)
    on_phase("the merge with the job")
    merged = inter.Merge(high=True)
    inter.Disconnect()
    bridge.Free()
    return accept_joiners(merged, port, 0, on_phase=on_phase)


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
