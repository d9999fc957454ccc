"""``schedule``: a fixed schedule of batch size and learning rate by step or by epoch.

What users do today (step decay, batch ramps), as a policy, so that fixed and adaptive runs
go through the same machinery and compare on equal terms.

``lr`` points set an absolute rate. ``lr-scale`` points multiply the rate the run is at (or,
while the learning-rate rule's ramp runs, the rate it is heading for) by a factor: a step
decay that composes with a batch policy and ``--lr-rule``. The engine makes an explicit rate
the new base at the current batch, so a later batch change scales the decayed rate."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from hpcadapt.base.errors import ConfigurationError

from .base import Decision, MetricsSnapshot, Param, Policy
from .params import choice, positive_float, positive_int, step_map
from .rate import RateTracker

__all__ = ["Schedule"]


class Schedule(Policy):
    name = "schedule"
    changes_batch = True
    params = (
        Param("unit", choice(("step", "epoch")), "step", "schedule points count steps or epochs"),
        Param("batch", step_map(positive_int), [], "global batch sizes, e.g. 0:32,200:64"),
        Param("lr", step_map(positive_float), [], "learning rates, e.g. 0:0.1,300:0.01"),
        Param("lr-scale", step_map(positive_float), [],
              "multiply the learning rate by FACTOR at each point, e.g. 7:0.1 (a step decay "
              "that composes with --lr-rule and batch policies)"),
    )
    reads = ("step", "epoch")

    def __init__(self, *, unit: str = "step", batch: List[Tuple[int, int]] = (),
                 lr: List[Tuple[int, float]] = (), lr_scale: List[Tuple[int, float]] = ()):
        if not batch and not lr and not lr_scale:
            raise ConfigurationError(
                "--policy schedule needs --schedule-batch, --schedule-lr and/or "
                "--schedule-lr-scale, e.g. --schedule-batch 0:32,200:64")
        both = sorted({at for at, _ in batch} & {at for at, _ in lr_scale})
        if both:
            # The rule's rate for the new batch is not known here, so there is nothing to scale.
            raise ConfigurationError(
                f"--schedule-lr-scale and --schedule-batch share point(s) {both}: put the "
                f"scale one {unit} later, or give the rate with --schedule-lr")
        self.unit = unit
        self.batch = list(batch)
        self.lr = list(lr)
        self.lr_scale = list(lr_scale)
        self.applied = -1   # the last schedule point already applied
        self.scaled = -1    # the last lr-scale point already applied
        self.rate = RateTracker()

    def _now(self, snap: MetricsSnapshot) -> int:
        return snap.step if self.unit == "step" else snap.epoch

    def _due(self, snap: MetricsSnapshot) -> Optional[Decision]:
        now = self._now(snap)
        changes: Dict[str, Any] = {}
        points = []
        for at, value in self.batch:
            if self.applied < at <= now:
                changes["batch_size"] = value
                points.append(at)
        for at, value in self.lr:
            if self.applied < at <= now:
                changes["lr"] = value
                points.append(at)
        self.applied = max(self.applied, now)
        factor = 1.0
        due = [(at, value) for at, value in self.lr_scale if self.scaled < at <= now]
        if due and "batch_size" not in changes and not self.rate.batch_pending(snap):
            for at, value in due:
                factor *= value
                points.append(at)
            self.scaled = now
        if factor != 1.0:
            changes["lr"] = changes["lr"] * factor if "lr" in changes \
                else self.rate.scaled(snap, factor)
        if not changes:
            return None
        what = ", ".join(f"{k}={v:g}" for k, v in changes.items())
        if factor != 1.0:
            what += f" (x{factor:g})"
        return Decision(reason=f"schedule point {max(points)} ({self.unit}): {what}",
                        policy=self.name, metrics={self.unit: float(now)}, **changes)

    def before_train(self, snap: MetricsSnapshot) -> Optional[Decision]:
        self.rate.start(snap)
        return self._due(snap)

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        if self.unit == "step":
            return self._due(snap)
        if any(self.scaled < at <= snap.epoch for at, _ in self.lr_scale):
            return self._due(snap)   # a scale that waited for a batch change
        return None

    def before_epoch(self, snap: MetricsSnapshot) -> Optional[Decision]:
        return self._due(snap) if self.unit == "epoch" else None

    def on_decision(self, decision: Decision, snap: MetricsSnapshot) -> None:
        """Follow the rate and batch every applied decision (any policy's, the rule's) set."""
        self.rate.told(decision)

    def state_dict(self) -> Dict[str, Any]:
        return {"applied": self.applied, "scaled": self.scaled, **self.rate.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.applied = int(state["applied"])
        self.scaled = int(state.get("scaled", self.applied))
        self.rate.load_state_dict(state)
