"""A peer's death, recovered from in place: the survivors agree on who died, form a world
without them, and take the state of the one furthest on.

``Failures`` is the Job's collaborator for it: ``recover`` returns a typed
``Recovered`` outcome for the Job to act on (record the resize, replace the dead) and asks
the loop to start its iteration again (``restart_pending``, read once by the loop's scope
through ``take_restart``), or ends the job through ``Stops.fail`` (state saved, exit 75)
when the death cannot be survived. It assigns none of the Job's attributes."""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Callable, NoReturn, Optional, Protocol, Tuple

import numpy as np

from hpcadapt.base import agent_files as agent, config, faults
from hpcadapt.base.metrics import RecoveryRecord
from hpcadapt.comm import world as world_mod
from hpcadapt.comm.world import CommView
from hpcadapt.loop.parts import JobParts
from hpcadapt.loop.recording import Recorder
from hpcadapt.adapt.engine import PolicyEngine

__all__ = ["Failures", "Recovered", "RecoveryScope"]

log = logging.getLogger("hpcadapt.job")


@dataclass(frozen=True)
class Recovered:
    """What a recovery did: ``dead`` (ranks of the world it began in), that world's size
    and the new one's, ``started`` (its perf_counter start: the resize's pause), ``why``
    (the failure that started it)."""

    dead: Tuple[int, ...]
    old_size: int
    new_size: int
    started: float
    why: str


class RecoveryMembership(Protocol):
    """What a recovery asks of the job's membership (``loop.resizing.Resizing``)."""

    def may_grow(self) -> bool: ...

    def abandon_grow(self, why: str) -> None: ...

    def released(self, dead: int) -> None: ...

    def coordinator_may_move(self) -> bool: ...

    def own_the_end(self) -> None: ...


class Failures:
    """Detect, agree, shrink, survey, take the state of the survivor furthest on (see
    ``recover``). Reads the job's options, world, state and optimizer; is given the
    recorder, the policy engine, the membership's part (``RecoveryMembership``), the step
    runner's ``roll_back`` and ``fail``, which ends the job (``Stops.fail``)."""

    def __init__(self, parts: JobParts, recorder: Recorder, engine: PolicyEngine,
                 fail: Callable[[BaseException], NoReturn], membership: RecoveryMembership,
                 roll_back: Callable[[], int]):
        self.parts = parts
        self.recorder = recorder
        self.engine = engine   # the policies' state, sent to survivors that lack it
        self.fail = fail       # ends the job, state saved (Stops.fail)
        self.membership = membership
        self.roll_back = roll_back  # the step in flight undone (StepRunner.roll_back)
        # Set by a recovery: the loop's iteration it cut short starts again from the state
        # the survivors agreed on (read once, by the loop's scope: take_restart).
        self.restart_pending = False

    def take_restart(self) -> bool:
        """Whether a recovery asked the loop to start its iteration again (read once)."""
        restart, self.restart_pending = self.restart_pending, False
        return restart

    @property
    def recoverable(self) -> bool:
        """Whether a peer's death can be survived here (then each step keeps what it may
        change, to undo it): more than one worker now, or workers that may join."""
        parts = self.parts
        return parts.options.failures.on_failure == "recover" and (parts.world.size > 1
                                                                 or self.membership.may_grow())

    def recover(self, exc: BaseException, *, holds_state: bool,
                earlier: Optional["_RecoveryStart"] = None) -> Recovered:
        """A peer died in the middle of a step or at its boundary. The survivors agree on
        who died (hpcadapt.elastic.recovery), form a world without it, and take the state
        of the survivor furthest on (one that finished the step in flight before the others
        noticed is one step ahead; the others have changed nothing yet); the step from that
        state's cursor is trained at the smaller size, so no sample is skipped or trained
        twice. Returns what it did, or ends the job through ``fail`` when the death
        cannot be survived (see ``recovery.unrecoverable``) or the recovery fails.
        ``holds_state``: whether this process holds the training state (a joiner whose
        join the death cut short does not: it takes a survivor's). Under ULFM a death
        found while the new world forms (several ranks killed together can outlast the
        shrink that follows the first) is recovered from again, from the world being
        formed: ``earlier`` carries what the first attempt knew."""
        from hpcadapt.elastic import recovery

        parts = self.parts
        o, st = parts.options, parts.state
        exc = world_mod.as_failure(exc)  # under ULFM an MPI error is the failure
        if o.failures.on_failure != "recover" or exc.cause not in ("dead", "notice"):
            self.fail(exc)
        if earlier is None:
            earlier = _RecoveryStart(time.perf_counter(), parts.world)
        t0, old_size, version = earlier.t0, earlier.old_size, earlier.version
        shrunk = None

        def expire(reason: str) -> None:
            self.fail(world_mod.PeerFailure(reason, cause="timeout"))

        try:
            faults.point("recovery", st.step)  # a second death, during the recovery
            if world_mod.ULFM:
                with world_mod.Watchdog(o.failures.peer_timeout, "the shrink", expire):
                    agreement, shrunk = recovery.shrink(parts.world)
            else:
                agreement = recovery.agree(parts.world, [exc.rank] if exc.rank >= 0 else [],
                                           o.failures.peer_timeout)
        except world_mod.FAILURES as again:
            self.fail(world_mod.as_failure(again, "the recovery"))
        t_agreed = time.perf_counter()
        this_world = agreement
        agreement = earlier.in_first_world(this_world)  # the dead named in the first world
        why = recovery.unrecoverable(earlier, agreement,
                                     coordinator_may_move=self.coordinator_may_move(),
                                     launch_survives=world_mod.ULFM)
        if why is not None:
            self.fail(world_mod.PeerFailure(f"{exc}; no recovery: {why}",
                                            rank=agreement.dead[0] if agreement.dead else -1,
                                            cause="dead"))
        dead_pids = [earlier.pids[d] for d in agreement.dead]
        # The step in flight is given up: this rank goes back to its last commit before
        # the survivors compare states (the one furthest on is then everyone's).
        rolled_from = self.roll_back()
        # Joiners of a pending grow would connect to the old world: start again later.
        self.membership.abandon_grow("a worker died")

        with world_mod.Watchdog(o.failures.peer_timeout, "the recovery", expire):
            try:
                comm = shrunk if shrunk is not None else \
                    recovery.form_world(parts.world.comm, agreement.survivors)
                t_formed = time.perf_counter()
                parts.world.abandon()
                parts.optimizer.abandon_in_flight()
                faults.point("formation", st.step)  # a death after the shrink
                parts.world.replace(comm)
                if 0 in agreement.dead and parts.world.rank == 0:
                    self._take_coordinator_role()
                root, same = self._survey_survivors(holds_state)
                t_surveyed = time.perf_counter()
                if not same:
                    engine = self.engine
                    policy_state = engine.state_dict() if parts.world.rank == 0 else None
                    view = CommView(parts.world.comm, parts.world.cluster_version,
                                    parts.world.watch)
                    st.broadcast(view, is_root=parts.world.rank == root, root=root)
                    if policy_state is not None:
                        engine.load_state_dict(policy_state)  # rank 0's decide
            except world_mod.FAILURES as again:
                again = world_mod.as_failure(again, "the recovery")
                if not (world_mod.ULFM and again.cause in ("dead", "notice")
                        and earlier.attempts + 1 < old_size):
                    self.fail(again)
                # The formation cut short: its communicator, with its new dead, is the world
                # to shrink now (the step in flight was given up already).
                return self.recover(again, holds_state=holds_state,
                                    earlier=earlier.then(this_world))
        recovered = time.time()
        phases = {"agree_s": t_agreed - t0, "form_world_s": t_formed - t_agreed,
                  "survey_s": t_surveyed - t_formed,
                  "state_broadcast_s": time.perf_counter() - t_surveyed if not same else None}
        self.membership.released(len(agreement.dead))
        self.recorder.write(RecoveryRecord(
            dead=list(agreement.dead), dead_pids=dead_pids,
            rank=agreement.dead[0] if agreement.dead else -1,
            cause=exc.cause, detail=str(exc), step=st.step, step_in_flight=rolled_from,
            epoch=st.epoch, old_size=old_size, world_size=parts.world.size,
            detected_unix=exc.detected_at, recovered_unix=recovered, waited_s=exc.waited_s,
            recovery_s=recovered - exc.detected_at, cluster_version=parts.world.cluster_version,
            previous_cluster_version=version, **phases))
        self.restart_pending = True
        return Recovered(tuple(agreement.dead), old_size, parts.world.size, t0, str(exc))

    def coordinator_may_move(self) -> bool:
        """Rank 0's role can move where an agent waits for every worker: under
        ``hpcadapt.agent`` with the local allocator (a companion Slurm job's workers are
        not the agent's descendants, and the job step ends with rank 0's launch), unless
        the agent was asked to stop the job (a coordinator that a stop signal ended
        without --checkpoint is not replaced); and anywhere under ULFM, whose launch
        survives any rank. The same on every survivor: one agent, one environment, one
        allocator kind, one MPI."""
        if world_mod.ULFM:
            return True  # the launch survives any rank's death; mpirun waits for the rest
        return (config.agent_dir() is not None and not agent.stopping()
                and self.membership.coordinator_may_move())

    def _take_coordinator_role(self) -> None:
        """The lowest survivor after rank 0 died: it writes the metrics file from here on,
        decides with the policies, saves checkpoints, starts workers (its allocator) and
        prints the summary; the agent forwards stop signals to it. The policies' state
        reached every rank with the last applied decision; what is lost are the counters
        that moved since (cooldowns, probes: rank 0 alone held them). Every decision already
        applied (batch, rate, size) is in the training state that all ranks hold."""
        parts = self.parts
        self.recorder.take_over(parts.options.recording.metrics_file)
        self.membership.own_the_end()  # a joiner no longer: it owns the checkpoint and the end
        agent.record_coordinator()
        log.warning("rank 0 died: this worker (pid %d) is the coordinator now (metrics "
                    "file, decisions, checkpoint, allocator); the policies' counters "
                    "since the last decision are lost", os.getpid())

    def _survey_survivors(self, holds_state: bool):
        """(the lowest rank whose state is furthest on, whether every survivor's state is
        the same): one bounded allgather of each rank's step, a fingerprint of the rest
        (epoch, data cursor, hyper-parameters, strategy, topology) and cluster version. Equal
        steps mean equal weights under S-SGD (every rank applied the same updates; under
        model averaging the replicas differ by design), so equal fingerprints need no state
        broadcast."""
        st, world = self.parts.state, self.parts.world
        plain = json.dumps([st.epoch, st.sampler.cursor, asdict(st.hyper),
                            st.strategy.to_dict(), st.topology], sort_keys=True, default=str)
        # A joiner that has no state yet (a death during its join) counts as step -1.
        mine = np.array([st.step if holds_state else -1, zlib.crc32(plain.encode()),
                         world.cluster_version], dtype=np.int64)
        table = np.empty((world.size, 3), dtype=np.int64)
        world_mod.wait_request(world.comm.Iallgather(mine, table), world.watch,
                               "the recovery's state survey")
        # A survivor that applied one more boundary's switch than another holds a higher
        # version: all take the highest, so the next plan's version check agrees everywhere.
        world.adopt_version(int(table[:, 2].max()))
        if table[:, 0].max() < 0:
            raise world_mod.PeerFailure("no survivor holds the training state (the ranks "
                                        "that did died during a join)", cause="dead")
        same = bool((table[:, :2] == table[0, :2]).all())
        return int(np.argmax(table[:, 0])), same


class RecoveryScope:
    """The loop's recovery scope (``with job.recovery_scope() as scope:``): a peer's
    failure raised inside it is recovered from on leaving it (or ends the job), and the
    code after it reads ``scope.recovered``. With ``Job.step`` (the user's call, where no
    exception may go) the only way into a recovery. ``step_given_up``: set while the step
    (round) in flight has not committed, so that the loop body's work for it is undone."""

    def __init__(self, recover):
        self._recover = recover
        self.step_given_up = False
        self.recovered = False

    def __enter__(self) -> "RecoveryScope":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if kind is None or not issubclass(kind, world_mod.FAILURES):
            return False
        self._recover(exc, step_given_up=self.step_given_up)  # or ends the job
        self.recovered = True
        return True


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
