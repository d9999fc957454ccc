"""``seesaw``: a cosine learning-rate decay turned into batch growth (Smith et al. 2018; Seesaw,
arXiv 2510.14717).

Smith et al.: multiplying the batch by k does what dividing the rate by k does, with k times
fewer steps. Seesaw makes it precise for a cosine schedule over a budget of N samples: at each
point where the cosine factor c(s) = (1 + cos(pi s / N)) / 2 has halved again
(c = 1/2, 1/4, 1/8, ...: s_k = N arccos(2^(1-k) - 1) / pi), the batch doubles and the rate is
multiplied by ``lr-factor`` (1/sqrt(2) in Seesaw: the square-root rule's 2^(1/2) up, times the
cosine's 1/2 down). Once the batch is at ``max``, a halving is applied to the rate alone (x1/2),
so the run ends on the cosine's rates. Run it instead of a cosine scheduler of your own, with
``--lr-rule none`` (the policy sets the rate itself)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from hpcadapt.base.errors import ConfigurationError

from .base import Decision, MetricsSnapshot, Param, Policy
from .params import non_negative_int, positive_float, positive_int
from .rate import RateTracker

__all__ = ["Seesaw", "halving_points"]


def halving_points(samples: int, count: int = 30) -> List[int]:
    """The samples at which the cosine over ``samples`` has halved 1, 2, ... times."""
    points = []
    for k in range(1, count + 1):
        s = int(math.ceil(samples * math.acos(2.0 ** (1 - k) - 1.0) / math.pi))
        if points and s <= points[-1]:
            break
        points.append(s)
    return points


class Seesaw(Policy):
    name = "seesaw"
    changes_batch = True
    params = (
        Param("samples", non_negative_int, 0, "the training budget in samples the cosine spans"),
        Param("max", positive_int, 4096, "largest global batch; later halvings go to the rate"),
        Param("lr-factor", positive_float, 1 / math.sqrt(2),
              "rate factor at each doubling of the batch (Seesaw: 1/sqrt(2))"),
    )
    reads = ("batch_size",)

    def __init__(self, *, samples: int = 0, max: int = 4096, lr_factor: float = 1 / math.sqrt(2)):
        if samples <= 0:
            raise ConfigurationError("--policy seesaw needs --seesaw-samples: the training "
                                     "budget in samples (e.g. epochs x dataset size)")
        self.points = halving_points(samples)
        self.max, self.lr_factor = max, lr_factor
        self.done = 0   # halving points applied
        self.rate = RateTracker()

    def before_train(self, snap: MetricsSnapshot) -> Optional[Decision]:
        self.rate.start(snap)
        return None

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        due = 0
        while self.done + due < len(self.points) and \
                snap.samples_seen >= self.points[self.done + due]:
            due += 1
        if not due:
            return None
        batch, factor = snap.batch_size, 1.0
        for _ in range(due):
            if batch * 2 <= self.max:
                batch, factor = batch * 2, factor * self.lr_factor
            else:
                factor *= 0.5
        self.done += due
        changes: Dict[str, Any] = {"lr": self.rate.scaled(snap, factor)}
        if batch != snap.batch_size:
            changes["batch_size"] = batch
        return Decision(reason=f"cosine halving {self.done} at {snap.samples_seen} samples: "
                               + ", ".join(f"{k}={v:g}" for k, v in changes.items()),
                        policy=self.name, metrics={"samples_seen": float(snap.samples_seen)},
                        **changes)

    def on_decision(self, decision: Decision, snap: MetricsSnapshot) -> None:
        self.rate.told(decision)

    def state_dict(self) -> Dict[str, Any]:
        return {"done": self.done, **self.rate.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.done = int(state["done"])
        self.rate.load_state_dict(state)
