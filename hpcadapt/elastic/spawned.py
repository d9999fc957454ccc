"""Open MPI: joiners the job spawns (``MPI_Comm_spawn``, one per joiner, from a thread so
training goes on) and warm spares spawned by rank 0 alone; both merge with the job at a
step boundary, after the parents agree that all of them live."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from contextlib import nullcontext
from typing import List, Optional, Sequence, Tuple

import numpy as np

from hpcadapt.comm import world as _rt
from hpcadapt.comm.mpi import MPI

from hpcadapt.base.config import SPARE_OF_VARIABLE, SPAWNED_BY_VARIABLE, SPAWNED_VARIABLE
from hpcadapt.base.errors import MembershipError
from hpcadapt.comm.world import ABANDONED
from hpcadapt.elastic.joins import JoinAborted

__all__ = ["SpawnedGrow", "SparePool", "SpareGrow", "EarlyWord", "join_spawning_job",
           "give_up_bounded"]

log = logging.getLogger(__name__)


_READY_TAG = 7709   # a spawned joiner to rank 0: ready (its pid)
_WORD_TAG = 7710    # rank 0 to a spawned joiner: [GO or GIVE_UP, its place, joiners]
_CHAIN_TAG = 7711   # the intercommunicators that chain the joiners into one world
_PORT_TAG = 7712    # rank 0 to a warm spare (Open MPI): the port to connect to
_ALIVE_TAG = 7713   # a spawned joiner to rank 0 as soon as its MPI started: alive (its pid)
GO, GIVE_UP = 1, 0


class SpawnedGrow:
    """Open MPI: the joiners of one grow, each started by a collective ``MPI_Comm_spawn`` of
    its own (Open MPI's runtime ends every process of a spawn when one of them dies, so
    one spawn per joiner keeps their deaths apart), over a duplicate of the world's
    communicator, from a thread on every rank (a spawn blocks until the joiner's MPI has
    started; training goes on meanwhile on the world's own communicator)."""

    def __init__(self, comm: MPI.Intracomm, argv: Sequence[str], count: int):
        self.count = count
        self.comm = comm.Dup()   # the spawn thread's
        self.end_comm = comm.Dup()   # the main thread's, for the end's agreement
        self.inters: List[MPI.Intercomm] = []
        self.error = ""
        self._pids = np.zeros(count, dtype=np.int64)
        self._alive_pids = np.zeros(count, dtype=np.int64)
        self._ready: Optional[list] = None
        self._alive: Optional[list] = None
        self._giving_up = threading.Event()
        self.thread = threading.Thread(target=self._spawn, args=(list(argv),),
                                       name="hpcadapt-spawn", daemon=True)
        self.thread.start()

    def _spawn(self, argv: List[str]) -> None:
        info = MPI.Info.Create()
        try:
            # Open MPI's key for the joiner's environment (one variable a line); the root's
            # (rank 0's) info is the one used
            info.Set("PMIX_ENVAR", f"{SPAWNED_VARIABLE}=1\n"
                                   f"{SPAWNED_BY_VARIABLE}={_rt.node_key()}:{os.getpid()}")
            info.Set("wdir", os.getcwd())
            for i in range(self.count):
                if i and not self._go_on():
                    self.error = "the grow was given up"
                    return
                inter = self.comm.Spawn(sys.executable, args=argv, maxprocs=1, info=info,
                                        root=0)
                inter.Set_errhandler(MPI.ERRORS_RETURN)
                self.inters.append(inter)
        except MPI.Exception as exc:
            self.error = f"MPI_Comm_spawn failed: {exc.Get_error_string()}"
        finally:
            info.Free()

    def _go_on(self) -> bool:
        """Every parent, between two spawns: rank 0's word on whether to start the next one
        (not once the grow is given up: a stop during a grow then waits for the one joiner
        being started, about 3 s, not for each of them in turn)."""
        word = np.array([0 if self._giving_up.is_set() else 1], dtype=np.int64)
        self.comm.Bcast(word, root=0)
        return bool(word[0])

    def ready(self) -> Tuple[bool, str]:
        """Rank 0: (all joiners ready, why the grow cannot go on: "" while it can)."""
        if self.thread.is_alive():
            return False, ""
        if self.error:
            return False, self.error
        if self._ready is None:
            self._ready = [inter.Irecv(self._pids[i:i + 1], source=0, tag=_READY_TAG)
                           for i, inter in enumerate(self.inters)]
        alive, why = self.alive()
        if why:
            return False, why
        try:
            done = [req.Test() for req in self._ready]
        except MPI.Exception as exc:
            return False, f"a spawned joiner died before it was ready ({exc.Get_error_string()})"
        return alive and all(done), ""

    def alive(self) -> Tuple[bool, str]:
        """Rank 0, once the spawns returned: (every joiner said it is alive: its MPI started
        and it hears the job's word, why not: "" while it may yet)."""
        if self._alive is None:
            self._alive = [inter.Irecv(self._alive_pids[i:i + 1], source=0, tag=_ALIVE_TAG)
                           for i, inter in enumerate(self.inters)]
        try:
            return all([req.Test() for req in self._alive]), ""
        except MPI.Exception as exc:
            return False, f"a spawned joiner died as it started ({exc.Get_error_string()})"

    def merge(self) -> MPI.Intracomm:
        """Every rank of the running job: tell the joiners to go and merge with them, one
        after the other (each merge gives the parents and one joiner a communicator over
        which the world so far and that joiner build an intercommunicator), letting go of
        each spawn's intercommunicator (both sides must, or the joiners hang at exit)."""
        self.thread.join()  # returned or about to: the spawn is collective
        if self.error or len(self.inters) < self.count:
            self.give_up()  # the joiners that did start are told to go
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
        self.end_comm.Free()
        return current

    def give_up(self, wait_s: float = 0.0) -> None:
        """Every rank: the joiners are told to exit (rank 0). ``wait_s`` (the end of
        training): for a spawn still under way to return first (a process that exits during
        its spawn fails the launch), and then, once the parents agree that every spawn
        returned, parents and the joiners that said they are alive disconnect from each
        other (``_disconnect``); without it (a recovery, which
        cannot wait) the spawn's communicators are left unfreed (a dead joiner would make
        freeing wait)."""
        t_end = time.perf_counter() + wait_s
        self._giving_up.set()  # no further spawn (rank 0's flag is the one that counts)
        self.thread.join(timeout=wait_s)
        # Parents and joiners disconnect from each other only when every parent's spawn
        # returned (the disconnect is collective over a spawn's parents and its joiner);
        # rank 0's view of that decides, told to the others in _disconnect's broadcast.
        together = wait_s > 0 and self._all_spawns_returned(t_end)
        told = np.zeros(self.count, dtype=np.int64)
        if self.comm.Get_rank() == 0 and not self.thread.is_alive():
            # A joiner that reaches its first word after this process has gone blocks in
            # Open MPI's connection set-up (PMIx_Get) for good: wait (bounded) for each
            # joiner to say it is alive (it listens from then on: EarlyWord), then tell it,
            # completing the send.
            while wait_s and time.perf_counter() < t_end:
                alive, why = self.alive()
                if alive or why:
                    break
                time.sleep(0.01)
            # Only a joiner that said it is alive listens (EarlyWord) and disconnects too: the
            # parents' disconnect from any other would wait for it.
            told[:len(self.inters)] = _tell_give_up(
                self.inters, t_end, disconnect=self._alive_flags() if together else None)
        if wait_s > 0 and not self.thread.is_alive():  # a spawn in flight still uses comm
            # its own bound: a parent whose allreduce above timed out still hears rank 0
            self._disconnect(told, max(t_end, time.perf_counter()))
        # (with the receives still posted: MPI may yet write into their buffers)
        ABANDONED.extend([self.inters, self.comm, self.end_comm, self.thread, self._alive,
                          self._ready, self._alive_pids, self._pids])

    def _all_spawns_returned(self, t_end: float) -> bool:
        """Every parent at the end: whether every parent's spawn thread has returned (a
        bounded allreduce on the main thread's own communicator; False when it does not
        complete in time: a parent died, or a spawn returned on some parents only)."""
        flag = np.array([0 if self.thread.is_alive() else 1], dtype=np.int64)
        result = np.zeros(1, dtype=np.int64)
        done = _completed_by(lambda: self.end_comm.Iallreduce(flag, result, op=MPI.MIN),
                             t_end + 5.0, [flag, result])
        return done and bool(result[0])

    def _alive_flags(self) -> List[bool]:
        """Rank 0: for each joiner, whether it said it is alive."""
        flags = []
        for req in self._alive or []:
            try:
                flags.append(bool(req.Test()))
            except MPI.Exception:
                flags.append(False)
        return flags + [False] * (len(self.inters) - len(flags))

    def _disconnect(self, told: np.ndarray, t_end: float) -> None:
        """At the end of training, every parent: disconnect from each joiner that rank 0
        told to go (it disconnects too), so that MPI_Finalize has no connection left to
        close. Open MPI's finalize closes those itself, with a process that has gone: it
        crashed or hung there (SIGSEGV in ompi_dpm_dyn_finalize, the end 60 s late after a
        stop during a grow). A parent that died meanwhile: no disconnect (the exit's bounds
        hold)."""
        if not _completed_by(lambda: self.end_comm.Ibcast(told, root=0), t_end + 5.0, [told]):
            return
        for i, inter in enumerate(self.inters):
            if told[i]:
                try:
                    inter.Disconnect()
                except MPI.Exception:
                    pass  # that joiner died after it heard: the connection stays


def _completed_by(start, deadline: float, buffers: list) -> bool:
    """Whether the nonblocking operation ``start()`` posts completes by ``deadline``
    (perf_counter); False on an MPI error too. An operation left incomplete keeps its
    ``buffers`` and request alive (ABANDONED): MPI may yet write into them."""
    try:
        request = start()
        while not request.Test():
            if time.perf_counter() > deadline:
                ABANDONED.extend(buffers + [request])
                return False
            time.sleep(0.001)
    except MPI.Exception:
        ABANDONED.extend(buffers)
        return False
    return True


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


def give_up_bounded(grow_or_pool, wait_s: float) -> None:
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


class SparePool:
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


def _tell_give_up(inters: Sequence[MPI.Intercomm], t_end: float, *,
                  disconnect: Optional[Sequence[bool]] = None) -> List[int]:
    """Rank 0: GIVE_UP to each joiner or spare behind ``inters`` (a completed send where it
    completes by ``t_end``; a dead one is skipped). ``disconnect``: per joiner, whether the
    word asks it to disconnect from the parents before it exits (they do too). Returns, per
    joiner, 1 where it was asked to disconnect and the send completed."""
    told = []
    for i, inter in enumerate(inters):
        asked = bool(disconnect[i]) if disconnect is not None else False
        word = np.array([GIVE_UP, int(asked), 0], dtype=np.int64)
        try:
            request = inter.Isend(word, dest=0, tag=_WORD_TAG)
            while not request.Test() and time.perf_counter() < t_end:
                time.sleep(0.001)
            told.append(int(request.Test() and asked))
            ABANDONED.extend([word, request])
        except MPI.Exception:
            told.append(0)  # that process is dead
    ABANDONED.extend(inters)
    return told


class SpareGrow:
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


def _spawning_parent() -> MPI.Intercomm:
    """This worker's intercommunicator to the job that spawned it (errors returned, not
    fatal); MembershipError when no job spawned it."""
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise MembershipError(f"{SPAWNED_VARIABLE} is set but this process was not started "
                              f"by MPI_Comm_spawn")
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    return parent


class EarlyWord:
    """A joiner the job spawned (not a warm spare), as soon as its MPI started: tells rank 0
    it is alive and hears the job's word from then on, in a thread. A job that gives the
    grow up at its end (a stop) then lets it go at once instead of waiting out its start-up
    (the data and the model: 6-8 s on a busy 2-core node): on that word it disconnects (the
    parents do too) and ends. Any other word waits for ``join_spawning_job``."""

    def __init__(self) -> None:
        self.parent = _spawning_parent()
        self.word = np.array([GIVE_UP, 0, 0], dtype=np.int64)
        self.error = ""
        self.heard = threading.Event()
        self._pid = np.array([os.getpid()], dtype=np.int64)
        # How the listener ends this process: a signal to the main thread, whose handler
        # exits through the interpreter (MPI_Finalize included: Open MPI's launcher calls an
        # exit without it abnormal and prints a banner for it). Built outside the main
        # thread, there is no handler: the word then waits for join_spawning_job.
        try:
            signal.signal(_LEAVE_SIGNAL, _leave)
            self._can_leave = True
        except ValueError:
            self._can_leave = False
        self._sent = self.parent.Isend(self._pid, dest=0, tag=_ALIVE_TAG)
        self._request = self.parent.Irecv(self.word, source=0, tag=_WORD_TAG)
        threading.Thread(target=self._listen, name="hpcadapt-word", daemon=True).start()

    def _listen(self) -> None:
        try:
            while not self._request.Test():
                time.sleep(0.01)
            self._sent.Wait()
        except MPI.Exception as exc:
            self.error = f"the job that spawned this worker is gone ({exc.Get_error_string()})"
            self.heard.set()
            return
        if self.word[0] != GO and self.word[1] and self._can_leave:
            try:
                self.parent.Disconnect()
            except MPI.Exception:
                pass  # the parents are gone: leave all the same
            log.info("not joining (the job gave the grow up): this worker exits")
            signal.pthread_kill(threading.main_thread().ident, _LEAVE_SIGNAL)
            return
        self.heard.set()


_LEAVE_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2


def _leave(signum, frame) -> None:
    raise SystemExit(0)


def _hear_word(parent, deadline_s: float, spare_of: str, early: Optional[EarlyWord]):
    """Say ready to rank 0 and wait for its word (bounded by ``deadline_s``)."""
    pid = np.array([os.getpid()], dtype=np.int64)
    t_end = time.perf_counter() + deadline_s
    try:
        sent = parent.Isend(pid, dest=0, tag=_READY_TAG)
        if early is not None:
            while not early.heard.wait(0.005):
                if time.perf_counter() > t_end:
                    raise MembershipError(f"no word from the job within {deadline_s:.0f} s")
            if early.error:
                raise MembershipError(early.error)
            word = early.word
        else:
            word = np.array([GIVE_UP, 0, 0], dtype=np.int64)
            heard = parent.Irecv(word, source=0, tag=_WORD_TAG)
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
    return word


def join_spawning_job(deadline_s: float, spare_of: str = "",
                      early: Optional[EarlyWord] = None) -> MPI.Intracomm:
    """In a worker the job spawned (Open MPI): say it is ready to rank 0, wait for its word
    (bounded by ``deadline_s``; the job's death is an MPI error under ULFM), merge with the
    job and then take part in merging the joiners after it; returns the job's new
    communicator. The state comes next, from rank 0. ``early``: the joiner's listener,
    started as its MPI started (not for a warm spare)."""
    parent = early.parent if early is not None else _spawning_parent()
    word = _hear_word(parent, deadline_s, spare_of, early)
    if word[0] != GO:
        if word[1]:  # the parents disconnect from this worker: so does it (see give_up)
            parent.Disconnect()
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
