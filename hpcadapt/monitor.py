"""In-step monitors: gradient noise scale, gradient variance and signal-to-noise ratio, and
per-rank timings, all computed from values that ride in the gradient buckets.

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

from .errors import ConfigurationError

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
    """Unbiased single-step estimates (not yet smoothed)."""

    grad_sq: float        # |G|^2, squared norm of the true gradient
    trace_sigma: float    # tr(Sigma), per-sample gradient covariance trace
    variance: float       # spread of replica gradients around their mean


def estimate_from_replicas(mean_local_sq: float, global_sq: float, n: int,
                           global_batch: int) -> NoiseEstimate:
    """The data-parallel estimator for n >= 2 replicas of equal share."""
    if n < 2:
        raise ConfigurationError("the replica estimator needs at least 2 replicas")
    grad_sq = (n * global_sq - mean_local_sq) / (n - 1)
    trace = global_batch * (mean_local_sq - global_sq) / (n - 1)
    return NoiseEstimate(grad_sq, trace, mean_local_sq - global_sq)


def estimate_from_consecutive(g_now: Sequence["torch.Tensor"], g_prev: Sequence["torch.Tensor"],
                              global_batch: int) -> NoiseEstimate:
    """The one-replica estimator from two consecutive steps' gradients."""
    import torch

    dot = sum(float(torch.dot(a, b)) for a, b in zip(g_now, g_prev))
    diff_sq = sum(float(torch.sum((a - b) ** 2)) for a, b in zip(g_now, g_prev))
    return NoiseEstimate(dot, global_batch * diff_sq / 2.0, diff_sq / 4.0)


class GradientNoiseScale:
    """Separate exponential moving averages of |G|^2 and tr(Sigma), and their ratio.

    Bias-corrected like Adam's moments, so early values are not pulled towards zero."""

    def __init__(self, ema: float = 0.1):
        self.ema = ema
        self._g = 0.0
        self._s = 0.0
        self._weight = 0.0
        self.last: Optional[NoiseEstimate] = None
        self.skipped = 0

    def update(self, est: NoiseEstimate) -> bool:
        """Fold in one estimate; a non-finite one is skipped (returns False)."""
        if not (math.isfinite(est.grad_sq) and math.isfinite(est.trace_sigma)):
            self.skipped += 1
            return False
        a = self.ema
        self._g = (1 - a) * self._g + a * est.grad_sq
        self._s = (1 - a) * self._s + a * est.trace_sigma
        self._weight = (1 - a) * self._weight + a
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
        return {"g": self._g, "s": self._s, "weight": self._weight, "ema": self.ema}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self._g, self._s = float(state["g"]), float(state["s"])
        self._weight, self.ema = float(state["weight"]), float(state["ema"])
