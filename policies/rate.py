"""What a policy that scales the learning rate must follow: the rate the run is heading for.

The engine makes a policy's explicit rate the new base at the current batch and cancels a
running ramp, so a decay must multiply the ramp's end (the rate the last applied decision set),
not the rate of the step it happens to run at; and it must not coincide with another policy's
batch change, whose rule rate is only known once that change is applied."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional

from .base import Decision, MetricsSnapshot

__all__ = ["RateTracker", "PeakRate"]


@dataclass
class RateTracker:
    heading: Optional[float] = None    # the rate the last applied decision set
    batch_now: Optional[int] = None    # the batch as of the last applied decision

    def start(self, snap: MetricsSnapshot) -> None:
        if self.batch_now is None:
            self.batch_now = snap.batch_size

    def told(self, decision: Decision) -> None:
        """Follow every applied decision (any policy's, the lr rule's)."""
        if decision.lr is not None:
            self.heading = decision.lr
        if decision.batch_size is not None:
            self.batch_now = decision.batch_size

    def batch_pending(self, view: MetricsSnapshot) -> bool:
        """Whether a policy before this one changed the batch in this call: a scale then
        waits for the next call. Seen once, it is taken as the batch, so a change that was
        discarded costs one more wait, no more."""
        pending = self.batch_now is not None and view.batch_size != self.batch_now
        if pending:
            self.batch_now = view.batch_size
        return pending

    def scaled(self, snap: MetricsSnapshot, factor: float) -> float:
        return (self.heading if self.heading is not None else snap.lr) * factor

    def state_dict(self) -> Dict[str, Any]:
        return {"heading": self.heading, "batch_now": self.batch_now}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        heading, batch = state.get("heading"), state.get("batch_now")
        self.heading = None if heading is None else float(heading)
        self.batch_now = None if batch is None else int(batch)


@dataclass
class PeakRate:
    """The user's scheduler's highest rate so far (``MetricsSnapshot.schedule_lr``) and the
    rate now as a fraction of it: how far the schedule has decayed, which the policies that
    read the schedule need (gns-batch's and decay-growth's noise scale at the peak rate,
    decay-growth's halvings)."""

    peak: float = 0.0

    def follow(self, rate: float) -> None:
        """Fold in the scheduler's rate of this step (a non-finite one is not a peak)."""
        if math.isfinite(rate) and rate > self.peak:
            self.peak = rate

    def fraction(self, rate: float) -> Optional[float]:
        """``rate`` over the peak; None while no peak is known or the rate is not finite."""
        if not self.peak > 0 or not math.isfinite(rate):
            return None
        return rate / self.peak
