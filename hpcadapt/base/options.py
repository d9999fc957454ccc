"""The job's settings as one typed value: what ``Job(...)`` takes as keywords and what the
command line's flags fill in (``hpcadapt.add_arguments``). No MPI, no torch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, List, Optional

__all__ = ["JobOptions", "RESIZING_POLICIES", "refuse_inconsistent"]

# Policies whose decisions change the number of workers: they need an allocator.
RESIZING_POLICIES = ("resize-schedule", "autoscale", "straggler")


@dataclass
class JobOptions:
    """The runtime's settings; ``JobOptions.from_args`` reads them from the flags that
    ``hpcadapt.add_arguments`` adds. Policies come as objects (``policies``)."""

    policies: List[Any] = field(default_factory=list)
    lr_rule: str = "none"
    lr_ramp_steps: int = 8
    resize_batch: str = "keep-global"
    monitors: List[str] = field(default_factory=list)
    monitor_interval: int = 1
    monitor_ema: float = 0.1
    monitor_window: int = 0
    strategy: Any = "ssgd"   # a name (settings from the fields below) or a Strategy
    sma_alpha: float = 0.1
    local_sgd_period: int = 8
    max_delay: int = 1
    async_round_steps: int = 50
    topology: str = "flat"
    ranks_per_node: Optional[int] = None
    slow_rank: Optional[int] = None
    slow_compute: float = 1.0
    slow_comm: float = 1.0
    slow_until: Optional[int] = None
    max_steps: Optional[int] = None
    max_nonfinite_steps: int = 5
    max_local_batch: Optional[int] = None
    bucket_bytes: Optional[int] = None
    device: str = "auto"
    data_plane: str = "auto"
    max_workers: Optional[int] = None
    min_workers: int = 1
    initial_workers: Optional[int] = None
    resume_size: str = "saved"
    warm_spares: int = 0
    allocator: str = "auto"
    launcher: str = "process"
    join_timeout: float = 120.0
    peer_timeout: float = 30.0
    on_failure: str = "recover"
    replace_failed: bool = False
    slurm_partition: Optional[str] = None
    slurm_pending_timeout: float = 60.0
    slurm_mpi: str = "pmi2"
    slurm_grow: str = "companion"
    checkpoint: Optional[str] = None
    checkpoint_every: Optional[int] = None
    stop_signals: List[str] = field(default_factory=lambda: ["SIGUSR1", "SIGTERM"])
    stop_file: Optional[str] = None
    metrics_file: Optional[str] = None
    summary_json: Optional[str] = None
    progress: bool = False
    check_replicas: bool = False
    broadcast_buffers: bool = True
    sample_log: Optional[str] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> "JobOptions":
        """The options a namespace of hpcadapt's flags gives (every field of the same name;
        ``--policy``, ``--monitor`` and ``--no-progress`` map to ``policies``, ``monitors``
        and ``progress``); ``overrides`` win. The policies are built by the caller
        (``hpcadapt.policies.build_policies``) and passed as ``policies=``."""
        values = {f: getattr(args, f) for f in cls.__dataclass_fields__
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
        return cls(**values)


def refuse_inconsistent(options) -> str:
    """Why flags that each parse are unusable together (one line), or "": checked at start,
    on every rank alike, instead of being ignored or failing mid-run. ``options``: a
    ``JobOptions`` (or anything with its fields)."""
    if getattr(options, "checkpoint_every", None) and not getattr(options, "checkpoint", None):
        return (f"--checkpoint-every {options.checkpoint_every} needs --checkpoint FILE (where "
                f"the state is saved)")
    most = options.max_workers
    if most is None:
        if options.min_workers > 1:
            return (f"--min-workers {options.min_workers} needs --max-workers (without it the "
                    f"world keeps its size)")
        if getattr(options, "warm_spares", 0):
            return "--warm-spares needs --max-workers (the allocator that starts them)"
        for policy in options.policies:
            if getattr(policy, "name", "") in RESIZING_POLICIES:
                return (f"--policy {policy.name} resizes the job and needs --max-workers (the "
                        f"most workers it may grow to)")
    for policy in options.policies:
        if getattr(policy, "name", "") == "resize-schedule":
            for step, size in policy.steps:
                if options.max_steps is not None and step > options.max_steps:
                    return (f"--resize-schedule-steps {step}:{size}: step {step} is beyond "
                            f"--max-steps {options.max_steps} (the run ends first)")
    return ""
