"""The Slurm allocation this process runs in, read from the job environment and typed."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from hpcadapt.base.errors import AllocationError

from .commands import (SQUEUE_FORMAT, SlurmCommandError, check_job_id, check_partition,
                       parse_cpus_per_node, parse_squeue, run_slurm, show_hostnames)

__all__ = ["Allocation", "in_slurm_job"]


def in_slurm_job(env: Optional[Mapping[str, str]] = None) -> bool:
    return bool((os.environ if env is None else env).get("SLURM_JOB_ID"))


@dataclass(frozen=True)
class Allocation:
    """A job's resources: where it runs and for how long."""

    job_id: str
    partition: str
    nodes: Tuple[str, ...]
    cpus_per_node: Tuple[int, ...]
    gpus_per_node: int
    time_limit_s: float   # the job's time left when read; inf without a limit

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @classmethod
    def from_environment(cls, env: Optional[Mapping[str, str]] = None) -> "Allocation":
        """Read SLURM_JOB_ID, SLURM_JOB_NODELIST (expanded by ``scontrol show hostnames``),
        SLURM_JOB_CPUS_PER_NODE, SLURM_GPUS_ON_NODE and the time left from ``squeue``.
        Every value is validated before it reaches a command line."""
        env = os.environ if env is None else env
        if not in_slurm_job(env):
            raise AllocationError("not inside a Slurm job (SLURM_JOB_ID is not set)")
        job_id = check_job_id(env["SLURM_JOB_ID"])
        partition = check_partition(env.get("SLURM_JOB_PARTITION", "")) \
            if env.get("SLURM_JOB_PARTITION") else ""
        nodes = tuple(show_hostnames(env.get("SLURM_JOB_NODELIST") or
                                     env.get("SLURM_NODELIST", "")))
        cpus_text = env.get("SLURM_JOB_CPUS_PER_NODE") or \
            env.get("SLURM_JOB_CPUS_PER_NODE_PACK_GROUP_0") or env.get("SLURM_CPUS_ON_NODE", "1")
        try:
            cpus = parse_cpus_per_node(cpus_text)
        except ValueError as exc:
            raise AllocationError(f"SLURM_JOB_CPUS_PER_NODE: {exc}") from None
        if len(cpus) == 1 and len(nodes) > 1:
            cpus = cpus * len(nodes)
        gpus_text = env.get("SLURM_GPUS_ON_NODE", "0")
        gpus = int(gpus_text) if gpus_text.isdigit() else 0
        return cls(job_id, partition, nodes, tuple(cpus[:len(nodes)]), gpus,
                   time_left(job_id))


def time_left(job_id: str) -> float:
    """Seconds the job has left (inf without a limit, nan when squeue cannot tell)."""
    cmd = ["squeue", "-h", "-j", check_job_id(job_id), "-o", SQUEUE_FORMAT]
    try:
        state = parse_squeue(run_slurm(cmd)).get(job_id)
    except ValueError as exc:
        raise SlurmCommandError(cmd, f"unparsable output: {exc}") from None
    if state is None:
        return math.nan
    return state.time_left_s
