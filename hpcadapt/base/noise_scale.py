"""The gradient noise scale's arithmetic, pure (no torch, no MPI): the data-parallel
estimator of one step's |G|^2 and tr(Sigma), and their smoothed ratio with its error.

Data-parallel estimator (McCandlish et al. 2018, appendix A), n replicas, local batch b,
global batch B = n*b, |g_i|^2 the local and |g|^2 the averaged gradient's squared norm:

    |G|^2  ~ (n |g|^2 - mean_i |g_i|^2) / (n - 1)
    tr(S)  ~ B (mean_i |g_i|^2 - |g|^2) / (n - 1)         (tr of the per-sample covariance)
    B_noise = EMA(tr S) / EMA(|G|^2)

The job's monitor (hpcadapt.adapt.monitors) feeds it from each step's reduction; the policy
simulator (hpcadapt.policies.simulate) feeds it drawn estimates: one arithmetic for both."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from hpcadapt.base.errors import ConfigurationError

__all__ = ["NoiseEstimate", "GradientNoiseScale", "estimate_from_replicas", "MIN_WINDOW_STEPS"]

# The shortest memory, in steps at the current batch: a window of fewer samples would leave
# about one estimate in the averages (no spread to tell their error by, a band of (0, inf)),
# so a window shorter than this many batches grows with the batch.
MIN_WINDOW_STEPS = 16

# A band wider than e^50 either way is no band: (0, inf), as before the error is known.
_MAX_LOG_BAND = 50.0


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


class GradientNoiseScale:
    """Separate bias-corrected moving averages of |G|^2 and tr(Sigma), their ratio, and how
    sure that ratio is.

    The memory is measured in samples, not steps (AdaptDL's convention): an estimate from a
    batch of B samples keeps a weight of exp(-B / window) for the old average, so a step of
    twice the samples counts as two, and a noise scale that rises linearly is followed with a
    lag of one ``window`` of samples whatever the batch. ``window`` 0 derives it from ``ema``
    at the first estimate's batch B0 (the weight of the newest estimate there:
    window = B0 / -ln(1 - ema)). Bias-corrected like Adam's moments, so early values are not
    pulled towards zero. A window shorter than ``MIN_WINDOW_STEPS`` batches is stretched to
    that many at the current batch (else one estimate would dominate).

    The uncertainty: the same weights average the estimates' squares and cross product, so
    the spread of the per-step estimates and their covariance are known; divided by Kish's
    effective number of estimates ((sum w)^2 / sum w^2) they give the variance of each
    average, and the delta method gives the ratio's relative standard error. ``interval(z)``
    is the noise scale's band at z standard errors, symmetric in log space (a ratio of
    positive averages). It takes the per-step estimates as independent, which they are up to
    the slow drift of the weights within the window."""

    def __init__(self, ema: float = 0.1, window: float = 0.0):
        self.ema = ema
        self.window = float(window)
        self._g = self._s = 0.0            # weighted sums of the estimates
        self._gg = self._ss = self._gs = 0.0  # ... of their squares and product
        self._weight = self._weight_sq = 0.0
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
        if self.window <= 0:
            self.window = self._base_batch / -math.log1p(-self.ema) if self.ema < 1 else 1e-9
        batch = batch or self._base_batch
        keep = math.exp(-batch / max(self.window, MIN_WINDOW_STEPS * batch))
        new = 1.0 - keep
        g, s = est.grad_sq, est.trace_sigma
        self._g = keep * self._g + new * g
        self._s = keep * self._s + new * s
        self._gg = keep * self._gg + new * g * g
        self._ss = keep * self._ss + new * s * s
        self._gs = keep * self._gs + new * g * s
        self._weight = keep * self._weight + new
        self._weight_sq = keep * keep * self._weight_sq + new * new
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

    @property
    def effective_count(self) -> float:
        """Kish's effective number of estimates behind the averages."""
        return self._weight ** 2 / self._weight_sq if self._weight_sq else 0.0

    @property
    def relative_error(self) -> float:
        """The noise scale's relative standard error (delta method); inf while it cannot be
        told (fewer than two effective estimates, no positive signal)."""
        n, w = self.effective_count, self._weight
        g, s = self.grad_sq, self.trace_sigma
        if n < 2 or not (g > 0 and s > 0):
            return math.inf
        var_g = max(self._gg / w - g * g, 0.0) / n
        var_s = max(self._ss / w - s * s, 0.0) / n
        cov = (self._gs / w - g * s) / n
        rel = var_s / (s * s) + var_g / (g * g) - 2.0 * cov / (s * g)
        return math.sqrt(max(rel, 0.0))

    def interval(self, z: float = 1.96) -> Tuple[float, float]:
        """(low, high): the noise scale's band at ``z`` standard errors; (NaN, NaN) before
        there is a noise scale, (0, inf) while its error cannot be told."""
        b = self.noise_scale
        if not math.isfinite(b):
            return float("nan"), float("nan")
        rel = self.relative_error
        if not math.isfinite(rel) or z * rel > _MAX_LOG_BAND:
            return 0.0, math.inf   # an error that large says nothing (and exp would overflow)
        return b * math.exp(-z * rel), b * math.exp(z * rel)

    def snr(self, global_batch: int) -> float:
        """|G|^2 / (tr(Sigma) / B): how far the batch gradient's signal stands above its noise."""
        s = self.trace_sigma
        if not (s > 0):
            return float("nan")
        return self.grad_sq / (s / global_batch)

    def state_dict(self) -> Dict[str, float]:
        return {"g": self._g, "s": self._s, "gg": self._gg, "ss": self._ss, "gs": self._gs,
                "weight": self._weight, "weight_sq": self._weight_sq, "ema": self.ema,
                "window": self.window, "base_batch": self._base_batch}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self._g, self._s = float(state["g"]), float(state["s"])
        self._weight, self.ema = float(state["weight"]), float(state["ema"])
        self._base_batch = int(state.get("base_batch", 0))
        # Written before the uncertainty was kept: the band starts anew (inf until known).
        self._gg, self._ss = float(state.get("gg", 0.0)), float(state.get("ss", 0.0))
        self._gs, self._weight_sq = float(state.get("gs", 0.0)), float(state.get("weight_sq", 0.0))
        self.window = float(state.get("window", self.window))
