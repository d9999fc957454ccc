"""In-step monitors: gradient noise scale, gradient variance and signal-to-noise ratio, and
per-rank timings, all computed from values that travel in the step's control reduction.

Data-parallel estimator (McCandlish et al. 2018, appendix A), n replicas, local batch b,
global batch B = n*b, |g_i|^2 the local and |g|^2 the averaged gradient's squared norm:

    |G|^2  ~ (n |g|^2 - mean_i |g_i|^2) / (n - 1)
    tr(S)  ~ B (mean_i |g_i|^2 - |g|^2) / (n - 1)         (tr of the per-sample covariance)
    B_noise = EMA(tr S) / EMA(|G|^2)

With one replica there is no second gradient of the same step, so the two most recent steps
stand in for two replicas of batch B (their parameters differ by one small update):

    |G|^2 ~ g_t . g_{t-1}        tr(S) ~ (B / 2) |g_t - g_{t-1}|^2

Gradient variance is the spread of the replicas' gradients around their mean,
mean_i |g_i - g|^2 = mean_i |g_i|^2 - |g|^2 (an identity, so it costs nothing beyond the
noise scale), and the signal-to-noise ratio of the global gradient is |G|^2 / (tr(S) / B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Sequence

if TYPE_CHECKING:  # torch loads with the training, not with the flags (see hpcadapt.args)
    import torch

from hpcadapt.base.errors import ConfigurationError

__all__ = ["MonitorConfig", "GradientNoiseScale", "NoiseEstimate", "estimate_from_replicas",
           "estimate_from_consecutive", "MONITORS"]

MONITORS = ("gns", "variance")


@dataclass(frozen=True)
class MonitorConfig:
    """Which gradient monitors run, how often (every ``interval`` steps), and the EMA weight
    of the newest estimate."""

    monitors: Sequence[str] = ()
    interval: int = 1
    ema: float = 0.1

    def __post_init__(self) -> None:
        unknown = [m for m in self.monitors if m not in MONITORS]
        if unknown:
            raise ConfigurationError(f"unknown monitor {unknown[0]!r}; choose from {list(MONITORS)}")
        if self.interval < 1:
            raise ConfigurationError(f"--monitor-interval must be at least 1, got {self.interval}")
        if not 0 < self.ema <= 1:
            raise ConfigurationError(f"--monitor-ema must be in (0, 1], got {self.ema}")

    @property
    def enabled(self) -> bool:
        return bool(self.monitors)


@dataclass(frozen=True)
class NoiseEstimate:
    """Unbiased single-step estimates (not yet smoothed).

    ``grad_sq``: |G|^2, the squared norm of the true (expected) gradient. ``trace_sigma``:
    tr(Sigma), the trace of the per-sample gradient covariance (per sample, independent of the
    batch size). ``variance``: tr(Sigma)/B, the expected |g_B - G|^2 of the global batch's
    gradient at this step's global batch B: the same quantity at every world size."""

    grad_sq: float
    trace_sigma: float
    variance: float


def estimate_from_replicas(weighted_local_sq: float, global_sq: float, replicas: int,
                           global_batch: int) -> NoiseEstimate:
    """The data-parallel estimator from one step's allreduce.

    ``weighted_local_sq`` is sum_i w_i |g_i|^2 with w_i = b_i/B, each replica's share of the
    global batch B (as the optimizer computes it); ``global_sq`` is |g|^2 of the averaged
    gradient g = sum_i w_i g_i; ``replicas`` counts the ranks with a non-empty share. Then
    E[sum_i w_i |g_i|^2] = |G|^2 + n tr(S)/B and E|g|^2 = |G|^2 + tr(S)/B for any shares, so
    tr(S) = B (m - |g|^2)/(n - 1) and |G|^2 = (n |g|^2 - m)/(n - 1) (McCandlish et al.)."""
    if replicas < 2:
        raise ConfigurationError("the replica estimator needs at least 2 replicas with samples")
    n, m = replicas, weighted_local_sq
    trace = global_batch * (m - global_sq) / (n - 1)
    return NoiseEstimate((n * global_sq - m) / (n - 1), trace, trace / global_batch)


def estimate_from_consecutive(g_now: Sequence["torch.Tensor"], g_prev: Sequence["torch.Tensor"],
                              batch_now: int, batch_prev: int) -> NoiseEstimate:
    """The one-replica estimator from two consecutive steps' gradients (independent batches
    of ``batch_now`` and ``batch_prev`` samples at nearly the same weights): E[g_t . g_{t-1}]
    = |G|^2 and E|g_t - g_{t-1}|^2 = tr(S) (1/B_t + 1/B_{t-1}), unbiased also when the batch
    size changed between the two (the short last batch of an epoch, a policy's change)."""
    import torch

    dot = sum(float(torch.dot(a, b)) for a, b in zip(g_now, g_prev))
    diff_sq = sum(float(torch.sum((a - b) ** 2)) for a, b in zip(g_now, g_prev))
    trace = diff_sq / (1.0 / batch_now + 1.0 / batch_prev)
    return NoiseEstimate(dot, trace, trace / batch_now)


class GradientNoiseScale:
    """Separate moving averages of |G|^2 and tr(Sigma), and their ratio.

    Smoothing scales with the batch (AdaptDL's convention): an estimate from a batch of B
    samples keeps a weight of (1 - ema)^(B/B0) for the old average, B0 being the batch of the
    first estimate, so a step of twice the samples counts as two. Bias-corrected like Adam's
    moments, so early values are not pulled towards zero."""

    def __init__(self, ema: float = 0.1):
        self.ema = ema
        self._g = 0.0
        self._s = 0.0
        self._weight = 0.0
        self._base_batch = 0
        self.last: Optional[NoiseEstimate] = None
        self.skipped = 0

    def update(self, est: NoiseEstimate, batch: int = 0) -> bool:
        """Fold in one estimate from a global batch of ``batch`` samples (0: the first
        one's); a non-finite one is skipped (returns False)."""
        if not (math.isfinite(est.grad_sq) and math.isfinite(est.trace_sigma)):
            self.skipped += 1
            return False
        if not self._base_batch:
            self._base_batch = batch or 1
        keep = (1.0 - self.ema) ** ((batch or self._base_batch) / self._base_batch)
        self._g = keep * self._g + (1 - keep) * est.grad_sq
        self._s = keep * self._s + (1 - keep) * est.trace_sigma
        self._weight = keep * self._weight + (1 - keep)
        self.last = est
        return True

    @property
    def grad_sq(self) -> float:
        return self._g / self._weight if self._weight else float("nan")

    @property
    def trace_sigma(self) -> float:
        return self._s / self._weight if self._weight else float("nan")

    @property
    def noise_scale(self) -> float:
        """B_noise = tr(Sigma) / |G|^2; NaN until the signal estimate is positive."""
        g = self.grad_sq
        if not (g > 0) or not math.isfinite(self.trace_sigma):
            return float("nan")
        return max(self.trace_sigma, 0.0) / g

    def snr(self, global_batch: int) -> float:
        """|G|^2 / (tr(Sigma) / B): how far the batch gradient's signal stands above its noise."""
        s = self.trace_sigma
        if not (s > 0):
            return float("nan")
        return self.grad_sq / (s / global_batch)

    def state_dict(self) -> Dict[str, float]:
        return {"g": self._g, "s": self._s, "weight": self._weight, "ema": self.ema,
                "base_batch": self._base_batch}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self._g, self._s = float(state["g"]), float(state["s"])
        self._weight, self.ema = float(state["weight"]), float(state["ema"])
        self._base_batch = int(state.get("base_batch", 0))
