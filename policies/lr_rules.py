"""Learning-rate rules applied whenever the global batch changes, and the ramp that carries
the learning rate (and with it the momentum's step size) to its new value.

* ``linear`` (Goyal et al.): lr = base_lr * B / B0
* ``sqrt`` (Krizhevsky; Hoffer et al.): lr = base_lr * sqrt(B / B0)
* ``adascale`` (Johnson et al.): lr = base_lr * r, with the gain ratio
  r = (s2 + m2) / (s2 / S + m2), S = B / B0, s2 = tr(Sigma) / B0, m2 = |G|^2 from the
  noise-scale monitor; it is re-evaluated every monitoring interval, not only on changes.
* ``none``: the learning rate stays.

The ramp (Lin et al. 2019, momentum compensation): after a change at step t0 that scales the
learning rate by k, the rate used at step t is lr_old * gamma_t with
gamma_t = 1 + (t - t0) / T * (k - 1) for t - t0 < T, else k. SGD's momentum buffer in PyTorch's
form (u = mu u + g; p -= lr u) then carries the old velocity into the new step size smoothly
instead of at once. With T = 0 the change is immediate (and the linear rule has no warm-up)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .base import Decision, MetricsSnapshot, Param
from .params import choice, non_negative_int

__all__ = ["LRRule", "Ramp", "LR_RULES", "RULE_PARAMS"]

LR_RULES = ("none", "linear", "sqrt", "adascale")

RULE_PARAMS = (
    Param("lr-rule", choice(LR_RULES), "none",
          "how the learning rate follows the batch size: none, linear, sqrt, adascale"),
    Param("lr-ramp-steps", non_negative_int, 8,
          "steps over which the learning rate moves to its new value after a batch change "
          "(warm-up and Lin et al.'s momentum compensation; 0: at once)"),
)


@dataclass(frozen=True)
class Ramp:
    """A linear move of the learning rate from ``start_lr`` to ``end_lr`` over steps
    [start_step, start_step + steps); every rank evaluates it locally."""

    start_step: int
    steps: int
    start_lr: float
    end_lr: float

    def lr_at(self, step: int) -> float:
        if self.steps <= 0 or step - self.start_step >= self.steps:
            return self.end_lr
        k = self.end_lr / self.start_lr
        gamma = 1.0 + max(0, step - self.start_step) / self.steps * (k - 1.0)
        return self.start_lr * gamma

    def done(self, step: int) -> bool:
        return step - self.start_step >= self.steps


class LRRule:
    """Turns a batch change into a learning-rate target and a ramp to it."""

    def __init__(self, rule: str = "none", ramp_steps: int = 8):
        choice(LR_RULES)(rule)
        self.rule = rule
        self.ramp_steps = ramp_steps

    def target(self, snap: MetricsSnapshot, batch: int) -> Optional[float]:
        """The learning rate this rule wants at global batch ``batch``; None: no opinion."""
        scale = batch / snap.base_batch_size
        if self.rule == "linear":
            return snap.base_lr * scale
        if self.rule == "sqrt":
            return snap.base_lr * math.sqrt(scale)
        if self.rule == "adascale":
            m2, s2 = snap.grad_sq, snap.trace_sigma / snap.base_batch_size
            if not (math.isfinite(m2) and math.isfinite(s2)) or s2 <= 0:
                # No usable noise estimate yet: the conservative bound r = 1.
                return snap.base_lr
            # |G|^2 clipped at 0 (AdaptDL): no measurable signal means every sample counts,
            # r = S.
            m2 = max(m2, 0.0)
            gain = (s2 + m2) / (s2 / scale + m2)
            return snap.base_lr * gain
        return None

    def on_change(self, snap: MetricsSnapshot, new_batch: int) -> Optional[Decision]:
        lr = self.target(snap, new_batch)
        if lr is None or math.isclose(lr, snap.lr, rel_tol=1e-9):
            return None
        return Decision(reason=f"{self.rule} rule for batch {snap.batch_size} -> {new_batch}"
                               f" (ramp over {self.ramp_steps} steps)",
                        lr=lr, policy=f"lr-rule:{self.rule}",
                        metrics={"base_lr": snap.base_lr, "base_batch_size": snap.base_batch_size,
                                 "grad_sq": snap.grad_sq, "trace_sigma": snap.trace_sigma})

    def on_monitor(self, snap: MetricsSnapshot) -> Optional[Decision]:
        """AdaScale follows the gain ratio as the estimates move (changes above 2%)."""
        if self.rule != "adascale" or not snap.monitored:
            return None
        lr = self.target(snap, snap.batch_size)
        if lr is None or abs(lr - snap.lr) <= 0.02 * snap.lr:
            return None
        return Decision(reason=f"adascale gain {lr / snap.base_lr:.3f} at batch {snap.batch_size}",
                        lr=lr, policy="lr-rule:adascale",
                        metrics={"grad_sq": snap.grad_sq, "trace_sigma": snap.trace_sigma})
