"""What a synchronisation strategy is: a frozen value of its own settings whose class says
how replicas combine their work, through a few capabilities the data plane and the loop
ask for (never its name). A new strategy is one module: a subclass and its registration
(``hpcadapt.base.strategies.register_strategy``).

The capabilities, each a default that a strategy overrides:

* ``averages_gradients``: every step averages the gradients (the replicas stay identical);
* ``model_alpha(step)``: the pull towards the models' average before the update of step
  ``step`` (None: no average before this update);
* ``averages_after(step)``: the models are averaged after the update of step ``step`` (the
  replicas are one again);
* ``pairs_models``: each step mixes in one random peer's model, fetched without the peer
  stopping (the data plane's pair window);
* ``asynchronous``: training runs in bounded-delay rounds instead of steps (rank 0
  aggregates; ``round_steps`` and ``max_delay`` settings);
* ``min_workers``: the smallest world it makes sense in.

The step's control values (loss, timings, stop votes) travel in a small reduction of their
own under every strategy. On monitored steps the gradients are averaged all the same, so the
noise-scale statistics can be measured; under model averaging the replicas then sit at
slightly different parameters, which adds their drift to the measured spread (the noise
scale reads high). The evaluated, saved and final model is rank 0's replica."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, ClassVar, Dict, Mapping, Optional, Tuple

__all__ = ["Strategy", "Setting"]


@dataclass(frozen=True)
class Setting:
    """One setting of a strategy: its field, the command-line flag that sets it, the
    option that flag fills (a field of ``JobOptions.steps``, where there is one) and a
    parser for the flag's text (ValueError: the usage error)."""

    field: str
    flag: str
    parse: Callable[[str], Any]
    help: str
    option: Optional[str] = None
    metavar: Optional[str] = None

    @property
    def dest(self) -> str:
        """The attribute argparse stores the flag's value in."""
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Strategy:
    """The base of every synchronisation strategy (``hpcadapt.Strategy``); make one with
    ``hpcadapt.strategy(name, **settings)`` or its class."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""   # one clause for --strategy's help
    settings: ClassVar[Tuple[Setting, ...]] = ()
    min_workers: ClassVar[int] = 1
    averages_gradients: ClassVar[bool] = False
    pairs_models: ClassVar[bool] = False
    asynchronous: ClassVar[bool] = False

    def model_alpha(self, step: int) -> Optional[float]:
        return None

    def averages_after(self, step: int) -> bool:
        return False

    def describe(self) -> str:
        return self.name

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, **asdict(self)}

    @classmethod
    def field_names(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def defaults(cls) -> Dict[str, Any]:
        """Each setting's default (``dataclasses.MISSING`` for a field without one)."""
        return {f.name: f.default for f in fields(cls)}

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> "Strategy":
        """The strategy a ``to_dict`` (a plan's, a checkpoint's) describes."""
        from hpcadapt.base.strategies import from_dict

        return from_dict(raw)
