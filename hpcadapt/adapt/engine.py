"""The policy engine: a pure function from a metrics snapshot to a plan. It runs on rank 0
only and calls no collectives; the job broadcasts the plan and every rank applies it at the
same step boundary.

How decisions combine: policies run in the order given on the command line. Each sees the
snapshot with the changes of the policies before it already applied, and a later policy's
value for a field replaces an earlier one's (last writer wins, field by field). After the
policies, if the batch size changed and no policy set the learning rate, the learning-rate
rule sets it (with its ramp); an explicit learning rate from a policy wins over the rule and
becomes the new base (base_lr at the current batch). A policy that raises, or returns a value
that cannot be applied, is logged on rank 0 and its decision discarded; a policy whose inputs
are NaN or infinite skips the step."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence

from hpcadapt.base.errors import ConfigurationError, PolicyError, on_every_rank
from hpcadapt.base.plan import Plan

from hpcadapt.policies.base import Decision, MetricsSnapshot, Policy, merge_decisions
from hpcadapt.policies.lr_rules import LRRule

__all__ = ["PolicyEngine"]

log = logging.getLogger(__name__)

HOOKS = ("before_train", "before_epoch", "after_step", "after_epoch", "after_train",
         "on_resize")
RESIZE_BATCH = ("keep-global", "keep-local")


class PolicyEngine:
    def __init__(self, policies: Sequence[Policy], lr_rule: Optional[LRRule] = None, *,
                 resize_batch: str = "keep-global"):
        if resize_batch not in RESIZE_BATCH:
            raise ConfigurationError(f"--resize-batch must be one of {', '.join(RESIZE_BATCH)}; "
                                     f"got {resize_batch!r}")
        self.policies = list(policies)
        self.lr_rule = lr_rule or LRRule("none", 0)
        for p in self.policies:
            if p.needs_rate_rule and self.lr_rule.rule not in p.needs_rate_rule:
                raise on_every_rank(ConfigurationError(
                    f"--policy {p.name} needs --lr-rule {' or '.join(p.needs_rate_rule)} "
                    f"(linear for SGD, sqrt for Adam/AdamW): its batch changes stand in for "
                    f"rate changes only when the rule scales the rate with them; got "
                    f"--lr-rule {self.lr_rule.rule}"))
        self.resize_batch = resize_batch
        self._warned: set = set()

    @property
    def active(self) -> bool:
        return (bool(self.policies) or self.lr_rule.rule == "adascale"
                or self.resize_batch != "keep-global")

    @property
    def required_monitors(self) -> List[str]:
        need = {m for p in self.policies for m in p.requires}
        if self.lr_rule.rule == "adascale":
            need.add("gns")
        return sorted(need)

    @property
    def intervals(self) -> List[int]:
        return [max(1, int(p.interval)) for p in self.policies]

    def due(self, step: int, monitored: bool) -> bool:
        """Whether ``after_step`` has work at this step (else no broadcast is made)."""
        if any(step % i == 0 for i in self.intervals):
            return True
        return self.lr_rule.rule == "adascale" and monitored

    # -- deciding (rank 0) ---------------------------------------------------------------
    def decide(self, hook: str, snap: MetricsSnapshot, **extra: Any) -> List[Decision]:
        """Run the hook of every policy in order; return the decisions kept."""
        kept: List[Decision] = []
        pending: Dict[str, Any] = {}
        for policy in self.policies:
            if hook == "after_step" and snap.step % max(1, int(policy.interval)) != 0:
                continue
            view = snap.with_changes(pending)
            overridden = getattr(type(policy), hook) is not getattr(Policy, hook)
            if not overridden:
                continue
            bad = [n for n in policy.reads if isinstance(getattr(view, n), float)
                   and not math.isfinite(getattr(view, n))]
            if bad:
                self._skip(policy, snap, bad)
                continue
            try:
                d = getattr(policy, hook)(view, **extra) if extra else getattr(policy, hook)(view)
                if d is None:
                    continue
                if not isinstance(d, Decision):
                    raise PolicyError(f"returned {type(d).__name__}, not a Decision")
                d.validate()
            except Exception:  # a policy's failure must never stop training
                log.exception("policy %s failed in %s at step %d; decision discarded, training "
                              "goes on with the current configuration", policy.name, hook, snap.step)
                continue
            if not d.policy:
                d = replace(d, policy=policy.name)
            if d.changes():
                kept.append(d)
                pending.update(d.changes())
        if hook == "on_resize" and self.resize_batch == "keep-local" and "batch_size" not in pending:
            old, new = extra["old_size"], extra["new_size"]
            local = max(1, round(snap.batch_size / old))
            if local * new != snap.batch_size:
                d = Decision(reason=f"keep the local batch {local} across {old} -> {new} workers",
                             batch_size=local * new, policy="resize-batch:keep-local",
                             metrics={"old_size": float(old), "new_size": float(new)})
                kept.append(d)
                pending.update(d.changes())
        new_batch = pending.get("batch_size")
        if new_batch is not None and new_batch != snap.batch_size and "lr" not in pending:
            rule = self.lr_rule.on_change(snap.with_changes(
                {k: v for k, v in pending.items() if k != "batch_size"}), new_batch)
            if rule is not None:
                kept.append(rule)
        elif hook == "after_step" and not pending:
            rule = self.lr_rule.on_monitor(snap)
            if rule is not None:
                kept.append(rule)
        return kept

    def _skip(self, policy: Policy, snap: MetricsSnapshot, bad: List[str]) -> None:
        level = logging.DEBUG if policy.name in self._warned else logging.WARNING
        self._warned.add(policy.name)
        log.log(level, "policy %s skips step %d: %s not finite (%s)", policy.name, snap.step,
                ", ".join(bad), ", ".join(f"{n}={getattr(snap, n)}" for n in bad))

    def plan(self, decisions: List[Decision], snap: MetricsSnapshot, version: int) -> Plan:
        """The typed plan every rank applies for these decisions."""
        fields, reason = merge_decisions(decisions, snap, self.lr_rule.ramp_steps)
        records = [{"policy": d.policy, "changes": d.changes(), "reason": d.reason,
                    "metrics": d.metrics} for d in decisions]
        return Plan(version=version, step=snap.step, reason=reason, decisions=records,
                    **fields)

    def told(self, decisions: List[Decision], snap: MetricsSnapshot) -> None:
        """Rank 0, after a plan was applied: tell every policy (cooldowns and the like)."""
        for d in decisions:
            for p in self.policies:
                p.on_decision(d, snap)

    def state_dict(self) -> Dict[str, Any]:
        return {p.name: p.state_dict() for p in self.policies}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for p in self.policies:
            if p.name in state:
                p.load_state_dict(state[p.name])
