"""In-step monitors: gradient noise scale, gradient variance and signal-to-noise ratio, and
per-rank timings, all computed from values that travel in the step's control reduction.

Data-parallel estimator (McCandlish et al. 2018, appendix A), n replicas, local batch b,
global batch B = n*b, |g_i|^2 the local and |g|^2 the averaged gradient's squared norm:

    |G|^2  ~ (n |g|^2 - mean_i |g_i|^2) / (n - 1)
    tr(S)  ~ B (mean_i |g_i|^2 - |g|^2) / (n - 1)         (tr of the per-sample covariance)
    B_noise = EMA(tr S) / EMA(|G|^2)

With one replica the step's batch is trained as two accumulation passes, and the passes are
the replicas (``SplitStep``): the same formulas with n = passes and each pass's share.

Gradient variance is the spread of the replicas' gradients around their mean,
mean_i |g_i - g|^2 = mean_i |g_i|^2 - |g|^2 (an identity, so it costs nothing beyond the
noise scale), and the signal-to-noise ratio of the global gradient is |G|^2 / (tr(S) / B).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

if TYPE_CHECKING:  # torch loads with the training, not with the flags (see hpcadapt.args)
    import torch

from hpcadapt.base.errors import ConfigurationError
# The pure arithmetic lives below the layers that use it (the policy simulator too).
from hpcadapt.base.noise_scale import GradientNoiseScale, NoiseEstimate, estimate_from_replicas

__all__ = ["MonitorConfig", "GradientNoiseScale", "NoiseEstimate", "estimate_from_replicas",
           "SplitStep", "MONITORS"]

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


class SplitStep:
    """One replica's noise scale from inside the step. At world size 1 the step's batch is
    trained as two (or more) accumulation passes (``StepRunner.micro_cap``); each pass's
    gradient is the difference of the accumulated gradient before and after it, so the passes
    are the replicas of the data-parallel estimator, on the same weights (comparing two
    consecutive steps instead counts the gradient's drift between them as noise: measured
    1.8-8x high). The squared norms stay on the device until the step's end: one transfer
    per monitored step."""

    def __init__(self) -> None:
        self._prev: Optional[List["torch.Tensor"]] = None  # the accumulation after the last pass
        self._weighted: Optional["torch.Tensor"] = None    # sum_j |w_j g_j|^2 / w_j so far
        self.parts = 0

    def reset(self) -> None:
        """A new step: nothing accumulated (the buffers are kept for the next one)."""
        self._weighted = None
        self.parts = 0

    def _pass_sq(self, grads: Sequence["torch.Tensor"]) -> "torch.Tensor":
        """|this pass's gradient contribution|^2, and remember the accumulation."""
        import torch

        if self.parts == 0:
            sq = _sum_sq(grads)
        else:
            sq = _sum_sq(torch._foreach_sub(list(grads), self._prev))
        if self._prev is None or len(self._prev) != len(grads) or any(
                a.shape != b.shape or a.device != b.device for a, b in zip(self._prev, grads)):
            self._prev = [g.detach().clone() for g in grads]
        else:
            torch._foreach_copy_(self._prev, list(grads))
        return sq

    def add(self, grads: Sequence["torch.Tensor"], share: float) -> None:
        """After a pass that is not the step's last: ``grads`` hold the accumulated gradient
        (sum_j w_j g_j over the passes so far), ``share`` = w_i, the pass's samples / the
        step's."""
        sq = self._pass_sq(grads) / share
        self._weighted = sq if self._weighted is None else self._weighted + sq
        self.parts += 1

    def finish(self, grads: Sequence["torch.Tensor"], share: float) -> Tuple[float, float, int]:
        """After the last pass (``grads``: the step's gradient g = sum_i w_i g_i):
        (sum_i w_i |g_i|^2, |g|^2, passes), ready for ``estimate_from_replicas``; passes < 2
        (a batch of one sample, a short last batch): no estimate this step."""
        if self.parts == 0:
            return float("nan"), float("nan"), 1
        last = self._pass_sq(grads) / share
        weighted, global_sq = _to_host(self._weighted + last, _sum_sq(grads))
        self.parts += 1
        parts, self._weighted = self.parts, None
        return weighted, global_sq, parts


def _sum_sq(tensors: Sequence["torch.Tensor"]) -> "torch.Tensor":
    """sum of squared norms, on the tensors' device, in float64."""
    import torch

    norms = torch._foreach_norm(list(tensors))
    return torch.stack([n.double() for n in norms]).square().sum()


def _to_host(a: "torch.Tensor", b: "torch.Tensor") -> Tuple[float, float]:
    """Two device scalars to the host in one transfer."""
    import torch

    out = torch.stack((a, b)).cpu().tolist()
    return float(out[0]), float(out[1])
