"""The plan every rank applies at a step boundary: a typed, versioned record of what the
policies decided (rank 0), sent as JSON (never pickle) and applied whole or not at all."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from hpcadapt.base.errors import ConfigurationError

__all__ = ["Plan", "check_changes"]


def check_changes(values: Mapping[str, Any], prefix: str = "") -> None:
    """ConfigurationError (``prefix`` + the field's name first) if a change cannot be
    applied: the one check of a policy's ``Decision`` and of the ``Plan`` made of them.
    Fields absent or None are not checked."""
    def get(name):
        return values.get(name)

    for name in ("batch_size", "base_batch_size", "world_size"):
        v = get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or int(v) != v or v < 1):
            raise ConfigurationError(f"{prefix}{name} must be a positive integer, got {v!r}")
    for name in ("lr", "base_lr"):
        v = get(name)
        if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ConfigurationError(f"{prefix}{name} must be positive and finite, got {v!r}")
    momentum = get("momentum")
    if momentum is not None and not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
        raise ConfigurationError(f"{prefix}momentum must be in [0, 1), got {momentum!r}")
    if get("strategy") is not None:
        from hpcadapt.base.strategies import Strategy

        Strategy.from_dict(get("strategy"))
    if get("topology") is not None:
        from hpcadapt.base.topology_names import parse_topology

        parse_topology(get("topology"))
    remove = get("remove_rank")
    if remove is not None and (get("world_size") is None or remove < 1):
        raise ConfigurationError(
            f"{prefix}remove_rank needs a world_size and must name a rank >= 1 (rank 0 "
            f"coordinates), got {remove!r}")


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
        check_changes(asdict(self), prefix="plan ")
        for name in ("batch_size", "base_batch_size", "world_size"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), int):
                raise ConfigurationError(f"plan {name} must be a positive integer, got "
                                         f"{getattr(self, name)!r}")
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
