"""Slurm's command-line tools, run safely, and pure parsers of what they print.

Every command runs from an argument list (never a shell), and every value that comes from
the environment or a user (job ids, node names, partitions) is validated first. A failing
command raises ``SlurmCommandError`` carrying the command and its stderr. The parsers take
the text and return typed values; the tests feed them output recorded from a real Slurm."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from hpcadapt.base.errors import AllocationError

__all__ = ["SlurmCommandError", "slurm_available", "run_slurm", "check_job_id", "check_node_name",
           "check_partition", "parse_sbatch_job_id", "parse_hostnames", "parse_key_values",
           "parse_duration", "parse_cpus_per_node", "parse_squeue", "parse_sinfo_nodes",
           "parse_salloc_job_id", "parse_show_config", "permits_job_expansion", "show_hostnames",
           "JobState", "NodeState", "FINISHED_STATES"]

_JOB_ID = re.compile(r"^[0-9]{1,10}(_[0-9]{1,10})?$")
# Node and partition names: what Slurm itself accepts, without anything a command line or a
# hostlist expression could misread (no spaces, commas, brackets or leading dash).
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$")
_HOSTLIST = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.,\-\[\]]{0,4095}$")

FINISHED_STATES = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
                             "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY",
                             "SPECIAL_EXIT", "REVOKED"})


class SlurmCommandError(AllocationError):
    """A Slurm command failed or printed what could not be parsed."""

    def __init__(self, cmd: Sequence[str], message: str):
        self.cmd = list(cmd)
        super().__init__(f"`{' '.join(cmd)}`: {message}")


def slurm_available() -> bool:
    return all(shutil.which(tool) for tool in ("sbatch", "squeue", "scancel", "scontrol"))


def run_slurm(cmd: Sequence[str], *, timeout: float = 30.0, env: Optional[dict] = None,
              cwd: Optional[str] = None) -> str:
    """Run a Slurm command; returns stdout, raises SlurmCommandError with its stderr."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=cwd, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SlurmCommandError(cmd, f"{cmd[0]} not found; is Slurm installed here?") from None
    except OSError as exc:
        raise SlurmCommandError(cmd, f"could not run: {exc}") from None
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(cmd, f"no answer within {timeout:.0f} s (slurmctld down?)") from None
    if proc.returncode != 0:
        err = proc.stderr.strip() or proc.stdout.strip() or "(no output)"
        raise SlurmCommandError(cmd, f"exit code {proc.returncode}: {err}")
    return proc.stdout


# -- validation -------------------------------------------------------------------------
def check_job_id(value: str) -> str:
    value = str(value).strip()
    if not _JOB_ID.match(value):
        raise AllocationError(f"{value!r} is not a Slurm job id")
    return value


def check_node_name(value: str) -> str:
    if not _NAME.match(value):
        raise AllocationError(f"{value!r} is not a valid node name")
    return value


def check_partition(value: str) -> str:
    if not _NAME.match(value):
        raise AllocationError(f"{value!r} is not a valid partition name")
    return value


def check_hostlist(value: str) -> str:
    if not _HOSTLIST.match(value):
        raise AllocationError(f"{value!r} is not a valid Slurm node list")
    return value


# -- parsers ----------------------------------------------------------------------------
def parse_sbatch_job_id(stdout: str) -> str:
    """``sbatch --parsable`` prints ``JOBID`` or ``JOBID;CLUSTER``."""
    first = stdout.strip().split(";")[0]
    if not _JOB_ID.match(first):
        raise ValueError(f"sbatch printed {stdout.strip()!r}, not a job id")
    return first


def parse_hostnames(stdout: str) -> List[str]:
    """``scontrol show hostnames LIST``: one node name per line."""
    names = [line.strip() for line in stdout.splitlines() if line.strip()]
    for name in names:
        check_node_name(name)
    return names


def show_hostnames(nodelist: str) -> List[str]:
    """Expand a Slurm node list (``n[1-3],m4``) with ``scontrol show hostnames``: Slurm's own
    hostlist parser, not one of ours."""
    return parse_hostnames(run_slurm(["scontrol", "show", "hostnames", check_hostlist(nodelist)]))


def parse_key_values(text: str) -> Dict[str, str]:
    """``scontrol show job|node``: ``Key=Value`` pairs separated by spaces and new lines.

    A value runs to the next `` Key=``, so values with spaces (``Reason=...``) survive."""
    out: Dict[str, str] = {}
    for m in re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:\.]*)=(.*?)(?=\s+[A-Za-z][A-Za-z0-9_/:\.]*=|\s*$)",
                         text, flags=re.M):
        out.setdefault(m.group(1), m.group(2).strip())
    return out


def parse_duration(text: str) -> float:
    """Slurm's ``[days-]hours:minutes:seconds`` (or ``minutes:seconds``); infinity for
    UNLIMITED/INFINITE/NOT_SET; raises ValueError on anything else."""
    t = text.strip()
    if t.upper() in ("UNLIMITED", "INFINITE", "NOT_SET", "N/A"):
        return float("inf")
    days = 0
    if "-" in t:
        d, t = t.split("-", 1)
        days = int(d)
    parts = [int(p) for p in t.split(":")]
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts):
        raise ValueError(f"{text!r} is not a Slurm duration")
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts
    return float(((days * 24 + h) * 60 + m) * 60 + s)


def parse_cpus_per_node(text: str) -> List[int]:
    """``SLURM_JOB_CPUS_PER_NODE``: ``2(x3),1`` means 2, 2, 2, 1."""
    out: List[int] = []
    for part in text.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"{text!r} is not a CPUs-per-node list")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


@dataclass(frozen=True)
class JobState:
    """One line of ``squeue -h -o '%i|%T|%r|%L|%N'``."""

    job_id: str
    state: str
    reason: str
    time_left_s: float
    nodes: str

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES


SQUEUE_FORMAT = "%i|%T|%r|%L|%N"


def parse_squeue(stdout: str) -> Dict[str, JobState]:
    out: Dict[str, JobState] = {}
    for line in stdout.splitlines():
        if not line.strip():
            continue
        fields = line.strip().split("|")
        if len(fields) != 5:
            raise ValueError(f"unexpected squeue line {line!r}")
        job_id, state, reason, left, nodes = fields
        try:
            left_s = parse_duration(left)
        except ValueError:
            left_s = float("nan")
        out[job_id] = JobState(job_id, state, reason, left_s, nodes)
    return out


@dataclass(frozen=True)
class NodeState:
    """One line of ``sinfo -h -N -o '%N|%T|%c|%P'``."""

    name: str
    state: str
    cpus: int
    partition: str

    @property
    def idle(self) -> bool:
        return self.state == "idle"


SINFO_FORMAT = "%N|%T|%c|%P"


def parse_sinfo_nodes(stdout: str) -> Dict[str, NodeState]:
    """Nodes by name (a node listed in several partitions appears once, first partition)."""
    out: Dict[str, NodeState] = {}
    for line in stdout.splitlines():
        if not line.strip():
            continue
        fields = line.strip().split("|")
        if len(fields) != 4:
            raise ValueError(f"unexpected sinfo line {line!r}")
        name, state, cpus, partition = fields
        out.setdefault(name, NodeState(name, state.rstrip("*~#!%$@^-"), int(cpus),
                                       partition.rstrip("*")))
    return out


def parse_salloc_job_id(stderr: str) -> Optional[str]:
    """The job id from salloc's ``Pending|Granted job allocation N`` lines (None if absent)."""
    m = re.search(r"(?:Pending|Granted) job allocation (\d+)", stderr)
    return m.group(1) if m else None


def parse_show_config(stdout: str) -> Dict[str, str]:
    """``scontrol show config``: ``Key = Value`` lines."""
    out: Dict[str, str] = {}
    for line in stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out.setdefault(key.strip(), value.strip())
    return out


def permits_job_expansion(config: Dict[str, str]) -> bool:
    params = config.get("SchedulerParameters", "")
    return "permit_job_expansion" in [p.strip() for p in params.split(",")]
