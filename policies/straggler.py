"""``straggler``: find a rank that stays slower than the others and replace or remove it.

From the per-rank compute times that travel in the step's control reduction (forward and
backward only: waiting for communication is not the rank's own slowness), a rank counts as slow at a
step when its time exceeds ``factor`` times the median of the others. Slow for ``patience``
checks in a row, it is removed; with ``--straggler-action replace`` a fresh worker is then
requested to restore the size. Rank 0 coordinates and is never removed (it is logged)."""

from __future__ import annotations

import logging
import statistics
from typing import Any, Dict, Optional

from .base import Decision, MetricsSnapshot, Param, Policy
from .params import choice, float_above, positive_int

__all__ = ["Straggler"]

log = logging.getLogger(__name__)


class Straggler(Policy):
    name = "straggler"
    params = (
        Param("factor", float_above(1.0), 1.5, "slower than this times the others' median"),
        Param("patience", positive_int, 20, "checks in a row before acting"),
        Param("interval", positive_int, 1, "check every N steps"),
        Param("action", choice(("remove", "replace")), "replace", "what to do with a straggler"),
    )
    reads = ("step",)

    def __init__(self, *, factor: float = 1.5, patience: int = 20, interval: int = 1,
                 action: str = "replace"):
        self.factor, self.patience, self.interval, self.action = factor, patience, interval, action
        self.streak: Dict[int, int] = {}
        self.restore_to: Optional[int] = None

    def slow_ranks(self, times) -> list:
        out = []
        for r, t in enumerate(times):
            others = [x for i, x in enumerate(times) if i != r]
            if others and t > self.factor * statistics.median(others) and t > 0:
                out.append(r)
        return out

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        times = snap.compute_time
        if len(times) < 2 or len(times) != snap.world_size:
            return None
        slow = set(self.slow_ranks(times))
        self.streak = {r: self.streak.get(r, 0) + 1 for r in slow}
        for r, n in sorted(self.streak.items()):
            if n < self.patience:
                continue
            self.streak = {}
            metrics = {f"compute_time_rank{i}": t for i, t in enumerate(times)}
            if r == 0:
                log.warning("rank 0 is a straggler (%.3f s vs others); it coordinates and "
                            "stays", times[0])
                return None
            if self.action == "replace":
                self.restore_to = snap.world_size
            return Decision(reason=f"rank {r} slower than {self.factor}x the others for "
                                   f"{n} checks: {self.action}",
                            world_size=snap.world_size - 1, remove_rank=r, metrics=metrics,
                            policy=self.name)
        return None

    def on_resize(self, snap: MetricsSnapshot, *, old_size: int, new_size: int):
        self.streak = {}
        if self.restore_to is not None and new_size < self.restore_to:
            target, self.restore_to = self.restore_to, None
            return Decision(reason=f"replace the removed straggler: {new_size} -> {target}",
                            world_size=target, policy=self.name)
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {"restore_to": self.restore_to}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.restore_to = state["restore_to"]
