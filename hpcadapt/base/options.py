"""The job's settings as one typed value, in a group per collaborator that reads them: what
``Job(...)`` takes as keywords and what the command line's flags fill in
(``hpcadapt.add_arguments``). No MPI, no torch."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["JobOptions", "AdaptationOptions", "MonitoringOptions", "StepOptions", "CommOptions",
           "MembershipOptions", "FailureOptions", "StopOptions", "RecordingOptions",
           "RESIZING_POLICIES", "refuse_inconsistent", "option_defaults", "FLAGLESS_OPTIONS"]

# Policies whose decisions change the number of workers: they need an allocator.
RESIZING_POLICIES = ("resize-schedule", "autoscale", "straggler")


@dataclass(frozen=True)
class AdaptationOptions:
    """``Adaptation``'s: the policies and how their decisions are applied."""

    policies: List[Any] = field(default_factory=list)
    lr_rule: str = "none"
    lr_ramp_steps: int = 8
    resize_batch: str = "keep-global"


@dataclass(frozen=True)
class MonitoringOptions:
    """``Monitoring``'s: the statistics measured inside the step, and the replicas' check."""

    monitors: List[str] = field(default_factory=list)
    monitor_interval: int = 1
    monitor_ema: float = 0.1
    monitor_window: int = 0
    check_replicas: bool = False


@dataclass(frozen=True)
class StepOptions:
    """The step runner's: the strategy (a name with its settings below, or a ``Strategy``),
    the step's limits, and the emulated slow rank."""

    strategy: Any = "ssgd"
    sma_alpha: float = 0.1
    local_sgd_period: int = 8
    max_delay: int = 1
    async_round_steps: int = 50
    max_steps: Optional[int] = None
    max_nonfinite_steps: int = 5
    max_local_batch: Optional[int] = None
    slow_rank: Optional[int] = None
    slow_compute: float = 1.0
    slow_comm: float = 1.0
    slow_until: Optional[int] = None


@dataclass(frozen=True)
class CommOptions:
    """The data plane's (the distributed optimizer's): where tensors live, how they travel
    and over which allreduce topology."""

    device: str = "auto"
    data_plane: str = "auto"
    bucket_bytes: Optional[int] = None
    broadcast_buffers: bool = True
    topology: str = "flat"
    ranks_per_node: Optional[int] = None


@dataclass(frozen=True)
class MembershipOptions:
    """``Resizing``': how many workers, where they come from, how joins are waited
    for."""

    max_workers: Optional[int] = None
    min_workers: int = 1
    initial_workers: Optional[int] = None
    resume_size: str = "saved"
    warm_spares: int = 0
    allocator: str = "auto"
    launcher: str = "process"
    join_timeout: float = 120.0
    slurm_partition: Optional[str] = None
    slurm_pending_timeout: float = 60.0
    slurm_mpi: str = "pmi2"
    slurm_grow: str = "companion"


@dataclass(frozen=True)
class FailureOptions:
    """``Failures``'s: whether a peer's death is recovered from, and how long a
    silent peer is waited for (every bounded wait's floor)."""

    on_failure: str = "recover"
    replace_failed: bool = False
    peer_timeout: float = 30.0


@dataclass(frozen=True)
class StopOptions:
    """``Stops``': where the state is saved, how often, and what stops the job."""

    checkpoint: Optional[str] = None
    checkpoint_every: Optional[int] = None
    stop_signals: List[str] = field(default_factory=lambda: ["SIGUSR1", "SIGTERM"])
    stop_file: Optional[str] = None


@dataclass(frozen=True)
class RecordingOptions:
    """The ``Recorder``'s: where metrics, the summary and the samples go, and the progress
    line."""

    metrics_file: Optional[str] = None
    summary_json: Optional[str] = None
    progress: bool = False
    progress_every: float = 30.0
    sample_log: Optional[str] = None


_GROUPS = {"adaptation": AdaptationOptions, "monitoring": MonitoringOptions,
           "steps": StepOptions, "comm": CommOptions, "membership": MembershipOptions,
           "failures": FailureOptions, "stops": StopOptions, "recording": RecordingOptions}
# each option's group: the names are the keywords of Job(...) and the flags' dests
_GROUP_OF = {name: group for group, cls in _GROUPS.items() for name in cls.__dataclass_fields__}


# options no flag of the same name fills (--policy, --monitor and --no-progress do)
FLAGLESS_OPTIONS = ("policies", "monitors", "progress")


def option_defaults() -> Dict[str, Any]:
    """Every option's default by its flat name (the keyword of ``Job(...)`` and the dest of
    its flag): the one place the defaults are written; ``add_arguments`` takes the flags'
    defaults from here."""
    out: Dict[str, Any] = {}
    for cls in _GROUPS.values():
        for f in dataclasses.fields(cls):
            out[f.name] = f.default if f.default is not dataclasses.MISSING \
                else f.default_factory()  # type: ignore[misc]
    return out


@dataclass(frozen=True)
class JobOptions:
    """The runtime's settings, one group per collaborator that reads them (each value has
    one place). Built from flat keywords (``JobOptions.of(checkpoint=..., policies=[...])``,
    what ``Job(...)`` takes) or from the flags ``hpcadapt.add_arguments`` adds
    (``JobOptions.from_args``). Policies come as objects (``policies``)."""

    adaptation: AdaptationOptions = field(default_factory=AdaptationOptions)
    monitoring: MonitoringOptions = field(default_factory=MonitoringOptions)
    steps: StepOptions = field(default_factory=StepOptions)
    comm: CommOptions = field(default_factory=CommOptions)
    membership: MembershipOptions = field(default_factory=MembershipOptions)
    failures: FailureOptions = field(default_factory=FailureOptions)
    stops: StopOptions = field(default_factory=StopOptions)
    recording: RecordingOptions = field(default_factory=RecordingOptions)

    @classmethod
    def of(cls, **values: Any) -> "JobOptions":
        """The options these flat keywords give (each to its group; the rest default).
        TypeError names a keyword that is no option."""
        unknown = sorted(set(values) - set(_GROUP_OF))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}: the options are "
                            f"{', '.join(sorted(_GROUP_OF))}")
        grouped: dict = {group: {} for group in _GROUPS}
        for name, value in values.items():
            grouped[_GROUP_OF[name]][name] = value
        return cls(**{group: _GROUPS[group](**kw) for group, kw in grouped.items()})

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> "JobOptions":
        """The options a namespace of hpcadapt's flags gives (every option of the same name;
        ``--policy``, ``--monitor`` and ``--no-progress`` map to ``policies``, ``monitors``
        and ``progress``); ``overrides`` win. The policies are built by the caller
        (``hpcadapt.policies.build_policies``) and passed as ``policies=``."""
        values = {f: getattr(args, f) for f in _GROUP_OF
                  if f not in ("policies", "monitors", "progress") and hasattr(args, f)}
        values["policies"] = []
        values["monitors"] = list(getattr(args, "monitor", []) or [])
        values["progress"] = not getattr(args, "no_progress", True)
        values.update(overrides)
        if hasattr(args, "strategy") and "strategy" not in overrides:
            # The named strategy with its settings: a keyword override of a setting
            # (sma_alpha=0.3) wins over its flag; a registered strategy's own flags count.
            from hpcadapt.base.strategies import from_namespace

            values["strategy"] = from_namespace(args, overrides)
        return cls.of(**values)


def refuse_inconsistent(options: JobOptions) -> str:
    """Why flags that each parse are unusable together (one line), or "": checked at start,
    on every rank alike, instead of being ignored or failing mid-run."""
    stops, size = options.stops, options.membership
    if stops.checkpoint_every and not stops.checkpoint:
        return (f"--checkpoint-every {stops.checkpoint_every} needs --checkpoint FILE (where "
                f"the state is saved)")
    policies = options.adaptation.policies
    if size.max_workers is None:
        if size.min_workers > 1:
            return (f"--min-workers {size.min_workers} needs --max-workers (without it the "
                    f"world keeps its size)")
        if size.warm_spares:
            return "--warm-spares needs --max-workers (the allocator that starts them)"
        for policy in policies:
            if getattr(policy, "name", "") in RESIZING_POLICIES:
                return (f"--policy {policy.name} resizes the job and needs --max-workers (the "
                        f"most workers it may grow to)")
    max_steps = options.steps.max_steps
    for policy in policies:
        if getattr(policy, "name", "") == "resize-schedule":
            for step, size_to in policy.steps:
                if max_steps is not None and step > max_steps:
                    return (f"--resize-schedule-steps {step}:{size_to}: step {step} is beyond "
                            f"--max-steps {max_steps} (the run ends first)")
    return ""
