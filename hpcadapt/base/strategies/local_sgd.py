"""``local-sgd`` (model averaging every ``period`` steps): replicas train on their own
gradients and take the plain average of all after the update of every ``period``-th step
(then they are one again)."""

from __future__ import annotations

from dataclasses import dataclass

from hpcadapt.base.parsers import positive_int
from hpcadapt.base.strategies.checks import whole
from hpcadapt.base.strategies.strategy import Setting, Strategy


@dataclass(frozen=True)
class LocalSGD(Strategy):
    name = "local-sgd"
    summary = "average the models every --local-sgd-period steps"
    settings = (Setting("period", "--local-sgd-period", positive_int,
                        "steps between model averages (1 or more)", "local_sgd_period"),)

    period: int = 8

    def __post_init__(self) -> None:
        whole("--local-sgd-period", self.period, 1, "steps")

    def averages_after(self, step: int) -> bool:
        return (step + 1) % self.period == 0

    def describe(self) -> str:
        return f"local-sgd (every {self.period} steps)"
