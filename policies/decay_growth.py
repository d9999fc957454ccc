"""``decay-growth``: the learning-rate schedule's decay turned into batch growth, while the batch
stays below the measured critical batch.

Smith et al. 2018: for SGD, multiplying the batch by k does what dividing the rate by k does,
in k times fewer steps. Seesaw (arXiv 2510.14717) makes it precise for Adam-style optimizers:
where a cosine rate halves, double the batch and multiply the rate by 1/sqrt(2) instead. Both
hold only below the critical batch (McCandlish et al. 2018: the gradient noise scale); beyond
it a larger batch wastes samples and the loss at a fixed sample budget suffers.

So, at every step, with c = (the user's scheduler's rate now) / (its peak so far):

* the schedule has halved h = floor(log2(1/c)) times since its peak; each halving not yet
  handled is handled once, in order;
* a halving becomes a doubling of the batch when the doubled batch is at most ``margin`` x the
  critical batch and at most ``max``; the rate rule (``--lr-rule linear`` for SGD, ``sqrt``
  for Adam) then scales the rate by 2 or sqrt(2), which on top of the scheduler's own halving
  gives Smith's constant rate or Seesaw's 1/sqrt(2). Otherwise that halving and every later
  one stay rate decay (the scheduler's, untouched), as Seesaw does past its largest batch:
  the critical batch was reached, and a reading late in the tail, where the weights settle,
  would grow the batch for the wrong reason (measured on the LM: a reading at c = 0.03 let a
  margin of 1.5 double 64 to 128 after the halving at c = 1/8 had been refused);
* the critical batch is the measured noise scale read at the schedule's peak rate:
  B_noise x c^``temperature-power``. A decaying rate lets the weights settle where the true
  gradient is small, so the raw noise scale rises as the rate falls (on the character-level LM,
  batch 32, AdamW: 44, 109, 195, 665 at cosine factors 0.54, 0.16, 0.04, 0 where a constant
  rate reads 40-65); scaled by sqrt(c) those read 32-44, the constant rate's level;
* no growth while the noise scale or its band is unknown (NaN, an open band): that halving
  stays a decay, and so do the later ones;
* only the first ``halvings`` halvings may grow the batch: a cosine's later ones come in its
  last few percent of samples (c = 1/32 at 91% of the budget), where a larger batch saves few
  steps and the noise scale reads the settling of the weights (measured on MNIST-1D: 3,505 at
  c = 0.002, against 96 at c = 0.25).

The defaults were chosen on the LM (one pass of 64k windows from batch 16, AdamW at 0.012,
tuning seeds 1000 and 1001 only; 5 runs, counted as the growth family's tuning): margin 1
stopped at batch 32 (0.76x the cosine's steps, final loss +0.004), 1.5 at 64 (0.68x; +0.008
and -0.013), 2 without the stop grew to 128 late (0.66x, +0.009). The temperature power 0.5
was fixed before, from the issue's 2-rank readings; one rank's readings at batch 16 fit 0.7
better in the tail (c < 1/4), where the stop above makes it matter little.

The scheduler must follow samples, not steps (``hpcadapt.ProgressLR``; the entry point's
``--lr-schedule`` does): a step-keyed one would stretch its decay as the batch grows."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from hpcadapt.base.errors import ConfigurationError

from .base import Decision, MetricsSnapshot, Param, Policy
from .params import non_negative_float, positive_float, positive_int
from .rate import PeakRate

__all__ = ["DecayGrowth"]


class DecayGrowth(Policy):
    name = "decay-growth"
    changes_batch = True
    params = (
        Param("max", positive_int, 4096, "largest global batch; later halvings stay rate decay"),
        Param("margin", positive_float, 1.5,
              "grow while the doubled batch is at most MARGIN x the critical batch"),
        Param("halvings", positive_int, 5,
              "only the schedule's first N halvings may become batch growth"),
        Param("temperature-power", non_negative_float, 0.5,
              "the critical batch is the noise scale x (rate / peak rate)^POWER (0: the raw "
              "noise scale)"),
    )
    requires = ("gns",)
    reads = ("batch_size", "schedule_lr")
    needs_rate_rule = ("linear", "sqrt")
    reads_schedule = True
    # A halving is decided on one reading: a memory of 4,096 samples (256 steps at batch 16)
    # is steady and still follows the noise scale's rise within a tenth of a pass of the LM.
    monitor_window = 4096

    def __init__(self, *, max: int = 4096, margin: float = 1.5, halvings: int = 5,
                 temperature_power: float = 0.5):
        if not margin > 0:
            raise ConfigurationError(f"--decay-growth-margin must be > 0, got {margin}")
        if temperature_power < 0:
            raise ConfigurationError(
                f"--decay-growth-temperature-power must be >= 0, got {temperature_power}")
        self.max, self.margin, self.power = max, margin, temperature_power
        self.halvings = halvings
        self.rates = PeakRate()  # the scheduler's highest rate so far
        self.handled = 0     # halvings of the schedule already turned into growth or kept
        self.grown = 0       # of those, the ones that became a doubling of the batch
        self.stopped = False  # a halving stayed a rate decay: so do all later ones

    def critical_batch(self, snap: MetricsSnapshot) -> float:
        """The noise scale at the schedule's peak rate; NaN while it cannot be told."""
        b, hi = snap.noise_scale, snap.noise_scale_hi
        if not (b > 0) or math.isnan(b) or not math.isfinite(hi):
            return math.nan
        c = self.rates.fraction(snap.schedule_lr)
        return b * min(1.0, max(1.0 if c is None else c, 0.0)) ** self.power

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        self.rates.follow(snap.schedule_lr)
        c = self.rates.fraction(snap.schedule_lr)
        if c is None:
            return None
        halvings = math.floor(math.log2(1.0 / c) + 1e-9) if c > 0 else 10**6
        if halvings <= self.handled:
            return None
        # One halving per step: the next one is due at the next step (a step apart is enough:
        # they are thousands of samples apart on any cosine but its very end).
        self.handled += 1
        if self.stopped:
            return None
        new = snap.batch_size * 2
        critical = self.critical_batch(snap)
        if self.handled > self.halvings or new > self.max or not (new <= self.margin * critical):
            self.stopped = True   # beyond the critical batch: the rest of the schedule decays
            return None
        return self.decision(
            f"rate halving {self.handled} (x{c:.3g} of its peak) becomes batch {new}: "
            f"critical batch {critical:.1f} (noise scale {snap.noise_scale:.1f})", snap,
            batch_size=new)

    def on_decision(self, decision: Decision, snap: MetricsSnapshot) -> None:
        if decision.policy == self.name and decision.batch_size is not None:
            self.grown += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"peak": self.rates.peak, "handled": self.handled, "grown": self.grown,
                "stopped": self.stopped}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.rates.peak = float(state["peak"])
        self.handled = int(state["handled"])
        self.grown = int(state.get("grown", 0))
        self.stopped = bool(state.get("stopped", False))
