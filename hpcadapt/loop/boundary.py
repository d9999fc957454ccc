"""The step boundary: metrics, stops, the policies' decision (rank 0 decides, one broadcast,
every rank applies the same plan) and the switches a plan asks for.

A part of ``hpcadapt.job.Job`` (a mixin): its methods work on the job's state, which
``Job.__init__`` and ``Job.setup`` create; this module holds one concern of it."""

from __future__ import annotations

import logging

import time
from dataclasses import replace
from typing import Any

from hpcadapt.base import faults
from hpcadapt.base.errors import HpcAdaptError
from hpcadapt.base.metrics import DecisionRecord, StrategyRecord, TopologyRecord
from hpcadapt.base.plan import Plan
from hpcadapt.base.strategies import Strategy, registered
from hpcadapt.comm import world as world_mod
from hpcadapt.comm.tell import root_tells

__all__ = ["Boundary"]

log = logging.getLogger("hpcadapt.job")


class Boundary:
    """The step boundary: metrics, stops, the policies' decision (rank 0 decides, one
    broadcast, every rank applies the same plan) and the switches a plan asks for."""

    def _boundary(self, count: int, *, round_end: bool = False) -> bool:
        """Between two steps, on every rank: metrics, stop, policies, resizes. Returns
        whether training goes on in this epoch."""
        st = self.state
        self.recorder.count_step(count, self.steps.last_loss)
        self.monitoring.log_step(count)
        if self.steps.stop_requested:
            self._stop_for_signal()
            return False
        if self.steps.nonfinite_run >= self.options.max_nonfinite_steps:
            self._stop_for_divergence()
            return False
        if self.steps.finish_requested:
            self.finished_by_stop_file = True
            if self.world.rank == 0:
                log.info("stop file %s found at step %d: training ends here",
                         self.options.stop_file, st.step)
            return False
        if self._max_steps_reached():
            return False
        every = self.options.checkpoint_every
        # the steps this boundary closes: one, or a bounded-delay round's
        closed = max(1, -(-count // st.hyper.batch_size))
        # (not while the loss is non-finite: the last good save is not written over)
        if every and self.options.checkpoint and self.world.rank == 0 \
                and st.step // every > (st.step - closed) // every and not self.steps.nonfinite_run:
            self._save_periodically()
        # A recovery inside a hook or the grow's poll ends the boundary at once: the other
        # survivors may already be in the next step, which every rank then starts afresh
        # (another collective of this boundary would meet no partner).
        queued, self._queued_hooks = self._queued_hooks, []
        for name, extra in queued:
            self._hook(name, **extra)
            if self.left:
                return False
        if self.engine.active and (round_end or self.engine.due(st.step, self.steps.monitored)):
            self._hook("after_step")
        if not self.left:
            self._poll_elastic()
        if self.allocator is not None:
            self.allocator.reap()  # launchers of workers that exited: no zombies
        return not self.left

    def _over(self) -> bool:
        return bool(self.left or self.stopped or self.finished_by_stop_file
                    or self._max_steps_reached())

    def _max_steps_reached(self) -> bool:
        return self.options.max_steps is not None and self.state.step >= self.options.max_steps

    def _hook(self, name: str, **extra: Any) -> None:
        """Rank 0 decides with the policies; every rank applies the same plan. A peer's
        failure goes to the loop's recovery scope."""
        if not self.engine.active:
            return
        plan_text = ""
        snap = decisions = None
        if self.world.rank == 0:
            snap = self.monitoring.snapshot()
            decisions = self.engine.decide(name, snap, **extra)
            if decisions:
                plan_text = self.engine.plan(decisions, snap, self.world.cluster_version).to_json()
        faults.point("plan", self.state.step)
        plan_text = root_tells(plan_text or None, self.world, what="the plan's broadcast")
        if plan_text:
            self._apply_decided_plan(plan_text, snap, decisions)

    def _apply_decided_plan(self, plan_text: str, snap, decisions) -> None:
        """Every rank: the plan rank 0 broadcast, checked, recorded (rank 0) and applied."""
        plan = Plan.from_json(plan_text)
        if plan.version != self.world.cluster_version:
            raise HpcAdaptError(f"a plan of cluster version {plan.version} reached version "
                                f"{self.world.cluster_version}")
        if self.world.rank == 0:
            for d in plan.decisions:
                self.recorder.write(DecisionRecord(
                    step=snap.step, epoch=snap.epoch, policy=d["policy"], changes=d["changes"],
                    reason=d["reason"], metrics=d["metrics"], world_size=self.world.size,
                    batch_size=plan.batch_size or snap.batch_size,
                    lr=plan.lr or (plan.ramp[3] if plan.ramp else snap.lr)))
                log.info("decision at step %d by %s: %s (%s)", snap.step, d["policy"],
                         d["changes"], d["reason"])
        if self.world.rank == 0:
            self.engine.told(decisions, snap)
        # The policies' state after a decision goes to every rank (one small broadcast per
        # decision, in the world that decided, before a resize changes it): a worker that
        # becomes the coordinator (rank 0 died) then holds it as of the last decision, so no
        # decision already applied is taken again.
        state = root_tells(self.engine.state_dict() if self.world.rank == 0 else None,
                           self.world, what="the policies' state")
        if self.world.rank != 0:
            self.engine.load_state_dict(state)
        self._apply_plan(plan)

    def _apply_plan(self, plan: Plan) -> None:
        """The hyper-parameters change together; then a resize, if asked for."""
        h = self.state.hyper
        new = replace(h)
        if plan.batch_size is not None:
            new.batch_size = plan.batch_size
        if plan.momentum is not None:
            new.momentum = plan.momentum
        if plan.lr is not None:
            new.lr, new.ramp = plan.lr, None
            new.base_lr, new.base_batch_size = plan.base_lr, plan.base_batch_size
        if plan.ramp is not None:
            new.ramp = tuple(plan.ramp)
            if plan.ramp[1] == 0:
                new.lr, new.ramp = plan.ramp[3], None
        self.state.hyper = new
        if plan.momentum is not None:
            self._apply_momentum(plan.momentum)
        if plan.strategy is not None:
            # (a peer dying in the switch ends the plan here: the rest was for that world)
            self._switch_strategy(Strategy.from_dict(plan.strategy), plan.reason or "policy")
        if plan.topology is not None:
            self.switch_topology(plan.topology, plan.reason or "policy")
        if plan.world_size is not None and plan.world_size != self.world.size:
            self.request_resize(plan.world_size, plan.reason or "policy",
                                remove=[plan.remove_rank] if plan.remove_rank is not None else None)

    def switch_strategy(self, strategy: Strategy, reason: str = "user request") -> None:
        """Change the synchronisation strategy from the next step on; call on every rank at
        the same point between steps (policies do it through a plan). A peer that dies in
        it is recovered from here; the old strategy stays."""
        registered(strategy)  # one line, on every rank alike, before any collective
        with self._recovery_scope():
            self._switch_strategy(strategy, reason)

    def switch_topology(self, topology: str, reason: str = "user request") -> None:
        """The gradients' allreduce topology from the next step on (``hpcadapt.comm.topology``:
        flat, hierarchical, ring, tree); every rank at the same point between steps. The
        new communicators are built collectively before the next step's first allreduce;
        the cluster version goes up."""
        from hpcadapt.comm.topology import parse_topology

        name = parse_topology(topology).value
        st = self.state
        if name == st.topology:
            return
        if self.optimizer.data_plane == "nccl":
            if self.world.rank == 0:
                log.warning("allreduce topology %s not applied (%s): the gradients travel "
                            "over NCCL, which routes them itself", name, reason)
            return
        old, version = st.topology, self.world.cluster_version
        st.topology = name
        self.world.bump_version()
        if self.world.rank == 0:
            log.info("allreduce topology %s -> %s at step %d (%s)", old, name, st.step, reason)
        self.recorder.write(TopologyRecord(step=st.step, epoch=st.epoch, from_=old, to=name,
                                       reason=reason, previous_cluster_version=version,
                                       cluster_version=self.world.cluster_version))

    def _switch_strategy(self, new: Strategy, reason: str) -> None:
        """Every rank, at a step boundary. Into S-SGD or bounded delay from model averaging
        the replicas become one again: the plain average of all models, then rank 0's
        parameters and optimizer state broadcast (so they are bit-identical whatever the
        reduction order); out of bounded delay rank 0's optimizer state is broadcast.
        A peer dying in these collectives goes to the caller's recovery: the plan is then
        dropped and the old strategy kept (the cluster version went up)."""
        from hpcadapt.parallel.broadcasts import broadcast_optimizer_state, broadcast_parameters

        st = self.state
        old = st.strategy
        if new == old:
            return
        version = self.world.cluster_version
        identical = None
        t0 = time.perf_counter()
        # Into ssgd, or into bounded delay (which starts from rank 0's model), from a
        # strategy whose replicas drift apart: the replicas become one (their average).
        into_one = new.averages_gradients or new.asynchronous
        drifting = not (old.averages_gradients or old.asynchronous)
        if into_one and drifting and self.world.size > 1:
            try:
                self.optimizer.average_models()
                broadcast_parameters(list(self.model.parameters()) + list(self.model.buffers()),
                                     root=0, world=self.world)
                broadcast_optimizer_state(self.optimizer.optimizer, root=0, world=self.world)
            except world_mod.FAILURES:
                # (rank 0 of the world that switched; if it is the one that died, the
                # recovery's line alone says what happened)
                if self.world.rank == 0:
                    log.error("strategy switch %s -> %s discarded (a peer died in it); "
                              "training goes on with %s after the recovery", old.name,
                              new.name, old.describe())
                raise
            identical = self.replicas_identical() if self.options.check_replicas else None
        elif old.asynchronous and self.world.size > 1:
            # out of bounded delay: only rank 0's optimizer stepped (the models are rank
            # 0's since the round's end); its state goes to every rank
            broadcast_optimizer_state(self.optimizer.optimizer, root=0, world=self.world)
            identical = self.replicas_identical() if self.options.check_replicas else None
        st.strategy = new
        self.world.bump_version()
        if self.world.rank == 0:
            log.info("strategy %s -> %s at step %d (%s)", old.describe(), new.describe(),
                     st.step, reason)
        self.recorder.write(StrategyRecord(step=st.step, epoch=st.epoch, from_=old.to_dict(),
                                       to=new.to_dict(), reason=reason,
                                       previous_cluster_version=version,
                                       cluster_version=self.world.cluster_version,
                                       switch_s=time.perf_counter() - t0,
                                       replicas_identical=identical))

    def _apply_momentum(self, momentum: float) -> None:
        applied = False
        for group in self.optimizer.param_groups:
            if "momentum" in group:
                group["momentum"] = momentum
                applied = True
        if not applied and self.world.rank == 0:
            log.warning("momentum %.3g not applied: the optimizer (%s) has no SGD momentum "
                        "(Adam's betas are left as they are)", momentum,
                        type(self.optimizer.optimizer).__name__)
