"""Synchronisation strategies (``--strategy``): how the replicas of a data-parallel job
combine their work. The registry maps a name to a strategy class; each built-in is one
module here (ssgd, sma, local-sgd, pair-avg, bounded-delay). A strategy of your own is a
subclass of ``Strategy`` registered with ``register_strategy`` before the job (or the entry
point's parser) is made; its settings' flags then appear on the command line."""

from __future__ import annotations

from dataclasses import MISSING
from typing import Any, Dict, Mapping, Optional, Type

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.base.strategies.bounded_delay import BoundedDelay
from hpcadapt.base.strategies.local_sgd import LocalSGD
from hpcadapt.base.strategies.pair_avg import PairAveraging
from hpcadapt.base.strategies.sma import SMA
from hpcadapt.base.strategies.ssgd import SSGD
from hpcadapt.base.strategies.strategy import Setting, Strategy

__all__ = ["Strategy", "Setting", "STRATEGIES", "register_strategy", "strategy", "pick",
           "from_dict", "from_options", "from_namespace", "registered", "SSGD", "SMA",
           "LocalSGD", "PairAveraging", "BoundedDelay"]

#: name -> class, in registration order (the built-ins first)
STRATEGIES: Dict[str, Type[Strategy]] = {}


def register_strategy(cls: Type[Strategy]) -> Type[Strategy]:
    """Make ``cls`` available by its name (``--strategy NAME``, plans, checkpoints)."""
    if not (isinstance(cls, type) and issubclass(cls, Strategy) and cls.name):
        raise ConfigurationError(f"{cls!r}: a strategy is a Strategy subclass with a name")
    known = STRATEGIES.get(cls.name)
    if known is not None and known is not cls:
        raise ConfigurationError(f"strategy {cls.name!r} is registered already "
                                 f"({known.__module__}.{known.__qualname__})")
    defaults = cls.defaults()
    for s in cls.settings:
        if defaults.get(s.field, MISSING) is MISSING:
            raise ConfigurationError(f"strategy {cls.name!r}: setting {s.field!r} needs a "
                                     f"field of that name with a default")
    flags = {s.flag for other in STRATEGIES.values() if other is not cls for s in other.settings}
    clash = sorted(s.flag for s in cls.settings if s.flag in flags)
    if clash:
        raise ConfigurationError(f"strategy {cls.name!r}: flag(s) {', '.join(clash)} belong "
                                 f"to another strategy")
    STRATEGIES[cls.name] = cls
    return cls


for _cls in (SSGD, SMA, LocalSGD, PairAveraging, BoundedDelay):
    register_strategy(_cls)


def _class(name: Any) -> Type[Strategy]:
    cls = STRATEGIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ConfigurationError(f"unknown strategy {name!r}; choose from "
                                 f"{', '.join(STRATEGIES)}")
    return cls


def strategy(name: str, **settings: Any) -> Strategy:
    """The strategy ``name`` with these settings (``strategy("sma", sma_alpha=0.2)``);
    a setting it does not have is refused."""
    cls = _class(name)
    unknown = sorted(set(settings) - set(cls.field_names()))
    if unknown:
        have = ", ".join(cls.field_names()) or "none"
        raise ConfigurationError(f"strategy {name!r} has no setting(s) {', '.join(unknown)} "
                                 f"(its settings: {have})")
    return cls(**settings)


def pick(name: str, pool: Mapping[str, Any]) -> Strategy:
    """The strategy ``name`` with the settings it has taken from ``pool`` (a policy's own
    values for any strategy it may switch to)."""
    cls = _class(name)
    return cls(**{f: pool[f] for f in cls.field_names() if f in pool})


# Keys of the one flat form every strategy had before each owned its settings: a checkpoint
# or plan written then still reads.
_LEGACY_KEYS = {"sma_alpha", "period", "max_delay", "round_steps"}


def from_dict(raw: Mapping[str, Any]) -> Strategy:
    """The strategy a ``to_dict`` describes (a plan's, a checkpoint's)."""
    if not isinstance(raw, Mapping):
        raise ConfigurationError(f"a strategy must be an object, got {raw!r}")
    cls = _class(raw.get("name", "ssgd"))
    own = set(cls.field_names())
    unknown = set(raw) - own - _LEGACY_KEYS - {"name"}
    if unknown:
        raise ConfigurationError(f"unknown strategy settings {sorted(unknown)}")
    return cls(**{k: v for k, v in raw.items() if k in own})


def from_options(options: Any) -> Strategy:
    """The strategy of the step options (``JobOptions.steps``): its ``strategy`` when that
    is a ``Strategy``, else the named one with the settings the options hold for it (each
    setting's ``option`` field; the class's default where the options have none). The
    whole ``JobOptions`` is read through its ``steps``."""
    options = getattr(options, "steps", options)
    given = getattr(options, "strategy", "ssgd")
    if isinstance(given, Strategy):
        return registered(given)
    cls = _class(given)
    return cls(**{s.field: getattr(options, s.option) for s in cls.settings
                  if s.option and hasattr(options, s.option)})


def from_namespace(args: Any, overrides: Optional[Mapping[str, Any]] = None) -> Strategy:
    """The strategy a namespace of the command line's flags names, with its flags' values;
    ``overrides`` (JobOptions keywords, ``sma_alpha=0.3``) win over the flags."""
    cls = _class(getattr(args, "strategy", "ssgd"))
    overrides = overrides or {}
    values = {}
    for s in cls.settings:
        if s.option and s.option in overrides:
            values[s.field] = overrides[s.option]
        elif hasattr(args, s.dest):
            values[s.field] = getattr(args, s.dest)
    return cls(**values)


def registered(given: Any) -> Strategy:
    """``given`` if it is an instance of the class registered under its name, else one
    line saying what to do (the base class, or a class never registered, would train
    without combining the replicas and could not be read back from a checkpoint)."""
    if not isinstance(given, Strategy) or STRATEGIES.get(given.name) is not type(given):
        raise ConfigurationError(f"{given!r} is not a registered strategy: make one with "
                                 f"hpcadapt.strategy(name, ...) (names: "
                                 f"{', '.join(STRATEGIES)}) or register its class with "
                                 f"hpcadapt.register_strategy")
    return given
