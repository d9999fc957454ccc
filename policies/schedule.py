"""``schedule``: a fixed schedule of batch size and learning rate by step or by epoch.

What users do today (step decay, batch ramps), as a policy, so that fixed and adaptive runs
go through the same machinery and compare on equal terms."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from hpcadapt.errors import ConfigurationError

from .base import Decision, MetricsSnapshot, Param, Policy
from .params import choice, positive_float, positive_int, step_map

__all__ = ["Schedule"]


class Schedule(Policy):
    name = "schedule"
    params = (
        Param("unit", choice(("step", "epoch")), "step", "schedule points count steps or epochs"),
        Param("batch", step_map(positive_int), [], "global batch sizes, e.g. 0:32,200:64"),
        Param("lr", step_map(positive_float), [], "learning rates, e.g. 0:0.1,300:0.01"),
    )
    reads = ("step", "epoch")

    def __init__(self, *, unit: str = "step", batch: List[Tuple[int, int]] = (),
                 lr: List[Tuple[int, float]] = ()):
        if not batch and not lr:
            raise ConfigurationError(
                "--policy schedule needs --schedule-batch and/or --schedule-lr, e.g. "
                "--schedule-batch 0:32,200:64")
        self.unit = unit
        self.batch = list(batch)
        self.lr = list(lr)
        self.applied = -1   # the last schedule point already applied

    def _due(self, now: int) -> Optional[Decision]:
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
        if not changes:
            return None
        self.applied = now
        what = ", ".join(f"{k}={v}" for k, v in changes.items())
        return Decision(reason=f"schedule point {max(points)} ({self.unit}): {what}",
                        policy=self.name, metrics={self.unit: float(now)}, **changes)

    def before_train(self, snap: MetricsSnapshot) -> Optional[Decision]:
        return self._due(snap.step if self.unit == "step" else snap.epoch)

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        return self._due(snap.step) if self.unit == "step" else None

    def before_epoch(self, snap: MetricsSnapshot) -> Optional[Decision]:
        return self._due(snap.epoch) if self.unit == "epoch" else None

    def state_dict(self) -> Dict[str, Any]:
        return {"applied": self.applied}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.applied = int(state["applied"])
