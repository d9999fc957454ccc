"""``gns-batch``: grow the global batch to the critical batch the gradient noise scale supports.

McCandlish et al. 2018: the noise scale B_noise = tr(Sigma) / |G|^2 is the batch at which the
gradient's noise and signal balance; below it a step wastes little data and many steps, above
it many samples. Training at B_noise spends about twice the fewest steps and twice the fewest
samples, and B_noise rises as the loss falls, so the batch should rise with it (Merrill et al.
2025 warm the batch up that way).

The decision, every ``interval`` steps after ``warmup`` steps and both cooldowns:

* the estimate is taken at a one-sided lower bound, ``confidence`` sure: the noise scale's
  band (MetricsSnapshot.noise_scale_lo/hi, from the monitor's spread) gives its log-normal
  error; no decision while that error cannot be told yet (an infinite band);
* the target is ``fraction`` x that bound; the batch jumps straight there (not x2 per
  decision), by at most ``factor`` at once, within [min, max], rounded down to a multiple of
  the world size so that every rank's share is equal;
* a change smaller than ``min-growth`` is not worth the disturbance (Pollux re-optimises only
  for a gain of more than 5%; a batch change also restarts the rate's ramp); the batch never
  shrinks.

Under a decaying learning-rate schedule the raw noise scale rises because the rate falls (the
weights settle where the true gradient is small), not because a larger batch would help: on
the character-level LM it rose 15x in a cosine's tail. The decision reads it at the
schedule's peak rate, B_noise x (rate / peak rate)^``temperature-power`` (the user's scheduler's
rate, ``MetricsSnapshot.schedule_lr``; 0.5 brings the cosine's tail back to the constant
rate's level there), so the tail grows nothing.

Cooldowns count samples (``cooldown-samples``) as well as steps: the monitor's memory is in
samples, so after a change the estimate has seen new data only after so many samples, at any
batch."""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any, Dict, Optional

from hpcadapt.base.errors import ConfigurationError

from .base import Decision, MetricsSnapshot, Param, Policy
from .params import (float_above, non_negative_float, non_negative_int, positive_float,
                     positive_int)
from .rate import PeakRate

__all__ = ["GNSBatchSize"]

# The monitor's band is 95% two-sided (hpcadapt.adapt.monitors.GradientNoiseScale.interval).
_BAND_Z = 1.959963984540054


def _confidence(text: str) -> float:
    v = float(text) if text.strip() else math.nan
    if not 0.5 <= v < 1.0:
        raise ValueError(f"must be in [0.5, 1), got {text}")
    return v


class GNSBatchSize(Policy):
    name = "gns-batch"
    changes_batch = True
    params = (
        Param("min", positive_int, 16, "smallest global batch the policy sets"),
        Param("max", positive_int, 1024, "largest global batch the policy sets"),
        Param("factor", float_above(1.0), 4.0, "largest growth of the batch in one decision"),
        Param("min-growth", float_above(1.0), 1.25,
              "smallest growth worth a change (the batch never shrinks)"),
        Param("fraction", positive_float, 1.0,
              "target batch as a fraction of the noise scale's lower bound"),
        Param("confidence", _confidence, 0.8,
              "how sure the lower bound of the noise scale is (one-sided, 0.5: the estimate)"),
        Param("cooldown", non_negative_int, 0, "steps to wait after any batch change"),
        Param("cooldown-samples", non_negative_int, 2048,
              "samples to wait after any batch change"),
        Param("interval", positive_int, 1, "monitor the noise scale and decide every N steps"),
        Param("warmup", non_negative_int, 20, "steps before the first decision"),
        Param("temperature-power", non_negative_float, 0.5,
              "read the noise scale at the schedule's peak rate: x (rate / peak)^POWER "
              "(0: the raw noise scale)"),
    )
    requires = ("gns",)
    reads = ("noise_scale", "batch_size", "grad_sq", "trace_sigma")

    def __init__(self, *, min: int = 16, max: int = 1024, factor: float = 4.0,
                 min_growth: float = 1.25, fraction: float = 1.0, confidence: float = 0.8,
                 cooldown: int = 0, cooldown_samples: int = 2048, interval: int = 1,
                 warmup: int = 20, temperature_power: float = 0.5):
        if min > max:
            raise ConfigurationError(
                f"--gns-batch-min ({min}) must not exceed --gns-batch-max ({max})")
        if not factor > 1.0:
            raise ConfigurationError(f"--gns-batch-factor must be > 1, got {factor}")
        if not min_growth > 1.0:
            raise ConfigurationError(f"--gns-batch-min-growth must be > 1, got {min_growth}")
        if not 0.5 <= confidence < 1.0:
            raise ConfigurationError(f"--gns-batch-confidence must be in [0.5, 1), got {confidence}")
        self.min, self.max, self.factor = min, max, factor
        self.min_growth, self.fraction = min_growth, fraction
        self.z = NormalDist().inv_cdf(confidence)
        self.cooldown, self.cooldown_samples = cooldown, cooldown_samples
        self.interval, self.warmup = interval, warmup
        self.power = temperature_power
        self.rates = PeakRate()   # the user's scheduler's highest rate so far
        self.last_change = -10**9
        self.last_change_samples = -10**18

    def lower_bound(self, snap: MetricsSnapshot) -> float:
        """The noise scale at the one-sided lower bound: the estimate itself where the
        snapshot carries no band (NaN), 0 while its error cannot be told (an infinite band)."""
        lo, hi = snap.noise_scale_lo, snap.noise_scale_hi
        at_peak = snap.noise_scale * self.schedule_factor(snap) ** self.power
        if math.isnan(lo) or math.isnan(hi):
            return at_peak
        if not (lo > 0 and math.isfinite(hi)):
            return 0.0
        sigma = math.log(hi / lo) / (2 * _BAND_Z)
        return at_peak * math.exp(-self.z * sigma)

    def schedule_factor(self, snap: MetricsSnapshot) -> float:
        """The user's scheduler's rate now over its peak so far (1 where it is not known)."""
        rate = snap.schedule_lr
        if not rate > 0:
            return 1.0
        self.rates.follow(rate)
        c = self.rates.fraction(rate)
        return 1.0 if c is None else c

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        self.schedule_factor(snap)   # the peak is followed at every step, deciding or not
        if snap.step < self.warmup or snap.step - self.last_change < self.cooldown \
                or snap.samples_seen - self.last_change_samples < self.cooldown_samples:
            return None
        batch = snap.batch_size
        if batch < self.min:
            return self.decision(f"batch {batch} is below --gns-batch-min", snap,
                                 batch_size=self.min)
        if batch >= self.max:
            return None
        bound = self.lower_bound(snap)
        target = min(float(self.max), batch * self.factor, self.fraction * bound)
        step = max(1, snap.world_size)
        new = int(target // step * step) if target < self.max else self.max
        if new <= batch or (new < batch * self.min_growth and new < self.max):
            return None
        return self.decision(
            f"noise scale {snap.noise_scale:.1f} (at the peak rate, lower bound {bound:.1f}) "
            f"supports batch {new} over {batch}", snap, batch_size=new)

    def on_decision(self, decision: Decision, snap: MetricsSnapshot) -> None:
        if decision.batch_size is not None:
            self.last_change = snap.step
            self.last_change_samples = snap.samples_seen

    def state_dict(self) -> Dict[str, Any]:
        return {"last_change": self.last_change,
                "last_change_samples": self.last_change_samples, "peak_rate": self.rates.peak}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.last_change = int(state["last_change"])
        self.last_change_samples = int(state.get("last_change_samples", -10**18))
        self.rates.peak = float(state.get("peak_rate", 0.0))
