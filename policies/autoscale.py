"""``autoscale``: the AutoScaling Engine's probe (Or et al., MLSys'20).

Every ``interval`` steps, add ``step`` workers while the scaling efficiency of the last
addition, s = (dR/dk) / r_k with R the global throughput at k workers and r_k = R_k / k the
per-worker throughput before it, stays above ``threshold``. When s falls below it, undo the
last addition and stop probing for ``backoff`` steps. Throughput is averaged over the window
since the last resize, after ``settle`` steps."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from .base import Decision, MetricsSnapshot, Param, Policy
from .params import fraction, non_negative_int, positive_int

__all__ = ["AutoScale", "scaling_efficiency"]


def scaling_efficiency(r_before: float, k_before: int, r_after: float, k_after: int) -> float:
    """s = ((R_after - R_before) / (k_after - k_before)) / (R_before / k_before)."""
    if k_after == k_before or r_before <= 0:
        return float("nan")
    return ((r_after - r_before) / (k_after - k_before)) / (r_before / k_before)


class AutoScale(Policy):
    name = "autoscale"
    params = (
        Param("step", positive_int, 1, "workers added per probe (d)"),
        Param("interval", positive_int, 50, "steps between probes (K)"),
        Param("threshold", fraction, 0.5, "keep growing while the scaling efficiency s >= S"),
        Param("settle", non_negative_int, 5, "steps after a resize left out of the throughput"),
        Param("backoff", non_negative_int, 500, "steps without probing after an undo"),
    )
    reads = ("samples_per_s",)

    def __init__(self, *, step: int = 1, interval: int = 50, threshold: float = 0.5,
                 settle: int = 5, backoff: int = 500):
        # The engine calls after_step every step (the throughput window needs each one);
        # probes happen every ``probe_interval`` steps.
        self.step, self.probe_interval, self.threshold = step, interval, threshold
        self.settle, self.backoff = settle, backoff
        self.window: List[float] = []
        self.last_resize_step = 0
        self.previous: Optional[Dict[str, float]] = None  # throughput at the size before
        self.resume_at = 0

    def _throughput(self) -> float:
        return sum(self.window) / len(self.window) if self.window else float("nan")

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        if snap.step - self.last_resize_step > self.settle:
            self.window.append(snap.samples_per_s)
        if snap.step % self.probe_interval != 0 or len(self.window) < 3:
            return None
        rate = self._throughput()
        k = snap.world_size
        if self.previous is not None and self.previous["k"] < k:
            s = scaling_efficiency(self.previous["rate"], int(self.previous["k"]), rate, k)
            metrics = {"scaling_efficiency": s, "throughput": rate,
                       "throughput_before": self.previous["rate"]}
            if not math.isfinite(s) or s < self.threshold:
                self.resume_at = snap.step + self.backoff
                back = int(self.previous["k"])
                self.previous = None
                return Decision(reason=f"scaling efficiency {s:.2f} < {self.threshold}: undo "
                                       f"{back} -> {k}, no probing for {self.backoff} steps",
                                world_size=back, metrics=metrics, policy=self.name)
        if snap.step < self.resume_at or k + self.step > snap.max_workers:
            return None
        self.previous = {"k": float(k), "rate": rate}
        return Decision(reason=f"probe: {k} -> {k + self.step} workers at {rate:.0f} samples/s",
                        world_size=k + self.step, metrics={"throughput": rate},
                        policy=self.name)

    def on_resize(self, snap: MetricsSnapshot, *, old_size: int, new_size: int):
        self.window = []
        self.last_resize_step = snap.step
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {"previous": self.previous, "resume_at": self.resume_at,
                "last_resize_step": self.last_resize_step}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.previous = state["previous"]
        self.resume_at = int(state["resume_at"])
        self.last_resize_step = int(state["last_resize_step"])
