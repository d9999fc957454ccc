"""Adaptation policies (``hpcadapt.policies``): the base class, the registry that maps a
``--policy`` name to a class, and the built-in policies."""

from __future__ import annotations

import argparse
from typing import Dict, List, Type

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.base.strategies import STRATEGIES

from .base import Decision, MetricsSnapshot, Param, Policy
from .decay_growth import DecayGrowth
from .gns_batch import GNSBatchSize
from .lr_rules import LR_RULES, RULE_PARAMS, LRRule, Ramp
from .autoscale import AutoScale
from .goodput import Goodput
from .resize_schedule import ResizeSchedule
from .schedule import Schedule
from .seesaw import Seesaw
from .straggler import Straggler
from .straggler_async import StragglerAsync
from .sync_switch import SyncSwitch
from .topology_auto import TopologyAuto

__all__ = ["Policy", "Decision", "MetricsSnapshot", "Param", "POLICIES", "register",
           "DecayGrowth", "GNSBatchSize", "Goodput", "Schedule", "Seesaw", "ResizeSchedule", "AutoScale", "Straggler", "StragglerAsync", "SyncSwitch", "TopologyAuto", "LRRule", "Ramp", "LR_RULES",
           "add_policy_arguments", "build_policies", "unused_flags", "build_lr_rule", "argparse_type"]

POLICIES: Dict[str, Type[Policy]] = {}


def register(cls: Type[Policy]) -> Type[Policy]:
    """Make a policy available as ``--policy NAME`` with its ``--NAME-PARAM`` flags."""
    if not cls.name:
        raise ConfigurationError(f"{cls.__name__} has no name")
    POLICIES[cls.name] = cls
    return cls


for _cls in (DecayGrowth, GNSBatchSize, Goodput, Schedule, Seesaw, ResizeSchedule, AutoScale, Straggler,
             StragglerAsync, SyncSwitch, TopologyAuto):
    register(_cls)


def _dest(policy: str, param: str) -> str:
    return f"{policy}_{param}".replace("-", "_")


def argparse_type(parse):
    """Wrap a parser from ``policies.params`` for argparse (its ValueError becomes the
    usage error that names the flag)."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """``--policy NAME`` (repeatable, order kept), every policy's flags, and the
    learning-rate rule's flags, each group listed by ``--help`` with its defaults."""
    parser.add_argument("--policy", action="append", default=[], choices=sorted(POLICIES),
                        help="adaptation policy to run (repeatable; they run in the order "
                             f"given): {', '.join(sorted(POLICIES))}")
    for name in sorted(POLICIES):
        cls = POLICIES[name]
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        group = parser.add_argument_group(f"policy {name}", doc or None)
        for p in cls.params:
            group.add_argument(f"--{name}-{p.name}", dest=_dest(name, p.name),
                               type=argparse_type(p.parse), default=p.default, help=p.help)
    group = parser.add_argument_group("learning-rate rule on batch changes")
    for p in RULE_PARAMS:
        group.add_argument(f"--{p.name}", dest=p.name.replace("-", "_"),
                           type=argparse_type(p.parse), default=p.default, help=p.help)


def build_policies(args: argparse.Namespace) -> List[Policy]:
    """Instantiate the ``--policy`` list in order; ConfigurationError names the bad one."""
    out: List[Policy] = []
    for name in args.policy:
        cls = POLICIES.get(name)
        if cls is None:
            raise ConfigurationError(
                f"unknown policy {name!r}; choose from {', '.join(sorted(POLICIES))}")
        options = {p.name.replace("-", "_"): getattr(args, _dest(name, p.name))
                   for p in cls.params}
        out.append(cls(**options))
    return out


def build_lr_rule(args: argparse.Namespace) -> LRRule:
    return LRRule(args.lr_rule, args.lr_ramp_steps)


def unused_flags(args: argparse.Namespace) -> List[str]:
    """Flags given a value other than their default that nothing will read (they would be
    silently ignored): a policy's without ``--policy NAME``, the rate rule's without
    ``--lr-rule``, a strategy's (``--sma-alpha``, ``--max-delay``, ...) without that
    strategy, the slowdown's without
    ``--slow-rank``. One message per case."""
    chosen = set(getattr(args, "policy", []) or [])
    messages = []
    for name in sorted(POLICIES):
        if name in chosen:
            continue
        given = [f"--{name}-{p.name}" for p in POLICIES[name].params
                 if getattr(args, f"{name}_{p.name}".replace("-", "_"), p.default) != p.default]
        if given:
            messages.append(f"{', '.join(given)} given without --policy {name}: ignored "
                            f"(add --policy {name} to use it)")
    for name, cls in STRATEGIES.items():  # (sync-switch: its own flags)
        if name == getattr(args, "strategy", "ssgd"):
            continue
        defaults = cls.defaults()
        for setting in cls.settings:
            if getattr(args, setting.dest, defaults[setting.field]) != defaults[setting.field]:
                messages.append(f"{setting.flag} given without --strategy {name}: ignored")
    if getattr(args, "slow_rank", None) is None:
        for flag in ("slow_compute", "slow_comm"):
            if getattr(args, flag, 1.0) != 1.0:
                messages.append(f"--{flag.replace('_', '-')} given without --slow-rank: "
                                f"ignored (name the rank to slow)")
    rule = getattr(args, "lr_rule", "none")
    if rule == "none":
        for p in RULE_PARAMS:
            if p.name != "lr-rule" and getattr(args, p.name.replace("-", "_"), p.default) != p.default:
                messages.append(f"--{p.name} given with --lr-rule none: ignored")
    return messages
