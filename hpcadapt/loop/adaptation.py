"""Adaptation at the step boundary: rank 0 decides with the policies, one broadcast, every rank
applies the same plan (hyper-parameters, strategy, topology, a resize asked for).

``Adaptation`` is the Job's collaborator for it and the one writer of the hyper-parameters
(``state.hyper``): a plan's batch, rate, momentum and ramp, and the ramp's rate at each step.
It reads the job's parts (``loop.parts``: options, world, state, model, optimizer); it is
given the recorder and the snapshot (the Job's: the monitoring's view of the last step), and
assigns none of the Job's attributes."""

from __future__ import annotations

import logging

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional

from hpcadapt.adapt.engine import PolicyEngine
from hpcadapt.base import faults
from hpcadapt.base.errors import HpcAdaptError
from hpcadapt.base.metrics import DecisionRecord, StrategyRecord, TopologyRecord
from hpcadapt.base.plan import Plan
from hpcadapt.base.strategies import Strategy
from hpcadapt.comm import world as world_mod
from hpcadapt.comm.tell import root_tells
from hpcadapt.loop.parts import JobParts
from hpcadapt.loop.recording import Recorder

if TYPE_CHECKING:
    from hpcadapt.policies.base import MetricsSnapshot

__all__ = ["Adaptation"]

log = logging.getLogger("hpcadapt.job")


class Adaptation:
    """The policies' decision at a step boundary and the plan applied on every rank; the
    learning-rate ramp a batch change starts."""

    def __init__(self, parts: JobParts, recorder: Recorder,
                 snapshot: Callable[[], MetricsSnapshot], *,
                 check_replicas: Callable[[], Optional[bool]],
                 request_resize: Callable[..., None]):
        from hpcadapt.policies.lr_rules import LRRule

        self.parts = parts
        self.recorder = recorder
        self.snapshot = snapshot   # what rank 0 knows at a step boundary (the Job's)
        self.check_replicas = check_replicas  # --check-replicas after a switch (Monitoring's)
        self.request_resize = request_resize  # a plan's new size (the membership's)
        o = parts.options.adaptation
        #: the policies and the rate rule: a snapshot in, decisions and a plan out
        self.engine = PolicyEngine(o.policies, LRRule(o.lr_rule, o.lr_ramp_steps),
                                   resize_batch=o.resize_batch)
        # hooks to run at the next boundary (a resize's on_resize, queued by every rank of
        # the new world: the hook is collective)
        self._queued: list = []

    def due(self, *, monitored: bool, round_end: bool = False) -> bool:
        """Whether the policies decide at this step boundary (their interval, or the end of
        a bounded-delay round); ``monitored``: whether the last step measured the gradient
        statistics."""
        return self.engine.active and (round_end or self.engine.due(self.parts.state.step,
                                                                    monitored))

    def queue_hook(self, name: str, **extra: Any) -> None:
        """Run the policies' hook ``name`` at the next step boundary."""
        self._queued.append((name, extra))

    def take_queued_hooks(self) -> list:
        """The hooks queued since the last boundary, in order (taken: the queue is empty)."""
        queued, self._queued = self._queued, []
        return queued

    def follow_ramp(self) -> None:
        """The reference rate of this step (a batch change's ramp moves it); the update
        applies it on top of the user's rates (``settings_applied``)."""
        self.parts.state.follow_ramp()

    def hook(self, name: str, **extra: Any) -> None:
        """Rank 0 decides with the policies; every rank applies the same plan. A peer's
        failure goes to the loop's recovery scope."""
        parts = self.parts
        if not self.engine.active:
            return
        plan_text = ""
        snap = decisions = None
        if parts.world.rank == 0:
            snap = self.snapshot()
            decisions = self.engine.decide(name, snap, **extra)
            if decisions:
                plan_text = self.engine.plan(decisions, snap, parts.world.cluster_version).to_json()
        faults.point("plan", parts.state.step)
        plan_text = root_tells(plan_text or None, parts.world, what="the plan's broadcast")
        if plan_text:
            self._apply_decided_plan(plan_text, snap, decisions)

    def _apply_decided_plan(self, plan_text: str, snap, decisions) -> None:
        """Every rank: the plan rank 0 broadcast, checked, recorded (rank 0) and applied."""
        parts = self.parts
        plan = Plan.from_json(plan_text)
        if plan.version != parts.world.cluster_version:
            raise HpcAdaptError(f"a plan of cluster version {plan.version} reached version "
                                f"{parts.world.cluster_version}")
        if parts.world.rank == 0:
            # "lr" in the record and the log line is the rate the updates will use once the
            # decision's ramp (if any) is done (the user's rate now times the policies' new
            # factor), never the rule's reference.
            reference = plan.lr or (plan.ramp[3] if plan.ramp else snap.lr)
            factor = parts.state.rate_factor(reference)
            user_rate = float(parts.optimizer.optimizer.param_groups[0]["lr"])
            applied = parts.state.applied_rate(user_rate, reference)
            for d in plan.decisions:
                changes = dict(d["changes"])
                if "lr" in changes:
                    changes.update(lr=applied, lr_factor=factor)
                self.recorder.write(DecisionRecord(
                    step=snap.step, epoch=snap.epoch, policy=d["policy"], changes=changes,
                    reason=d["reason"], metrics=d["metrics"], world_size=parts.world.size,
                    batch_size=plan.batch_size or snap.batch_size, lr=applied,
                    lr_factor=factor))
                log.info("decision at step %d by %s: %s (%s)", snap.step, d["policy"],
                         _readable(changes), d["reason"])
        if parts.world.rank == 0:
            self.engine.told(decisions, snap)
        # The policies' state after a decision goes to every rank (one small broadcast per
        # decision, in the world that decided, before a resize changes it): a worker that
        # becomes the coordinator (rank 0 died) then holds it as of the last decision, so no
        # decision already applied is taken again.
        state = root_tells(self.engine.state_dict() if parts.world.rank == 0 else None,
                           parts.world, what="the policies' state")
        if parts.world.rank != 0:
            self.engine.load_state_dict(state)
        self.apply_plan(plan)

    def apply_plan(self, plan: Plan) -> None:
        """The hyper-parameters change together; then a resize, if asked for."""
        parts = self.parts
        h = parts.state.hyper
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
        parts.state.set_hyper(new)
        if plan.momentum is not None:
            self._check_momentum(plan.momentum)
        if plan.strategy is not None:
            # (a peer dying in the switch ends the plan here: the rest was for that world)
            self.switch_strategy(Strategy.from_dict(plan.strategy), plan.reason or "policy")
        if plan.topology is not None:
            self.switch_topology(plan.topology, plan.reason or "policy")
        if plan.world_size is not None and plan.world_size != parts.world.size:
            self.request_resize(plan.world_size, plan.reason or "policy",
                                remove=[plan.remove_rank] if plan.remove_rank is not None
                                else None)

    def switch_topology(self, topology: str, reason: str) -> None:
        """The gradients' allreduce topology from the next step on (``hpcadapt.comm.topology``:
        flat, hierarchical, ring, tree); every rank at the same point between steps. The
        new communicators are built collectively before the next step's first allreduce;
        the cluster version goes up."""
        from hpcadapt.comm.topology import parse_topology

        parts = self.parts
        name = parse_topology(topology).value
        st = parts.state
        if name == st.topology:
            return
        if parts.optimizer.data_plane == "nccl":
            if parts.world.rank == 0:
                log.warning("allreduce topology %s not applied (%s): the gradients travel "
                            "over NCCL, which routes them itself", name, reason)
            return
        old, version = st.topology, parts.world.cluster_version
        st.switch_topology(name)
        parts.world.bump_version()
        if parts.world.rank == 0:
            log.info("allreduce topology %s -> %s at step %d (%s)", old, name, st.step, reason)
        self.recorder.write(TopologyRecord(step=st.step, epoch=st.epoch, from_=old, to=name,
                                           reason=reason, previous_cluster_version=version,
                                           cluster_version=parts.world.cluster_version))

    def switch_strategy(self, new: Strategy, reason: str) -> None:
        """Every rank, at a step boundary. Into S-SGD or bounded delay from model averaging
        the replicas become one again: the plain average of all models, then rank 0's
        parameters and optimizer state broadcast (so they are bit-identical whatever the
        reduction order); out of bounded delay rank 0's optimizer state is broadcast.
        A peer dying in these collectives goes to the caller's recovery: the plan is then
        dropped and the old strategy kept (the cluster version went up)."""
        from hpcadapt.parallel.broadcasts import broadcast_optimizer_state, broadcast_parameters

        parts = self.parts
        st = parts.state
        old = st.strategy
        if new == old:
            return
        version = parts.world.cluster_version
        identical = None
        t0 = time.perf_counter()
        # Into ssgd, or into bounded delay (which starts from rank 0's model), from a
        # strategy whose replicas drift apart: the replicas become one (their average).
        into_one = new.averages_gradients or new.asynchronous
        drifting = not (old.averages_gradients or old.asynchronous)
        if into_one and drifting and parts.world.size > 1:
            try:
                parts.optimizer.average_models()
                broadcast_parameters(list(parts.model.parameters()) + list(parts.model.buffers()),
                                     root=0, world=parts.world)
                broadcast_optimizer_state(parts.optimizer.optimizer, root=0, world=parts.world)
            except world_mod.FAILURES:
                # (rank 0 of the world that switched; if it is the one that died, the
                # recovery's line alone says what happened)
                if parts.world.rank == 0:
                    log.error("strategy switch %s -> %s discarded (a peer died in it); "
                              "training goes on with %s after the recovery", old.name,
                              new.name, old.describe())
                raise
            identical = self.check_replicas()
        elif old.asynchronous and parts.world.size > 1:
            # out of bounded delay: only rank 0's optimizer stepped (the models are rank
            # 0's since the round's end); its state goes to every rank
            broadcast_optimizer_state(parts.optimizer.optimizer, root=0, world=parts.world)
            identical = self.check_replicas()
        st.switch_strategy(new)
        parts.world.bump_version()
        if parts.world.rank == 0:
            log.info("strategy %s -> %s at step %d (%s)", old.describe(), new.describe(),
                     st.step, reason)
        self.recorder.write(StrategyRecord(step=st.step, epoch=st.epoch, from_=old.to_dict(),
                                           to=new.to_dict(), reason=reason,
                                           previous_cluster_version=version,
                                           cluster_version=parts.world.cluster_version,
                                           switch_s=time.perf_counter() - t0,
                                           replicas_identical=identical))

    def _check_momentum(self, momentum: float) -> None:
        """A plan's momentum is the update's in every param group that has one (SGD's:
        ``settings_applied``); an optimizer with none is told of once per decision."""
        parts = self.parts
        applies = any("momentum" in group for group in parts.optimizer.param_groups)
        if not applies and parts.world.rank == 0:
            log.warning("momentum %.3g not applied: the optimizer (%s) has no SGD momentum "
                        "(Adam's betas are left as they are)", momentum,
                        type(parts.optimizer.optimizer).__name__)


def _readable(changes: dict) -> str:
    """A decision's changes for the log line: ``batch_size 64, lr 0.00123 (factor x1.41)``."""
    shown = []
    for key, value in changes.items():
        if key == "lr_factor":
            continue
        if key == "lr" and "lr_factor" in changes:
            shown.append(f"lr {value:.3g} (factor x{changes['lr_factor']:.3g} on your rate)")
        else:
            shown.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
    return ", ".join(shown)
