"""``sma`` (synchronous model averaging, KungFu's SMA): every step pulls each replica
towards the average of all, ``v <- (1 - alpha) v + alpha mean(v)``, then applies its own
local gradient. The models' allreduce starts before forward and runs under the whole step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.base.parsers import fraction_open
from hpcadapt.base.strategies.strategy import Setting, Strategy


@dataclass(frozen=True)
class SMA(Strategy):
    name = "sma"
    summary = ("pull each replica towards the models' average every step, then apply its "
               "own gradient (KungFu's SMA)")
    settings = (Setting("sma_alpha", "--sma-alpha", fraction_open,
                        "share of the average pulled in each step, in (0, 1]", "sma_alpha"),)

    sma_alpha: float = 0.1

    def __post_init__(self) -> None:
        a = self.sma_alpha
        if not (isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a)
                and 0 < a <= 1):
            raise ConfigurationError(f"--sma-alpha {a!r} is outside (0, 1]: give the share of "
                                     f"the average each step pulls in (KungFu uses 0.1)")

    def model_alpha(self, step: int) -> Optional[float]:
        return float(self.sma_alpha)

    def describe(self) -> str:
        return f"sma (alpha {self.sma_alpha:g})"
