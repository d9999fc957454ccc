"""``gns-batch``: grow the global batch while the gradient noise scale exceeds it.

The rule of McCandlish et al. as KungFu applies it: the noise scale B_noise is the batch at
which gradient noise and signal balance; training below it wastes steps, so whenever
B_noise > batch, multiply the batch by ``factor`` (clipped to [min, max]), then wait
``cooldown`` steps for the estimate to settle at the new batch."""

from __future__ import annotations

from typing import Any, Dict, Optional

from hpcadapt.base.errors import ConfigurationError

from .base import Decision, MetricsSnapshot, Param, Policy
from .params import float_above, non_negative_int, positive_int

__all__ = ["GNSBatchSize"]


class GNSBatchSize(Policy):
    name = "gns-batch"
    params = (
        Param("min", positive_int, 16, "smallest global batch the policy sets"),
        Param("max", positive_int, 1024, "largest global batch the policy sets"),
        Param("factor", float_above(1.0), 2.0, "growth factor when the noise scale exceeds the batch"),
        Param("cooldown", non_negative_int, 30, "steps to wait after any batch change"),
        Param("interval", positive_int, 10, "monitor the noise scale and decide every N steps"),
        Param("warmup", non_negative_int, 20, "steps before the first decision (the estimate settles)"),
    )
    requires = ("gns",)
    reads = ("noise_scale", "batch_size", "grad_sq", "trace_sigma")

    def __init__(self, *, min: int = 16, max: int = 1024, factor: float = 2.0,
                 cooldown: int = 30, interval: int = 10, warmup: int = 20):
        if min > max:
            raise ConfigurationError(
                f"--gns-batch-min ({min}) must not exceed --gns-batch-max ({max})")
        if not factor > 1.0:
            raise ConfigurationError(f"--gns-batch-factor must be > 1, got {factor}")
        self.min, self.max, self.factor = min, max, factor
        self.cooldown, self.interval, self.warmup = cooldown, interval, warmup
        self.last_change = -10**9

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        if snap.step < self.warmup or snap.step - self.last_change < self.cooldown:
            return None
        batch = snap.batch_size
        if batch < self.min:
            return self.decision(f"batch {batch} is below --gns-batch-min", snap,
                                 batch_size=self.min)
        if snap.noise_scale > batch and batch < self.max:
            new = int(min(self.max, max(batch + 1, round(batch * self.factor))))
            return self.decision(
                f"noise scale {snap.noise_scale:.1f} exceeds batch {batch}: grow x{self.factor:g}",
                snap, batch_size=new)
        return None

    def on_decision(self, decision: Decision, snap: MetricsSnapshot) -> None:
        if decision.batch_size is not None:
            self.last_change = snap.step

    def state_dict(self) -> Dict[str, Any]:
        return {"last_change": self.last_change}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.last_change = int(state["last_change"])
