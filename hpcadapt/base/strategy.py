"""Synchronisation strategies: how the replicas of a data-parallel job combine their work.

* ``ssgd`` (synchronous SGD): every step averages the gradients (one allreduce, overlapped
  with backward); the replicas stay bit-identical.
* ``sma`` (synchronous model averaging, KungFu's SMA): every step pulls each replica towards
  the average of all, ``v <- (1 - alpha) v + alpha mean(v)``, then applies its own local
  gradient. The models' allreduce starts before forward and runs under the whole step.
* ``local-sgd`` (model averaging every ``period`` steps): replicas train on their own
  gradients and take the plain average of all after the update of every ``period``-th
  step (then they are one again).
* ``pair-avg`` (KungFu's pair averaging): every step each replica fetches the model of one
  random other replica without that peer stopping, takes the mean of the two, then applies
  its own gradient.
* ``bounded-delay`` (MLFabric): rank 0 aggregates the updates the other ranks send without
  waiting for each other, in rounds of ``round_steps`` global batches; an update computed
  on a model more than ``max_delay`` versions old is dropped and its samples handed out
  again (``hpcadapt.parallel.bounded``).

The step's control values (loss, timings, stop votes) travel in a small reduction of their
own under every strategy. On monitored steps the gradients are averaged all the same, so the noise-scale statistics
can be measured; under SMA the replicas then sit at slightly different parameters, which adds
their drift to the measured spread (the noise scale reads high). The evaluated, saved and
final model is rank 0's replica. A pure value type; ``DistributedOptimizer`` applies it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Mapping, Optional

from hpcadapt.base.errors import ConfigurationError

__all__ = ["Strategy", "STRATEGIES"]

STRATEGIES = ("ssgd", "sma", "local-sgd", "pair-avg", "bounded-delay")


@dataclass(frozen=True)
class Strategy:
    """A strategy and its settings (``hpcadapt.Strategy``): ``sma_alpha`` in (0, 1] (SMA's
    pull towards the average; flag ``--sma-alpha``), ``period`` >= 1 (local SGD's steps
    between averages; ``--local-sgd-period``), ``max_delay`` >= 0 (bounded delay: the most
    versions an applied update may be behind; ``--max-delay``) and ``round_steps`` >= 1
    (bounded delay: global batches per round; ``--async-round-steps``)."""

    name: str = "ssgd"
    sma_alpha: float = 0.1
    period: int = 8
    max_delay: int = 1
    round_steps: int = 50

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ConfigurationError(f"unknown strategy {self.name!r}; choose from "
                                     f"{', '.join(STRATEGIES)}")
        if not (isinstance(self.sma_alpha, (int, float)) and math.isfinite(self.sma_alpha)
                and 0 < self.sma_alpha <= 1):
            raise ConfigurationError(f"--sma-alpha {self.sma_alpha!r} is outside (0, 1]: "
                                     f"give the share of the average each step pulls in "
                                     f"(KungFu uses 0.1)")
        if not (isinstance(self.period, int) and self.period >= 1):
            raise ConfigurationError(f"--local-sgd-period {self.period!r}: give a whole "
                                     f"number of steps, 1 or more")
        if not (isinstance(self.max_delay, int) and self.max_delay >= 0):
            raise ConfigurationError(f"--max-delay {self.max_delay!r}: give a whole number of "
                                     f"model versions, 0 or more (0: every update on the "
                                     f"newest model)")
        if not (isinstance(self.round_steps, int) and self.round_steps >= 1):
            raise ConfigurationError(f"--async-round-steps {self.round_steps!r}: give a whole "
                                     f"number of global batches, 1 or more")

    @property
    def averages_gradients(self) -> bool:
        return self.name == "ssgd"

    @property
    def pairs_models(self) -> bool:
        """Pair averaging: each step mixes in one random peer's model."""
        return self.name == "pair-avg"

    @property
    def asynchronous(self) -> bool:
        """Bounded-delay aggregation: rounds of asynchronous updates instead of steps."""
        return self.name == "bounded-delay"

    @property
    def min_workers(self) -> int:
        """The smallest world the strategy makes sense in (pair averaging needs a peer;
        bounded delay an aggregator and a worker)."""
        return 2 if self.name in ("pair-avg", "bounded-delay") else 1

    def model_alpha(self, step: int) -> Optional[float]:
        """SMA's pull towards the models' average before the update of step ``step`` (0-based
        count of steps done), or None when this step averages no models before its update."""
        if self.name == "sma":
            return float(self.sma_alpha)
        return None

    def averages_after(self, step: int) -> bool:
        """Local SGD: whether the models are averaged after the update of step ``step``
        (then the replicas are one again)."""
        return self.name == "local-sgd" and (step + 1) % self.period == 0

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Strategy":
        if not isinstance(raw, Mapping):
            raise ConfigurationError(f"a strategy must be an object, got {raw!r}")
        unknown = set(raw) - {"name", "sma_alpha", "period", "max_delay", "round_steps"}
        if unknown:
            raise ConfigurationError(f"unknown strategy settings {sorted(unknown)}")
        return cls(**dict(raw))

    def describe(self) -> str:
        if self.name == "sma":
            return f"sma (alpha {self.sma_alpha:g})"
        if self.name == "local-sgd":
            return f"local-sgd (every {self.period} steps)"
        if self.name == "bounded-delay":
            return (f"bounded-delay (max delay {self.max_delay}, rounds of "
                    f"{self.round_steps} batches)")
        return self.name
