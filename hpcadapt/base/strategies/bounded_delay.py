"""``bounded-delay`` (MLFabric): rank 0 aggregates the updates the other ranks send without
waiting for each other, in rounds of ``round_steps`` global batches; an update computed on a
model more than ``max_delay`` versions old is dropped and its samples handed out again
(``hpcadapt.parallel.bounded``, ``hpcadapt.loop.rounds``)."""

from __future__ import annotations

from dataclasses import dataclass

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.base.parsers import non_negative_int, positive_int
from hpcadapt.base.strategies.strategy import Setting, Strategy


@dataclass(frozen=True)
class BoundedDelay(Strategy):
    name = "bounded-delay"
    summary = ("rank 0 aggregates the others' updates asynchronously and drops those older "
               "than --max-delay (MLFabric)")
    min_workers = 2
    asynchronous = True
    settings = (
        Setting("max_delay", "--max-delay", non_negative_int,
                "an update computed on a model more than D versions older than the one it "
                "would be applied to is dropped (its samples are handed out again); a worker "
                "pulls the model when its own delay reaches D", "max_delay", "D"),
        Setting("round_steps", "--async-round-steps", positive_int,
                "global batches per asynchronous round; policies, resizes, checkpoints and "
                "stop votes run between rounds", "async_round_steps", "K"),
    )

    max_delay: int = 1
    round_steps: int = 50

    def __post_init__(self) -> None:
        if not (isinstance(self.max_delay, int) and not isinstance(self.max_delay, bool)
                and self.max_delay >= 0):
            raise ConfigurationError(f"--max-delay {self.max_delay!r}: give a whole number of "
                                     f"model versions, 0 or more (0: every update on the "
                                     f"newest model)")
        if not (isinstance(self.round_steps, int) and not isinstance(self.round_steps, bool)
                and self.round_steps >= 1):
            raise ConfigurationError(f"--async-round-steps {self.round_steps!r}: give a whole "
                                     f"number of global batches, 1 or more")

    def describe(self) -> str:
        return (f"bounded-delay (max delay {self.max_delay}, rounds of "
                f"{self.round_steps} batches)")
