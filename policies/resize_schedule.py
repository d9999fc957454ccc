"""``resize-schedule``: resize to given sizes at given steps (experiments and tests)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from hpcadapt.base.errors import ConfigurationError

from .base import Decision, MetricsSnapshot, Param, Policy
from .params import non_negative_int, positive_int, step_map

__all__ = ["ResizeSchedule"]


class ResizeSchedule(Policy):
    name = "resize-schedule"
    params = (
        Param("steps", step_map(positive_int), [], "STEP:SIZE pairs, e.g. 20:4,40:1,60:2"),
        Param("hold", non_negative_int, 0,
              "train at least this many steps at a size a resize reached before the next "
              "point applies (grows take as long as their workers need to start)"),
    )
    reads = ("step",)

    def __init__(self, *, steps: List[Tuple[int, int]] = (), hold: int = 0):
        if not steps:
            raise ConfigurationError("--policy resize-schedule needs --resize-schedule-steps, "
                                     "e.g. 20:4,40:1,60:2")
        self.steps = list(steps)
        self.next = 0  # index of the first point not yet applied
        self.hold = hold
        self.resized_at = -1  # step at which the last resize completed

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        # Points apply in order, each once the resize before it has completed: a grow
        # takes as long as its workers need to start, which no step count can promise.
        if self.next >= len(self.steps) or snap.resizing:
            return None
        at, size = self.steps[self.next]
        if at > snap.step or (self.resized_at >= 0 and snap.step < self.resized_at + self.hold):
            return None
        self.next += 1
        if size == snap.world_size:
            return None
        # say when it applies, and why later than scheduled (a hold, a grow still pending)
        when = f"scheduled at step {at}" if snap.step == at else (
            f"scheduled at step {at}, applied at step {snap.step} (after the previous "
            f"resize's hold of {self.hold} steps or its grow)")
        return Decision(reason=f"{when}: {snap.world_size} -> {size} workers",
                        world_size=size, policy=self.name,
                        metrics={"step": float(snap.step), "world_size": float(snap.world_size)})

    def on_resize(self, snap: MetricsSnapshot, *, old_size: int, new_size: int) -> Optional[Decision]:
        self.resized_at = snap.step
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {"next": self.next, "resized_at": self.resized_at}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.next = int(state["next"])
        self.resized_at = int(state.get("resized_at", -1))
