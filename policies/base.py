"""The Policy base class, its typed inputs (MetricsSnapshot) and outputs (Decision), and
the declaration of a policy's command-line parameters.

Policies are pure decision makers: they run on rank 0 only, read an aggregated snapshot,
keep their own state, call no collectives and hold no globals. The engine communicates."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, ClassVar, Dict, Optional, Sequence, Tuple

from hpcadapt.base.plan import check_changes

__all__ = ["MetricsSnapshot", "Decision", "Param", "Policy", "merge_decisions"]


@dataclass(frozen=True)
class MetricsSnapshot:
    """What rank 0 knows at a step boundary, aggregated over all ranks.

    Per-rank tuples are indexed by rank. Gradient statistics are NaN on steps that did
    not monitor them (``monitored`` says which)."""

    step: int
    epoch: int
    world_size: int
    batch_size: int
    lr: float
    momentum: float
    base_lr: float
    base_batch_size: int
    loss: float = float("nan")
    samples_per_s: float = float("nan")
    epoch_progress: float = 0.0
    test_accuracy: float = float("nan")
    monitored: bool = False
    noise_scale: float = float("nan")
    grad_sq: float = float("nan")
    trace_sigma: float = float("nan")
    grad_variance: float = float("nan")
    grad_snr: float = float("nan")
    # The noise scale's 95% interval from the smoothed estimate's spread (NaN until known).
    noise_scale_lo: float = float("nan")
    noise_scale_hi: float = float("nan")
    samples_seen: int = 0    # samples trained on in committed steps, all epochs together
    # The user's scheduler's rate now (the optimizer's first group, without the policies'
    # factor): what a schedule-reading policy (decay-growth) follows.
    schedule_lr: float = float("nan")
    step_time: Tuple[float, ...] = ()
    compute_time: Tuple[float, ...] = ()
    wait_time: Tuple[float, ...] = ()
    rank_samples: Tuple[float, ...] = ()
    max_workers: int = 1
    min_workers: int = 1
    can_resize: bool = False          # the job has an allocator (--max-workers)
    max_local_batch: Optional[int] = None  # --max-local-batch: larger shares accumulate
    cluster_version: int = 0
    resizing: bool = False   # a grow is under way (new workers starting)
    strategy: str = "ssgd"   # the synchronisation strategy training uses now
    topology: str = "flat"   # the gradients' allreduce topology now
    nodes: int = 1           # nodes the world spans (emulated ones with --ranks-per-node)

    def with_changes(self, changes: Dict[str, Any]) -> "MetricsSnapshot":
        """The snapshot as the next policy in line sees it: earlier decisions applied."""
        own = {f.name for f in fields(self)}
        changes = dict(changes)
        if isinstance(changes.get("strategy"), dict):
            changes["strategy"] = changes["strategy"].get("name", self.strategy)
        return replace(self, **{k: v for k, v in changes.items() if k in own})

    def values(self, names: Sequence[str]) -> Dict[str, float]:
        return {n: getattr(self, n) for n in names}


@dataclass(frozen=True)
class Decision:
    """A change of configuration, why it was made, and the metric values behind it.

    Fields left as None are not changed. ``world_size`` asks for a resize; with
    ``remove_rank`` that rank (not the highest) leaves when the world shrinks."""

    reason: str
    batch_size: Optional[int] = None
    lr: Optional[float] = None
    momentum: Optional[float] = None
    world_size: Optional[int] = None
    remove_rank: Optional[int] = None
    strategy: Optional[Dict[str, Any]] = None  # hpcadapt.base.strategies.Strategy.to_dict()
    topology: Optional[str] = None  # the gradients' allreduce topology (hpcadapt.comm.topology)
    metrics: Dict[str, float] = field(default_factory=dict)
    policy: str = ""

    CHANGE_FIELDS: ClassVar[Tuple[str, ...]] = ("batch_size", "lr", "momentum", "world_size",
                                                "remove_rank", "strategy", "topology")

    def changes(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in self.CHANGE_FIELDS if getattr(self, k) is not None}

    def validate(self) -> None:
        """Raise ConfigurationError if a value cannot be applied (the plan's own check)."""
        check_changes(self.changes())


def merge_decisions(decisions: Sequence[Decision], snap: MetricsSnapshot,
                    ramp_steps: int) -> Tuple[Dict[str, Any], str]:
    """The plan's fields for these decisions, and its reason (the last resize's, strategy's
    or topology's): the last writer wins field by field; an explicit rate becomes the new
    base (at the new batch), a learning-rate rule's is reached through its ramp (over
    ``ramp_steps`` when the batch changes). The engine's plan and the simulator both use it."""
    changes: Dict[str, Any] = {}
    explicit_lr = None
    rule_lr = None
    reason = ""
    for d in decisions:
        changes.update(d.changes())
        if d.lr is not None:
            if d.policy.startswith("lr-rule"):
                rule_lr = d.lr
            else:
                explicit_lr = d.lr
        if d.world_size is not None or d.strategy is not None or d.topology is not None:
            reason = f"{d.policy}: {d.reason}"
    fields: Dict[str, Any] = {}
    if explicit_lr is not None:
        fields.update(lr=float(explicit_lr), base_lr=float(explicit_lr),
                      base_batch_size=int(changes.get("batch_size", snap.batch_size)))
    elif rule_lr is not None:
        steps = ramp_steps if "batch_size" in changes else 0
        fields["ramp"] = (snap.step, int(steps), float(snap.lr), float(rule_lr))
    if "batch_size" in changes:
        fields["batch_size"] = int(changes["batch_size"])
    if "momentum" in changes:
        fields["momentum"] = float(changes["momentum"])
    if "strategy" in changes:
        fields["strategy"] = dict(changes["strategy"])
    if "topology" in changes:
        fields["topology"] = str(changes["topology"])
    if "world_size" in changes:
        fields["world_size"] = int(changes["world_size"])
        if changes.get("remove_rank") is not None:
            fields["remove_rank"] = int(changes["remove_rank"])
    return fields, reason


@dataclass(frozen=True)
class Param:
    """One tunable parameter of a policy; it becomes the flag ``--<policy>-<name>``.

    ``parse`` turns the flag's text into a value and raises ValueError with a message that
    says the valid range or choices."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str


class Policy:
    """Base of every adaptation policy.

    Subclasses set ``name`` (the ``--policy`` value) and ``params``, accept the params as
    keyword arguments, and override the hooks they need. A hook returns a Decision or None.
    ``interval``: the engine calls ``after_step`` only every ``interval`` steps.
    ``requires``: monitors the policy needs (e.g. "gns"), switched on for it.
    ``reads``: snapshot fields that must be finite for the policy to run this step.
    ``needs_rate_rule``: the ``--lr-rule`` values it works with (empty: any).
    ``monitor_window``: the noise-scale monitor's memory in samples it wants when
    ``--monitor-window`` is left at 0 (the longest any policy asks for wins).
    ``reads_schedule``: it follows the user's scheduler, which must then be keyed on samples
    (``hpcadapt.ProgressLR``), checked at ``job.setup``.
    ``changes_batch``: it changes the global batch, so a scheduler counting steps would end
    early or late (said once at ``job.setup``)."""

    name: ClassVar[str] = ""
    params: ClassVar[Tuple[Param, ...]] = ()
    requires: ClassVar[Tuple[str, ...]] = ()
    reads: ClassVar[Tuple[str, ...]] = ()
    interval: int = 1
    needs_rate_rule: ClassVar[Tuple[str, ...]] = ()
    reads_schedule: ClassVar[bool] = False
    changes_batch: ClassVar[bool] = False
    monitor_window: ClassVar[int] = 0

    def before_train(self, snap: MetricsSnapshot) -> Optional[Decision]:
        return None

    def before_epoch(self, snap: MetricsSnapshot) -> Optional[Decision]:
        return None

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        return None

    def after_epoch(self, snap: MetricsSnapshot) -> Optional[Decision]:
        return None

    def after_train(self, snap: MetricsSnapshot) -> Optional[Decision]:
        return None

    def on_resize(self, snap: MetricsSnapshot, *, old_size: int, new_size: int) -> Optional[Decision]:
        return None

    def on_decision(self, decision: Decision, snap: MetricsSnapshot) -> None:
        """Told of every decision that was applied (from any policy), e.g. to start a cooldown."""

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass

    def decision(self, reason: str, snap: MetricsSnapshot, **changes: Any) -> Decision:
        """A Decision from this policy with the metric values it read attached."""
        return Decision(reason=reason, policy=self.name, metrics=snap.values(self.reads),
                        **changes)
