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

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence

if TYPE_CHECKING:  # torch loads with the training, not with the flags (see hpcadapt.args)
    import torch

from hpcadapt.base.errors import ConfigurationError
# The pure arithmetic lives below the layers that use it (the policy simulator too).
from hpcadapt.base.noise_scale import GradientNoiseScale, NoiseEstimate, estimate_from_replicas

__all__ = ["MonitorConfig", "GradientNoiseScale", "NoiseEstimate", "estimate_from_replicas",
           "estimate_from_consecutive", "PreviousGradient", "MONITORS"]

MONITORS = ("gns", "variance")


@dataclass(frozen=True)
class MonitorConfig:
    """Which gradient monitors run, how often (every ``interval`` steps), and the moving
    averages' memory: ``window`` samples, or (0) the EMA weight ``ema`` of the newest
    estimate at the first batch."""

    monitors: Sequence[str] = ()
    interval: int = 1
    ema: float = 0.1
    window: int = 0   # samples; 0: from ``ema`` at the first batch

    def __post_init__(self) -> None:
        unknown = [m for m in self.monitors if m not in MONITORS]
        if unknown:
            raise ConfigurationError(f"unknown monitor {unknown[0]!r}; choose from {list(MONITORS)}")
        if self.interval < 1:
            raise ConfigurationError(f"--monitor-interval must be at least 1, got {self.interval}")
        if not 0 < self.ema <= 1:
            raise ConfigurationError(f"--monitor-ema must be in (0, 1], got {self.ema}")
        if self.window < 0:
            raise ConfigurationError(f"--monitor-window must be 0 or more samples, got {self.window}")

    @property
    def enabled(self) -> bool:
        return bool(self.monitors)


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


class PreviousGradient:
    """One replica has no second gradient of the same step: the last step's gradient stands
    in for it (``estimate_from_consecutive``). Kept only when the next step is monitored,
    forgotten whenever the next step's gradient would not be comparable (a skipped or
    overflowed update, a resize, a second replica)."""

    def __init__(self) -> None:
        self._grads: Optional[List["torch.Tensor"]] = None
        self._batch = 0   # the global batch the kept gradient was computed on

    def keep(self, grads: Sequence["torch.Tensor"], batch: int) -> None:
        if self._grads is None or len(self._grads) != len(grads):
            self._grads = [g.clone() for g in grads]
        else:
            for dst, src in zip(self._grads, grads):
                dst.copy_(src)
        self._batch = batch

    def forget(self) -> None:
        self._grads = None

    def estimate(self, grads: Sequence["torch.Tensor"], batch: int) -> Optional[NoiseEstimate]:
        """The estimate from this step's gradient and the kept one (None: none kept)."""
        if self._grads is None:
            return None
        return estimate_from_consecutive(grads, self._grads, batch, self._batch)
