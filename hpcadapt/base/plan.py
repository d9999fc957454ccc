"""The plan every rank applies at a step boundary: a typed, versioned record of what the
policies decided (rank 0), sent as JSON (never pickle) and applied whole or not at all."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from hpcadapt.base.errors import ConfigurationError

__all__ = ["Plan"]


@dataclass(frozen=True)
class Plan:
    """Changes for the next step. ``version`` is the cluster version it was decided in: a
    plan from another version is refused. ``lr`` set means an explicit rate that becomes the
    new base (``base_lr`` at ``base_batch_size``); ``ramp`` (start step, steps, start lr, end
    lr) moves the rate gradually (a learning-rate rule's). ``world_size`` asks for a resize
    (``remove_rank`` leaves first); ``decisions`` are the records behind it, for the log."""

    version: int
    step: int
    batch_size: Optional[int] = None
    lr: Optional[float] = None
    base_lr: Optional[float] = None
    base_batch_size: Optional[int] = None
    ramp: Optional[Tuple[int, int, float, float]] = None
    momentum: Optional[float] = None
    world_size: Optional[int] = None
    remove_rank: Optional[int] = None
    strategy: Optional[Dict[str, Any]] = None  # hpcadapt.base.strategies.Strategy.to_dict()
    topology: Optional[str] = None  # hpcadapt.comm.topology.Topology's value
    reason: str = ""
    decisions: List[Dict[str, Any]] = field(default_factory=list)

    def validate(self) -> None:
        """ConfigurationError if any part cannot be applied (then none of it is)."""
        def positive_int(name):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigurationError(f"plan {name} must be a positive integer, got {v!r}")

        def positive_float(name):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigurationError(f"plan {name} must be positive and finite, got {v!r}")

        for n in ("batch_size", "base_batch_size", "world_size"):
            positive_int(n)
        for n in ("lr", "base_lr"):
            positive_float(n)
        if self.momentum is not None and not (0 <= self.momentum < 1):
            raise ConfigurationError(f"plan momentum must be in [0, 1), got {self.momentum!r}")
        if self.strategy is not None:
            from hpcadapt.base.strategies import Strategy

            Strategy.from_dict(self.strategy)
        if self.topology is not None:
            from hpcadapt.base.topology_names import parse_topology

            parse_topology(self.topology)
        if self.ramp is not None:
            start, steps, a, b = self.ramp
            if steps < 0 or not all(math.isfinite(x) and x > 0 for x in (a, b)):
                raise ConfigurationError(f"plan ramp {self.ramp!r} is not usable")

    @property
    def empty(self) -> bool:
        return all(getattr(self, n) is None for n in
                   ("batch_size", "lr", "ramp", "momentum", "world_size", "strategy",
                    "topology"))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ConfigurationError("a plan must be a JSON object")
        if raw.get("ramp") is not None:
            raw["ramp"] = tuple(raw["ramp"])
        plan = cls(**raw)
        plan.validate()
        return plan
