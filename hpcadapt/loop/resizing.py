"""The job's side of membership changes: resizes asked for, shrinks, grows polled and completed
at a boundary, a joiner's join, a leaver's exit.

``Resizing`` is the Job's collaborator for them and owns what they change: whether this
process started as a joiner, the elastic controller and its allocator, the resizes done; a
join and a shrink move the job's phase (``loop.phase``: holding the state, left). It reads
the job's parts (``loop.parts.JobParts``: options, world, state, optimizer) and reaches no
other collaborator: a completed resize comes back as a ``ResizeDone`` whose follow-ups (the
step runner's times reset, the replicas compared, the policies' ``on_resize``) the Job hands
to their owners, then gives back to ``record_done``."""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, NoReturn, Optional

import numpy as np

from hpcadapt.base import faults, lifecycle
from hpcadapt.base.errors import ConfigurationError, MembershipError, on_every_rank
from hpcadapt.base.options import JobOptions, MembershipOptions
from hpcadapt.base.metrics import ResizeRecord
from hpcadapt.comm import world as world_mod
from hpcadapt.comm.mpiflavour import flavour
from hpcadapt.comm.world import CommView
from hpcadapt.elastic.allocator import LocalAllocator
from hpcadapt.loop.parts import JobParts
from hpcadapt.loop.phase import JobPhase, Phase
from hpcadapt.loop.setup_checks import say_once
from hpcadapt.loop.recording import Recorder
from hpcadapt.adapt.control import ControlLayout

__all__ = ["ResizeDone", "Resizing"]

log = logging.getLogger("hpcadapt.job")


@dataclass(frozen=True)
class ResizeDone:
    """A resize completed on this rank, in the new world (a shrink, a grow, a join, a
    recovery): ``outcome`` (``elastic.membership.ResizeOutcome``), ``paused_at`` and
    ``decided_at`` (perf_counter times: the pause and the decision's delay, measured when it
    is recorded), ``compare_replicas`` (the replicas should be identical now: S-SGD and
    bounded delay; under model averaging they differ by design). What follows it is the
    Job's to hand on, in this order on every rank (the comparison is collective): the step
    runner's per-rank times reset, the replicas compared, ``Resizing.record_done``, the
    policies' ``on_resize`` queued for the next boundary."""

    outcome: Any
    paused_at: float = float("nan")
    decided_at: float = float("nan")
    compare_replicas: bool = False


class Resizing:
    """The job's side of membership changes: resizes asked for, shrinks, grows polled
    and completed at a boundary, a joiner's join, a leaver's exit.

    ``join_dir``, ``spawned_to_join`` and ``spare_of``: how this process was started (the
    marks ``hpcadapt.base.config`` takes from the environment): to join a running job
    through a port's folder, spawned by Open MPI's grow, or as a warm spare of that rank 0."""

    def __init__(self, parts: JobParts, recorder: Recorder, phase: JobPhase, *,
                 fail: Callable[[BaseException], NoReturn],
                 recovery_scope: Callable[[], Any],
                 join_dir: Optional[str], spawned_to_join: bool, spare_of: Optional[str]):
        self.parts = parts
        self.recorder = recorder
        self.phase = phase     # the job's life: a join and a shrink move it
        self.fail = fail       # ends the job, state saved (Stops.fail)
        self.recovery_scope = recovery_scope  # where a death in a join is recovered (Job's)
        self.join_dir, self.spawned_to_join, self.spare_of = join_dir, spawned_to_join, spare_of
        #: a worker started to join a running job (its role, read from the phase it
        #: started in), until a recovery gives it rank 0's role: it then owns the
        #: checkpoint and the end of the job
        self.joining = phase.phase is Phase.JOINING
        self.elastic = None  # the ElasticController, with --max-workers
        self.allocator = None
        #: every resize this rank saw (the summary's)
        self.resizes: List[Dict[str, Any]] = []
        self._joined_version = -1
        self._early_word = None  # a spawned joiner's listener (listen_early)

    # the job's parts this one reads most (the same objects through every resize)
    @property
    def world(self):
        return self.parts.world

    @property
    def state(self):
        return self.parts.state

    @property
    def options(self) -> JobOptions:
        return self.parts.options

    def listen_early(self) -> None:
        """A joiner the job spawned (not a warm spare), once its MPI started: it hears the
        job's word from now on (``EarlyWord``: a grow given up lets it go at once)."""
        if self.spawned_to_join and not self.spare_of:
            from hpcadapt.elastic.spawned import EarlyWord

            self._early_word = EarlyWord()

    def took_state(self) -> None:
        """A recovery handed this process the agreed state (a joiner that took rank 0's role
        logs as rank 0 from now on)."""
        self.phase.took_state()

    def own_the_end(self) -> None:
        """Rank 0 died and this worker took its role: a joiner no longer, it owns the
        checkpoint and the end of the job, and keeps the warm spares rank 0 kept."""
        self.joining = False
        if self.elastic is not None:
            self.elastic.warm_spares = self.options.membership.warm_spares

    def slot_ranks(self) -> int:
        """Ranks the slots have room for: the most this job can grow to (the step's control
        values keep one layout across resizes)."""
        cap = self.elastic.allocator.capacity() if self.elastic is not None else 0
        return max(self.world.size, cap)

    def owns_the_end(self) -> bool:
        """Whether this process saves the checkpoint and ends the job (not a joiner yet)."""
        return not self.joining

    # -- what a recovery asks of the membership (``loop.failures.RecoveryMembership``) -----
    def may_grow(self) -> bool:
        """Whether workers may join (--max-workers): a death is survivable even alone."""
        return self.elastic is not None

    def abandon_grow(self, why: str) -> None:
        """A grow under way is given up (its joiners would connect to the old world)."""
        if self.elastic is not None and self.elastic.growing:
            self.record_resize(self.elastic.abandon(why))

    def released(self, dead: int) -> None:
        """``dead`` workers are gone: their slots are free, their launchers reaped."""
        if self.allocator is not None:
            self.allocator.released(dead)
            self.allocator.reap()

    def coordinator_may_move(self) -> bool:
        """Whether the allocator lets rank 0's role move (the local one: the agent waits for
        every worker it started)."""
        from hpcadapt.elastic.allocator import LocalAllocator

        return isinstance(self.allocator, LocalAllocator)

    def setup_elastic(self) -> None:
        """With --max-workers: the worker-count flags checked on every rank alike, then the
        allocator and the elastic controller that grows and shrinks the job."""
        from hpcadapt.elastic.membership import ElasticController, joiner_argv

        o = self.options.membership
        # Every rank checks the same flags: one line from rank 0, exit 2 (not an abort).
        problem = None
        if o.max_workers < self.world.size and not self.joining:
            problem = (f"--max-workers {o.max_workers} is below the {self.world.size} workers "
                       f"already running")
        elif o.min_workers > o.max_workers:
            problem = f"--min-workers {o.min_workers} is above --max-workers {o.max_workers}"
        elif o.warm_spares < 0:
            problem = f"--warm-spares {o.warm_spares}: give 0 or more"
        elif o.initial_workers is not None and o.initial_workers > o.max_workers:
            problem = (f"--initial-workers {o.initial_workers} is above --max-workers "
                       f"{o.max_workers}")
        elif o.min_workers > max(self.world.size, o.initial_workers or 0) and not self.joining:
            problem = (f"--min-workers {o.min_workers} is above the {self.world.size} workers "
                       f"running; start at least {o.min_workers}")
        if problem is not None:
            raise on_every_rank(ConfigurationError(problem))
        self.allocator, join_root = build_allocator(o, self.world.rank)
        self.elastic = ElasticController(self.world, self.allocator, joiner_argv(),
                                         join_timeout=o.join_timeout,
                                         min_workers=o.min_workers, join_root=join_root)
        # Rank 0 gives up a joiner that does not connect well before the others' bounded
        # waits for its word (--peer-timeout) expire: the grow is then abandoned and training
        # goes on, instead of the job ending (the 200-event soak met exactly that race).
        self.elastic.accept_timeout = self.options.failures.peer_timeout / 3
        self.elastic.warm_spares = 0 if self.joining else o.warm_spares
        self.elastic.spare_pool_used = bool(o.warm_spares) and self.elastic.spawns

    def start_size(self, resumed: bool) -> tuple:
        """(the size to train at from the first step, why): --initial-workers, or on a
        resume the size the checkpoint was written at (--resume-size saved), capped by
        --max-workers; each case that does not grow back says so in one line."""
        o = self.options.membership
        want = o.initial_workers or 0
        saved = self.state.world_size if resumed else 0
        if saved <= max(want, self.world.size):
            return want, "initial workers"
        now = max(want, self.world.size)
        if o.resume_size == "launch":
            say_once(self.world, "the checkpoint was written by %d workers; --resume-size "
                     "launch: training goes on at %d", saved, now)
            return want, "initial workers"
        if self.elastic is None:
            say_once(self.world, "the checkpoint was written by %d workers; without "
                     "--max-workers the job cannot grow back: training goes on at %d (start "
                     "with --max-workers %d, or -n %d)", saved, now, saved, saved)
            return want, "initial workers"
        reach = min(saved, o.max_workers)
        say_once(self.world, "the checkpoint was written by %d workers: growing back to %d "
                 "before the first step%s (--resume-size launch keeps the launch's %d)", saved,
                 reach, f" (--max-workers {o.max_workers})" if reach < saved else "",
                 self.world.size)
        return reach, f"resuming at the checkpoint's {saved} workers"

    def start_initial_workers(self, count: int, reason: str = "initial workers"
                              ) -> Optional[ResizeDone]:
        """--initial-workers: the workers the launch lacks join before the first step, each
        its own launch (a dead one is then recovered from; a rank of a shared launch is not).
        A grow that fails or times out leaves the job training at the size it has. Returns
        the grow, when it completed here."""
        if self.elastic is None:
            raise on_every_rank(ConfigurationError("--initial-workers needs --max-workers (the "
                                                   "allocator that starts them)"))
        done = self.request_resize(count, reason)
        while self.elastic.growing:
            with self.recovery_scope():
                done = self.poll()
            time.sleep(0.02)
        return done

    def request_resize(self, new_size: int, reason: str = "user request", *,
                       remove: Optional[List[int]] = None) -> Optional[ResizeDone]:
        """``Job.request_resize``: a shrink now (returned, done, on the ranks that stay), a
        grow started now and completed at a later boundary (``poll``); requests that cannot
        be met are clipped or refused with a logged reason."""
        if self.elastic is None:
            if self.world.rank == 0:
                log.warning("resize to %d workers refused (%s): no allocator (start with "
                            "--max-workers); training goes on with %d", new_size, reason,
                            self.world.size)
            return None
        target = self.elastic.clip(new_size, reason)
        if target is None:
            return None
        if target < self.world.size:
            return self._shrink(target, reason, remove)
        failed = self.elastic.start_grow(target, reason)
        if failed is not None:
            self.record_resize(failed)
        return None

    def _shrink(self, target: int, reason: str, remove: Optional[List[int]]
                ) -> Optional[ResizeDone]:
        from hpcadapt.elastic.membership import ResizeOutcome, split_leavers

        old = self.world.size
        leavers = [r for r in (remove or []) if 0 < r < old][: old - target]
        for r in range(old - 1, 0, -1):
            if len(leavers) >= old - target:
                break
            if r not in leavers:
                leavers.append(r)
        t0 = time.perf_counter()
        new = split_leavers(self.world.comm, leavers)
        if new is None:
            self.phase.leave()
            log.info("leaving the job (%s)", reason)
            return None
        self.world.replace(new)
        self.elastic.allocator.released(old - target)
        return self.completed(ResizeOutcome(old, target, reason, 0.0, True), t0, t0)

    def poll(self) -> Optional[ResizeDone]:
        """At a step boundary: keep the warm spares, and complete a pending grow whose
        joiners are ready (the join, the state to them, the confirmation; returned) or
        abandon it."""
        from hpcadapt.elastic.joins import JoinAborted
        from hpcadapt.elastic.membership import ABANDON, JOIN, ResizeOutcome

        if self.elastic is None:
            return None
        self.elastic.keep_spares()  # rank 0, not while a grow is pending
        if not self.elastic.growing:
            return None
        status, joiners, detail = self.elastic.poll_grow()  # a failure: the caller's recovery
        if status == ABANDON:
            self.record_resize(self.elastic.abandon(detail))
        elif status == JOIN:
            t0 = time.perf_counter()
            decided = self.elastic.decided_at()
            reason = self.elastic.pending.reason if self.elastic.pending else ""
            old, version = self.world.size, self.world.cluster_version
            workers = list(self.elastic.pending.workers) if self.elastic.pending else []
            previous, merged = self.world.comm, None
            # ULFM: a death during the join is recovered from here, the joiners with the
            # job once they merged (see _record_death_during_join).
            with self.recovery_scope() as scope:
                try:
                    # What cannot be polled between the joiner's first word and the
                    # confirmation (Create_intercomm, Merge) runs under a watchdog.
                    with self._join_watchdog(workers) as dog:
                        # Rank 0 sends each joiner the state over its own bridge before the
                        # whole job takes it in: a joiner dying until then is abandoned.
                        faults.point("join", self.state.step)
                        merged = self.elastic.join(joiners, self._send_state_over_bridge,
                                                   dog.phase)
                        self.world.replace(merged, keep_old=True)
                        if self.elastic.spawns:  # spawned joiners take the state now
                            faults.point("state", self.state.step)
                            dog.phase("the state to the spawned joiners")
                            world_mod.agree_all_alive(self.world.comm)  # the joiners too
                            self.sync_state(receiving=False)
                        dog.phase("the confirmation")
                        self._confirm_join()
                except JoinAborted as exc:
                    self.record_resize(self.elastic.abandon(str(exc)))
                    return None
                except world_mod.FAILURES as exc:
                    if world_mod.ULFM:
                        self._record_death_during_join(previous, merged, old, reason)
                        raise
                    if merged is None:
                        self.fail(exc)  # a rank of the running job itself failed
                    # A joiner died after it merged: back to the old world, which holds only
                    # the ranks that trained on (their state is untouched); the merged
                    # communicator is left unfreed (freeing it would wait on the dead).
                    self.world.replace(previous, version=version, keep_old=True)
                    self.parts.optimizer.ensure_current()
                    if self.world.rank == 0:
                        for w in workers:
                            w.stop()
                    self.record_resize(ResizeOutcome(
                        old, self.world.size, f"{reason}; abandoned: a joining worker died "
                        f"while it merged ({exc})", 0.0, False))
                    return None
            if scope.recovered:
                if merged is None:
                    self.record_resize(ResizeOutcome(
                        old, old + joiners, f"{reason}; abandoned: a rank of the job died "
                        f"before the merge", 0.0, False))
                return None
            if previous != _comm_null():
                previous.Free()
            return self.completed(ResizeOutcome(old, self.world.size, reason, 0.0, True),
                                  t0, decided)
        return None

    def _record_death_during_join(self, previous, merged, old: int, reason: str) -> None:
        """ULFM: a death while the job joins spawned workers, before its recovery. Before
        the merge the parents agreed that one of them died and let the joiners go: the job
        recovers on its own (the grow is recorded as abandoned after it). After it, every
        member of the merged world recovers together, the joiners too (they take the state
        from a survivor that holds it), so the grow is kept: recorded first (by rank 0 while
        it lives; else the failure's old size says it)."""
        from hpcadapt.elastic.membership import ResizeOutcome

        if merged is not None:
            self.record_resize(ResizeOutcome(old, self.world.size, f"{reason}; merged, then "
                                              f"a death during the join: the joiners recover "
                                              f"with the job", 0.0, True))
            if previous != _comm_null():
                world_mod.ABANDONED.append(previous)  # may hold the dead: never freed

    def _join_watchdog(self, workers):
        """The watchdog around a join's blocking steps: a joining worker whose launcher has
        exited (rank 0 sees it), a dead peer of the old world, or a phase of the join
        blocked past --peer-timeout and a third ends the job as a failure does (state saved
        by rank 0, exit 75). Each phase has its own clock, and the third is a margin over
        the phases' own bounded waits (the state transfer's is --peer-timeout), which give
        the grow up and train on: the last resort must not win that race."""
        old_watch = self.world.watch
        first_seen: Dict[str, float] = {}
        # A death the join's own bounded waits handle (the pending accept, bounded by
        # --peer-timeout / 3, the first word, the state transfer; under ULFM the runtime's
        # report of the death) is theirs to handle for as long as the accept may wait: a
        # fixed 5 s here lost that race on a busy machine (the job ended, exit 75, where
        # its own recovery would have gone on).
        grace = self.options.failures.peer_timeout / 3

        def check() -> Optional[str]:
            reasons = [f"a joining worker {w.failed().replace(' during start-up', '')}"
                       for w in workers if w.failed()]
            dead = old_watch.dead()
            if dead:
                reasons.append(dead[1])
            now = time.perf_counter()
            for reason in reasons:
                if now - first_seen.setdefault(reason, now) > grace:
                    return reason
            return None

        def expire(reason: str) -> None:
            self.fail(world_mod.PeerFailure(reason, cause="join"))

        return world_mod.Watchdog(self.options.failures.peer_timeout + grace, "a join", expire,
                                  check)

    def _send_state_over_bridge(self, bridge, watch) -> None:
        """Rank 0, during a join: the state to one joiner over their two-process bridge."""
        watch.floor = self.options.failures.peer_timeout
        view = CommView(bridge, self.world.cluster_version + 1, watch)
        self.state.broadcast(view, is_root=True)

    def _receive_state_over_bridge(self, bridge) -> None:
        """A joiner: the state from rank 0 over the bridge (bounded by --peer-timeout)."""
        watch = world_mod.PeerWatch(1, [], blind=True)
        watch.floor = self.options.failures.peer_timeout
        view = CommView(bridge, -1, watch)
        self._joined_version = self.state.broadcast(view, is_root=False)

    def _confirm_join(self) -> None:
        """Every rank of a grown world, after the state transfer: one bounded allreduce (a
        ULFM agreement under ULFM) that completes only when every member (the joiners too)
        is alive and has the state."""
        if world_mod.ULFM:
            # The same outcome on every survivor (a death seen by some members only would
            # leave the others training in a world the first ones recover from).
            world_mod.agree_all_alive(self.world.comm)
            return
        one = np.ones(1, dtype=np.int64)
        wait = world_mod.wait_request
        from hpcadapt.comm.mpi import MPI

        wait(self.world.comm.Iallreduce(MPI.IN_PLACE, one, op=MPI.SUM), self.world.watch,
             "the join's confirmation")

    def join(self) -> Optional[ResizeDone]:
        """A worker started for a grow: connect, merge, receive the state. Returns the
        join (None when a recovery from a death during it handed this worker the state)."""
        from hpcadapt.elastic.joins import (JoinAborted, JoinTicket, join_running_job,
                                            wait_for_turn)
        from hpcadapt.elastic.membership import ResizeOutcome

        if self.spawned_to_join:
            return self._join_spawned()
        self._drop_spawn_parent()
        try:
            ticket = JoinTicket.claim(self.join_dir)
            # A warm spare idles here until a grow takes it (the deadline starts after).
            port = ticket.wait_for_port()
            # Joiners connect one at a time: the wait for this one's turn is the job's
            # (bounded by its --join-timeout, or the end of rank 0), not the join's.
            wait_for_turn(ticket, self.options.membership.join_timeout
                          + self.options.failures.peer_timeout)
        except MembershipError as exc:
            log.info("not joining (%s): this worker exits", exc)
            lifecycle.end_process(3)

        peer_timeout = self.options.failures.peer_timeout
        try:
            # Each phase bounded as the job's side of it is (see _join_watchdog).
            with world_mod.Watchdog(peer_timeout * 4 / 3, "joining the job",
                                    _give_up_join) as dog:
                self.world.replace(join_running_job(ticket, self._receive_state_over_bridge,
                                                    port, dog.phase),
                                   version=self._joined_version)
                dog.phase("the confirmation")
                self._confirm_join()
        except (JoinAborted, world_mod.PeerFailure, MembershipError) as exc:
            _give_up_join(exc)
        self.phase.took_state()
        log.info("joined as rank %d of %d at step %d", self.world.rank, self.world.size,
                 self.state.step)
        return self.completed(ResizeOutcome(-1, self.world.size, "joined", 0.0, True))

    def _join_spawned(self) -> Optional[ResizeDone]:
        """A worker the job spawned (Open MPI): ready, merge, receive the state from rank 0.
        The wait for the job's word lasts as long as the job waits for its joiners."""
        from hpcadapt.elastic.joins import JoinAborted
        from hpcadapt.elastic.membership import ResizeOutcome
        from hpcadapt.elastic.spawned import join_spawning_job

        wait_s = self.options.membership.join_timeout + self.options.failures.peer_timeout
        if self.spare_of:
            # A warm spare waits until a grow takes it (or its rank 0 is gone, or the job
            # tells it to go); its merge is bounded like a joiner's.
            wait_s = float("inf")
        try:
            # Bounded twice: the wait for the job's word has its deadline, and the watchdog
            # ends this process when Open MPI's connection set-up blocks (the job is gone).
            with world_mod.Watchdog(wait_s + 10.0, "waiting for the job's word",
                                    _give_up_join):
                merged = join_spawning_job(wait_s, self.spare_of, self._early_word)
        except MembershipError as exc:
            # The job gave the grow up, or ended: nothing failed here. This process's exit
            # is part of the launch's (mpirun's), whose code is the training's: exit 0
            # through MPI_Finalize (Open MPI counts an exit without it as a failure).
            log.info("not joining (%s): this worker exits", exc)
            sys.exit(0)
        except JoinAborted as exc:
            # A rank of the job died during the merge: the job recovers without this worker.
            # It ends through MPI_Finalize with 0 (Open MPI counts an exit without it as a
            # failure of the launch, whose code is the training's); the line says why.
            log.error("the join was given up (%s): this worker exits", exc)
            sys.exit(0)
        # A death during the join (ULFM): this worker recovers with the merged world and
        # takes the state from a survivor that holds it.
        with self.recovery_scope() as scope:
            try:
                with world_mod.Watchdog(self.options.failures.peer_timeout, "joining the job",
                                        _give_up_join):
                    self.world.replace(merged)
                    world_mod.agree_all_alive(merged)  # the job's ranks agree on it too
                    self.sync_state(receiving=True)
                    self._confirm_join()
            except world_mod.FAILURES as exc:
                if not (world_mod.ULFM and self.world.comm is merged):
                    # The merged world is not this worker's: the job recovers without it.
                    # It ends through MPI_Finalize with 0, so that the launch's exit code
                    # stays the training's (the line says what happened).
                    log.error("the join was given up (%s): this worker exits", exc)
                    sys.exit(0)
                raise
        if scope.recovered:
            log.info("joined as rank %d of %d at step %d, through the recovery from a death "
                     "during the join", self.world.rank, self.world.size, self.state.step)
            return None
        self.phase.took_state()
        log.info("joined as rank %d of %d at step %d", self.world.rank, self.world.size,
                 self.state.step)
        return self.completed(ResizeOutcome(-1, self.world.size, "joined", 0.0, True))

    @staticmethod
    def _drop_spawn_parent() -> None:
        """A worker started by MPI_Comm_spawn joins through the port; it lets go of its parent."""
        from hpcadapt.comm.mpi import MPI

        parent = MPI.Comm.Get_parent()
        if parent != MPI.COMM_NULL:
            parent.Disconnect()

    def sync_state(self, *, receiving: bool = True) -> None:
        """Broadcast the training state from rank 0 so every replica is identical. Ranks
        that already hold it (``receiving=False``: the running job's, after a grow) split
        off and take no part; the broadcast then reaches only the joiners."""
        from hpcadapt.comm.mpi import MPI

        rank = self.world.rank
        part = self.world.comm.Split(0 if (receiving or rank == 0) else MPI.UNDEFINED, rank)
        if part == MPI.COMM_NULL:
            return
        view = CommView(part, self.world.cluster_version, self.world.watch)
        try:
            version = self.state.broadcast(view, is_root=rank == 0)
        finally:
            part.Free()
        if rank != 0 and version != self.world.cluster_version:
            self.world.adopt_version(version)

    def completed(self, outcome, paused_at: float = float("nan"),
                  decided_at: float = float("nan")) -> ResizeDone:
        """Every rank of the new world: rebuild what depends on the size (the optimizer's
        control slots, its buckets' communicator); returns the resize, whose follow-ups the
        Job hands on (``ResizeDone``)."""
        self.parts.optimizer.set_extra_slots(ControlLayout(self.slot_ranks()).length)
        self.parts.optimizer.ensure_current()
        # Under model averaging the replicas differ by design: nothing to compare. Under
        # bounded delay they are rank 0's between rounds (a round given up by a recovery
        # goes back to the weights of its start everywhere).
        strategy = self.state.strategy
        return ResizeDone(outcome, paused_at, decided_at, compare_replicas=outcome.ok and (
            strategy.averages_gradients or strategy.asynchronous))

    def record_done(self, done: ResizeDone, identical: Optional[bool] = None) -> None:
        """A completed resize, once its replicas were compared (``identical``; None when
        not compared): its pause and the decision's delay measured now, then recorded."""
        if identical is False and self.world.rank == 0:
            log.error("replicas differ after the resize to %d workers", self.world.size)
        now = time.perf_counter()
        paused_at = done.paused_at
        self.record_resize(replace(
            done.outcome, pause_s=now - paused_at if paused_at == paused_at else 0.0,
            decision_to_first_step_s=now - done.decided_at), identical)

    def record_resize(self, outcome, identical: Optional[bool] = None) -> None:
        """A resize done or not (``ResizeOutcome``): the summary's row, the metrics line
        (rank 0 of the running job) and the log line. ``identical``: whether the replicas
        were found identical after it (None: not compared)."""
        st = self.state
        row = {"old_size": outcome.old_size, "new_size": outcome.new_size, "ok": outcome.ok,
               "pause_s": outcome.pause_s, "reason": outcome.reason,
               "decision_to_first_step_s": outcome.decision_to_first_step_s, "step": st.step}
        self.resizes.append(row)
        if outcome.old_size < 0:
            return  # a joiner's view; rank 0 of the running job records the resize
        self.recorder.write(ResizeRecord(
            step=st.step, epoch=st.epoch, old_size=outcome.old_size,
            new_size=outcome.new_size, reason=outcome.reason, pause_s=outcome.pause_s,
            ok=outcome.ok, cluster_version=self.world.cluster_version,
            world_size=self.world.size, batch_size=st.hyper.batch_size,
            lr=st.applied_rate(float(self.parts.optimizer.optimizer.param_groups[0]["lr"])),
            decision_to_first_step_s=outcome.decision_to_first_step_s,
            replicas_identical=identical if outcome.ok else None,
            pids=list(self.world.pids) if outcome.ok else None))
        if self.world.rank == 0:
            level = logging.INFO if outcome.ok else logging.WARNING
            log.log(level, "resize %d -> %d %s in %.3f s (%s)", outcome.old_size,
                    outcome.new_size, "done" if outcome.ok else "not done", outcome.pause_s,
                    outcome.reason)

    def release_workers(self, *, failed: bool = False) -> None:
        """At the job's end: the warm spares stopped, the allocator closed (joined workers
        end on their own, then are killed). ``failed``: the job ends on a failure: rank 0
        also stops a pending grow's joiners and removes their folders, and the allocator
        waits 10 s at most, best effort."""
        elastic, allocator = self.elastic, self.allocator
        if not failed:
            if elastic is not None:
                elastic.stop_spares()
            if allocator is not None:
                allocator.close()
            return
        if elastic is not None and self.world.rank == 0:
            elastic.stop_spares()
            for w in elastic.pending.workers if elastic.pending is not None else []:
                w.stop()
            elastic.remove_join_folders()  # a pending grow's (its joiners are stopped)
        if allocator is not None:
            try:
                allocator.close(10.0)
            except Exception as err:  # pragma: no cover - best effort on the way out
                log.error("could not stop the joined workers: %s", err)

    def finish(self) -> None:
        """A grow still pending when training ends is abandoned on every rank."""
        if self.elastic is not None and self.elastic.growing and not self.phase.left:
            self.record_resize(self.elastic.abandon("training ended first",
                                                     wait_s=self.options.failures.peer_timeout))

    def leave(self) -> None:
        """This rank left the job in a shrink: nothing of it is needed any more (its
        loader's workers were closed by the Job)."""
        self.recorder.close()
        world_mod.shutdown()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # A rank that shares its launch leaves through the interpreter's normal exit (MPI
        # finalised by mpi4py's exit hook) after its siblings reached the end (shutdown
        # waited for them): ending it with os._exit made mpiexec SIGKILL the others in the
        # middle of their own exit now and then (exit 9 after a shrink of the first
        # launch). A rank alone in its launch skips the interpreter's teardown (about 0.7 s
        # with torch loaded), which gives the node back to Slurm that much sooner.
        # Open MPI's launcher counts a process that ends without MPI_Finalize as a failure
        # of the launch (exit 1): there every leaver goes through the normal exit.
        from hpcadapt.comm.mpi import MPI

        if MPI.COMM_WORLD.Get_size() > 1 or flavour().open_mpi:
            sys.exit(0)
        lifecycle.end_process(0)


def _comm_null():
    """MPI.COMM_NULL (MPI imported where it is first needed)."""
    from hpcadapt.comm.mpi import MPI

    return MPI.COMM_NULL


def _give_up_join(reason) -> None:
    """A joining worker whose join failed (or whose watchdog expired, from its thread): one
    line, then exit 3 at once (a blocked MPI call cannot be left any other way)."""
    log.error("the join was given up (%s): this worker exits", reason)
    lifecycle.end_process(3)


def build_allocator(size: MembershipOptions, rank: int):
    """The allocator the membership options ask for, and the folder joiners find the port in.

    Slurm needs its commands and a job to live in; without them it says why in one line
    (rank 0) and the job uses the local allocator."""
    if flavour().open_mpi:
        # A grow spawns its joiners from the job (mpirun places them on the nodes it was
        # given): no companion allocations, whose workers could not connect there.
        if size.allocator == "slurm" and rank == 0:
            log.warning("--allocator slurm is not available on Open MPI: a grow spawns its "
                        "workers within this job's allocation (up to --max-workers)")
        return LocalAllocator(size.max_workers, launcher=size.launcher), None
    if size.allocator in ("auto", "slurm"):
        from hpcadapt.slurm import SlurmAllocator, in_slurm_job, slurm_available

        why = ""
        if not slurm_available():
            why = "no Slurm commands (sbatch, squeue, scancel, scontrol) on this machine"
        elif not in_slurm_job():
            why = "not inside a Slurm job (SLURM_JOB_ID is not set)"
        if not why:
            # The port folder must be visible from the new nodes: the job's working folder.
            return (SlurmAllocator(None, size.max_workers, partition=size.slurm_partition,
                                   pending_timeout=size.slurm_pending_timeout,
                                   mpi=size.slurm_mpi, grow=size.slurm_grow),
                    os.path.join(os.getcwd(), ".hpcadapt-join"))
        if size.allocator == "slurm" and rank == 0:
            log.warning("Slurm allocator unavailable: %s; using the local allocator", why)
    return LocalAllocator(size.max_workers, launcher=size.launcher), None
