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
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from hpcadapt.comm import world as _rt
from hpcadapt.comm.mpi import MPI

from hpcadapt.elastic.allocator import Allocator, Worker
from hpcadapt.base.config import JOIN_DIR_VARIABLE
from hpcadapt.base.errors import AllocationError, ConfigurationError
from hpcadapt.comm.mpiflavour import flavour
from hpcadapt.comm.world import World, wait_request
from hpcadapt.elastic.joins import (ACCEPT_TIMEOUT, OWNER_FILE, SPARE_FILE, JoinTicket,
                                    accept_joiners, write_atomic)
from hpcadapt.elastic.spawned import SpareGrow, SparePool, SpawnedGrow, give_up_bounded

__all__ = ["ElasticController", "ResizeOutcome", "split_leavers", "joiner_argv", "WAITING",
           "JOIN", "ABANDON"]

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
        self._spawned = None   # the pending SpawnedGrow or SpareGrow (Open MPI)
        # Open MPI, --warm-spares: known on every rank (whether a grow asks rank 0 for
        # spares); the pool is rank 0's
        self.spare_pool_used = False
        self._pool = SparePool(self.joiner_argv) if self.spawns else None

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
                    write_atomic(os.path.join(directory, OWNER_FILE),
                                 f"{_rt.node_key()} {os.getpid()}")
                    write_atomic(os.path.join(directory, "port"), port)
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
                    write_atomic(ticket.port_file(), port)
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
            self._spawned = SpareGrow(self.world.comm, spares, count)
        else:
            self._spawned = SpawnedGrow(self.world.comm, self.joiner_argv, count)
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

    def join(self, count: int, on_bridge=None, on_phase=None) -> MPI.Intracomm:
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
                             on_bridge, **({"on_phase": on_phase} if on_phase else {}))
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
            give_up_bounded(self._spawned, wait_s)
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
            give_up_bounded(self._pool, wait_s)
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
