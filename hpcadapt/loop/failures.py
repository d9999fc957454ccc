"""A peer's death: recovered from in place (the survivors agree, shrink, take the state of the
one furthest on) or, when it cannot be, the job ends with its state saved (exit 75).

A part of ``hpcadapt.job.Job`` (a mixin): its methods work on the job's state, which
``Job.__init__`` and ``Job.setup`` create; this module holds one concern of it."""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from dataclasses import asdict
from typing import Optional

import numpy as np

from hpcadapt.base import agent_files as agent, config, faults, lifecycle
from hpcadapt.base.metrics import FailureRecord, RecoveryRecord
from hpcadapt.base.preemption import EXIT_REQUEUE
from hpcadapt.comm import world as world_mod
from hpcadapt.comm.world import CommView

__all__ = ["FailureHandling"]

log = logging.getLogger("hpcadapt.job")


class FailureHandling:
    """A peer's death: recovered from in place (the survivors agree, shrink, take the
    state of the one furthest on) or, when it cannot be, the job ends with its state
    saved (exit 75)."""

    @property
    def _recoverable(self) -> bool:
        """Whether a peer's death can be survived here (then each step keeps what it may
        change, to undo it): more than one worker now, or workers that may join."""
        return self.options.on_failure == "recover" and (self.world.size > 1
                                                         or self.elastic is not None)

    def _fail(self, exc: BaseException) -> None:
        """A peer died (or stayed silent past the deadline) in the middle of a step or a
        resize. The world's communicator cannot be used any more (MPICH neither errors nor
        completes a collective with a dead peer), so this rank ends the job: rank 0 saves
        the last committed state (the step in flight has changed nothing yet: the optimizer
        has not stepped, the cursor not moved) to --checkpoint, and every survivor exits
        with 75 so that the job script requeues and resumes from it. Never returns."""
        st = self.state
        exc = world_mod.as_failure(exc)  # under ULFM an MPI error is the failure
        detected = time.time()
        who = f"rank {exc.rank}" if exc.rank >= 0 else "a peer"
        log.error("%s of %d failed at step %d (%s); detected at %s: ending the job", who,
                  self.world.size, st.step if st else 0, exc,
                  time.strftime("%H:%M:%S", time.localtime(detected)) +
                  f".{int(detected * 1000) % 1000:03d}")
        code = EXIT_REQUEUE
        if self.world.rank == 0 and st is not None:
            self.recorder.write(FailureRecord(rank=exc.rank, cause=exc.cause, detail=str(exc),
                                          step=st.step, epoch=st.epoch,
                                          world_size=self.world.size, detected_unix=detected,
                                          waited_s=exc.waited_s,
                                          cluster_version=self.world.cluster_version))
            saved = False
            if self.options.checkpoint and not self.joining:
                self.stopped = "peer failure"
                saved = self._save_for_stop(f"the failure of {who}")
                if not saved:
                    code = 1
            else:
                log.error("nothing saved (%s): the state of step %d is lost; exit %d",
                          "no --checkpoint" if not self.options.checkpoint else
                          "a joined worker does not save", st.step, code)
            self._record_stop(f"the failure of {who}", saved, requeue=code == EXIT_REQUEUE)
        self.recorder.close()
        if self._sample_file is not None:
            self._sample_file.close()
        self._close_loader()
        if self.elastic is not None and self.world.rank == 0:
            self.elastic.stop_spares()
            for w in self.elastic.pending.workers if self.elastic.pending is not None else []:
                w.stop()
            self.elastic.remove_join_folders()  # a pending grow's (its joiners are stopped)
        if self.allocator is not None:
            try:
                self.allocator.close(10.0)   # joined workers end on their own; then killed
            except Exception as err:  # pragma: no cover - best effort on the way out
                log.error("could not stop the joined workers: %s", err)
        if self.world.rank == 0:
            agent.record_exit_code(code)
        world_mod.leave_with_launch_siblings(5.0)
        lifecycle.end_process(code)

    def _recover(self, exc: BaseException, *, step_given_up: bool = False,
                 earlier: Optional["_RecoveryStart"] = None) -> None:
        """A peer died in the middle of a step or at its boundary. The survivors agree on
        who died (hpcadapt.elastic.recovery), form a world without it, and take the state of the
        survivor furthest on (one that finished the step in flight before the others
        noticed is one step ahead; the others have changed nothing yet); the step from that
        state's cursor is trained at the smaller size, so no sample is skipped or trained
        twice. Returns with ``_restart`` set, or ends the job through ``_fail`` when the
        death cannot be survived (see ``recovery.unrecoverable``) or recovery fails.
        ``step_given_up``: the death cut a step (round) short, so what the loop body does
        after that ``job.step`` is undone at the next batch; a death at a boundary, in a
        join or after the step committed leaves the body's work of the committed step.
        Under ULFM a death found while the new world forms (several ranks killed together
        can outlast the shrink that follows the first) is recovered from again, from the
        world being formed: ``earlier`` carries what the first attempt knew."""
        from hpcadapt.elastic import recovery
        from hpcadapt.elastic.membership import ResizeOutcome

        exc = world_mod.as_failure(exc)  # under ULFM an MPI error is the failure
        if self.options.on_failure != "recover" or exc.cause not in ("dead", "notice"):
            self._fail(exc)
        if earlier is None:
            earlier = _RecoveryStart(time.perf_counter(), self.world)
        t0, old_size, version = earlier.t0, earlier.old_size, earlier.version
        shrunk = None

        def expire(reason: str) -> None:
            self._fail(world_mod.PeerFailure(reason, cause="timeout"))

        try:
            faults.point("recovery", self.state.step)  # a second death, during the recovery
            if world_mod.ULFM:
                with world_mod.Watchdog(self.options.peer_timeout, "the shrink", expire):
                    agreement, shrunk = recovery.shrink(self.world)
            else:
                agreement = recovery.agree(self.world, [exc.rank] if exc.rank >= 0 else [],
                                           self.options.peer_timeout)
        except world_mod.FAILURES as again:
            self._fail(world_mod.as_failure(again, "the recovery"))
        t_agreed = time.perf_counter()
        this_world = agreement
        agreement = earlier.in_first_world(this_world)  # the dead named in the first world
        why = recovery.unrecoverable(earlier, agreement,
                                     coordinator_may_move=self._coordinator_may_move(),
                                     launch_survives=world_mod.ULFM)
        if why is not None:
            self._fail(world_mod.PeerFailure(f"{exc}; no recovery: {why}",
                                             rank=agreement.dead[0] if agreement.dead else -1,
                                             cause="dead"))
        dead_pids = [earlier.pids[d] for d in agreement.dead]
        # The step in flight is given up: this rank goes back to its last commit before
        # the survivors compare states (the one furthest on is then everyone's).
        rolled_from = self.steps.roll_back()
        if self.elastic is not None and self.elastic.growing:
            # Joiners of a pending grow would connect to the old world: start again later.
            self._record_resize(self.elastic.abandon("a worker died"))

        with world_mod.Watchdog(self.options.peer_timeout, "the recovery", expire):
            try:
                comm = shrunk if shrunk is not None else \
                    recovery.form_world(self.world.comm, agreement.survivors)
                t_formed = time.perf_counter()
                self.world.abandon()
                self.optimizer.abandon_in_flight()
                faults.point("formation", self.state.step)  # a death after the shrink
                self.world.replace(comm)
                if 0 in agreement.dead and self.world.rank == 0:
                    self._take_coordinator_role()
                root, same = self._survey_survivors()
                t_surveyed = time.perf_counter()
                if not same:
                    policy_state = self.engine.state_dict() if self.world.rank == 0 else None
                    view = CommView(self.world.comm, self.world.cluster_version, self.world.watch)
                    self.state.broadcast(view, is_root=self.world.rank == root, root=root)
                    if policy_state is not None:
                        self.engine.load_state_dict(policy_state)  # rank 0's decide
                self._holds_state = True
            except world_mod.FAILURES as again:
                again = world_mod.as_failure(again, "the recovery")
                if not (world_mod.ULFM and again.cause in ("dead", "notice")
                        and earlier.attempts + 1 < old_size):
                    self._fail(again)
                # The formation cut short: its communicator, with its new dead, is the world
                # to shrink now (the step in flight was given up already).
                return self._recover(again, step_given_up=step_given_up,
                                     earlier=earlier.then(this_world))
        self._restart = True
        self.steps.recovered(given_up=step_given_up)
        recovered = time.time()
        phases = {"agree_s": t_agreed - t0, "form_world_s": t_formed - t_agreed,
                  "survey_s": t_surveyed - t_formed,
                  "state_broadcast_s": time.perf_counter() - t_surveyed if not same else None}
        if self.allocator is not None:
            self.allocator.released(len(agreement.dead))
            self.allocator.reap()
        if self.world.rank == 0:
            log.warning("rank(s) %s of %d died (%s): recovered in %.3f s on %d workers, "
                        "training from step %d", list(agreement.dead), old_size, exc,
                        time.perf_counter() - t0, self.world.size, self.state.step)
        self.recorder.write(RecoveryRecord(
            dead=list(agreement.dead), dead_pids=dead_pids, rank=agreement.dead[0],
            cause=exc.cause, detail=str(exc), step=self.state.step, step_in_flight=rolled_from,
            epoch=self.state.epoch, old_size=old_size, world_size=self.world.size,
            detected_unix=exc.detected_at, recovered_unix=recovered, waited_s=exc.waited_s,
            recovery_s=recovered - exc.detected_at, cluster_version=self.world.cluster_version,
            previous_cluster_version=version, **phases))
        self._after_resize(ResizeOutcome(old_size, self.world.size,
                                         f"failure of rank(s) {list(agreement.dead)}", 0.0,
                                         True), t0)
        if self.options.replace_failed and self.elastic is not None:
            self.request_resize(self.world.size + len(agreement.dead),
                                f"replacing failed rank(s) {list(agreement.dead)}")

    def _agree_on_the_end(self) -> bool:
        """ULFM: no rank leaves before every rank has reached the end (a barrier bounded by
        the peers' watch). A death in the last step's exchange can let some ranks complete
        it (ULFM's collectives may complete on some members and fail on others): without
        this they would leave while the others wait for them in the shrink. The barrier
        cannot complete while a peer is dead or recovering (its revoke interrupts it), so
        either all pass or all recover, taking the state of the one furthest on. Returns
        whether a recovery happened (training goes on from the agreed state)."""
        if not (world_mod.ULFM and self._recoverable and self.world.size > 1):
            return False
        with self._recovery_scope():
            world_mod.wait_request(self.world.comm.Ibarrier(), self.world.watch,
                                   "the end of training")
        return self._take_restart()

    def _coordinator_may_move(self) -> bool:
        """Rank 0's role can move where an agent waits for every worker: under
        ``hpcadapt.agent`` with the local allocator (a companion Slurm job's workers are
        not the agent's descendants, and the job step ends with rank 0's launch), unless
        the agent was asked to stop the job (a coordinator that a stop signal ended
        without --checkpoint is not replaced); and anywhere under ULFM, whose launch
        survives any rank. The same on every survivor: one agent, one environment, one
        allocator kind, one MPI."""
        from hpcadapt.elastic.allocator import LocalAllocator

        if world_mod.ULFM:
            return True  # the launch survives any rank's death; mpirun waits for the rest
        return (config.agent_dir() is not None and not agent.stopping()
                and isinstance(self.allocator, LocalAllocator))

    def _take_coordinator_role(self) -> None:
        """The lowest survivor after rank 0 died: it writes the metrics file from here on,
        decides with the policies, saves checkpoints, starts workers (its allocator) and
        prints the summary; the agent forwards stop signals to it. The policies' state
        reached every rank with the last applied decision; what is lost are the counters
        that moved since (cooldowns, probes: rank 0 alone held them). Every decision already
        applied (batch, rate, size) is in the training state that all ranks hold."""
        self.recorder.take_over(self.options.metrics_file)
        self.joining = False  # a joiner no longer: it owns the checkpoint and the end
        if self.elastic is not None:
            self.elastic.warm_spares = self.options.warm_spares
        agent.record_coordinator()
        log.warning("rank 0 died: this worker (pid %d) is the coordinator now (metrics "
                    "file, decisions, checkpoint, allocator); the policies' counters "
                    "since the last decision are lost", os.getpid())

    def _survey_survivors(self):
        """(the lowest rank whose state is furthest on, whether every survivor's state is
        the same): one bounded allgather of each rank's step, a fingerprint of the rest
        (epoch, data cursor, hyper-parameters, strategy, topology) and cluster version. Equal
        steps mean equal weights under S-SGD (every rank applied the same updates; under
        model averaging the replicas differ by design), so equal fingerprints need no state
        broadcast."""
        st = self.state
        plain = json.dumps([st.epoch, st.sampler.cursor, asdict(st.hyper),
                            st.strategy.to_dict(), st.topology], sort_keys=True, default=str)
        # A joiner that has no state yet (a death during its join) counts as step -1.
        mine = np.array([st.step if self._holds_state else -1, zlib.crc32(plain.encode()),
                         self.world.cluster_version], dtype=np.int64)
        table = np.empty((self.world.size, 3), dtype=np.int64)
        world_mod.wait_request(self.world.comm.Iallgather(mine, table), self.world.watch,
                               "the recovery's state survey")
        # A survivor that applied one more boundary's switch than another holds a higher
        # version: all take the highest, so the next plan's version check agrees everywhere.
        self.world.adopt_version(int(table[:, 2].max()))
        if table[:, 0].max() < 0:
            raise world_mod.PeerFailure("no survivor holds the training state (the ranks "
                                        "that did died during a join)", cause="dead")
        same = bool((table[:, :2] == table[0, :2]).all())
        return int(np.argmax(table[:, 0])), same


class _RecoveryStart:
    """What a recovery knows of the world it began in (its size, version, pids, launches)
    and which of that world's ranks survive so far: a recovery cut short by another death
    starts again from the world being formed, and the one that completes names the dead in
    the first world's ranks."""

    def __init__(self, t0: float, world):
        self.t0, self.old_size, self.version = t0, world.size, world.cluster_version
        self.pids = list(world.pids)
        self.launches = list(world.launches)   # what recovery.unrecoverable reads
        self.survivors = tuple(range(world.size))
        self.attempts = 0

    def in_first_world(self, agreement):
        """``agreement`` (over the current survivors) in the first world's ranks."""
        from hpcadapt.elastic.recovery import Agreement

        left = tuple(self.survivors[r] for r in agreement.survivors)
        return Agreement(tuple(r for r in range(self.old_size) if r not in left), left)

    def then(self, agreement) -> "_RecoveryStart":
        """After ``agreement`` over the current survivors, a formation cut short."""
        self.survivors = tuple(self.survivors[r] for r in agreement.survivors)
        self.attempts += 1
        return self
