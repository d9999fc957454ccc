"""A synchronisation strategy of a user's own, in one module outside the package: SMA's pull
towards the models' average on every ``every``-th step only (between pulls the replicas
train apart, as under local SGD). Registering it is all it takes: ``--strategy sparse-sma``
and its flags appear on the entry point, plans and checkpoints carry it, sync-switch can
switch to and from it.

    mpiexec -n 2 python tests/scripts/sparse_sma_strategy.py --strategy sparse-sma ..."""

import math
import sys
from dataclasses import dataclass
from typing import Optional

import hpcadapt
from hpcadapt.base.strategies import Setting, Strategy


def _every(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be 1 or more, got {text!r}")
    return value


def _alpha(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError(f"must be in (0, 1], got {text!r}")
    return value


@dataclass(frozen=True)
class SparseSMA(Strategy):
    name = "sparse-sma"
    summary = "sma's pull on every --sparse-sma-every-th step only"
    settings = (Setting("every", "--sparse-sma-every", _every, "steps between pulls"),
                Setting("alpha", "--sparse-sma-alpha", _alpha, "share of the average pulled"))

    every: int = 4
    alpha: float = 0.5

    def __post_init__(self) -> None:  # plans and checkpoints build it too, not only flags
        if not (isinstance(self.every, int) and not isinstance(self.every, bool)
                and self.every >= 1):
            raise hpcadapt.ConfigurationError(f"--sparse-sma-every {self.every!r}: give a "
                                              f"whole number of steps, 1 or more")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha)
                and 0 < self.alpha <= 1):
            raise hpcadapt.ConfigurationError(f"--sparse-sma-alpha {self.alpha!r}: give a "
                                              f"share in (0, 1]")

    def model_alpha(self, step: int) -> Optional[float]:
        return self.alpha if step % self.every == 0 else None

    def describe(self) -> str:
        return f"sparse-sma (alpha {self.alpha:g}, every {self.every} steps)"


hpcadapt.register_strategy(SparseSMA)

if __name__ == "__main__":
    from hpcadapt.train import main

    sys.exit(main())
