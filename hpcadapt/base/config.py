"""The one place that reads environment variables (``HPCADAPT_*`` and ``SLURM_*``)."""

from __future__ import annotations

import os
import re
from typing import Optional

__all__ = [
    "launch_rank",
    "launch_size",
    "bucket_bytes",
    "check_collectives",
    "log_level",
    "slurm_node_name",
    "state_transport",
    "agent_dir",
    "ompi_fault_tolerance",
]

_DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


# What the launchers (MPICH's Hydra, Open MPI, PMIx, Slurm) tell each process, before MPI.
_RANK_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")


def _first_int(names) -> Optional[int]:
    for name in names:
        text = os.environ.get(name, "")
        if text.isdigit():
            return int(text)
    return None


def launch_rank() -> Optional[int]:
    """This process's rank in its launch (mpiexec/srun), read without starting MPI; None
    when no launcher says."""
    return _first_int(_RANK_VARIABLES)


def launch_size() -> Optional[int]:
    """The number of processes of this launch, as the launcher says (None: no launcher)."""
    return _first_int(_SIZE_VARIABLES)


def ompi_fault_tolerance() -> bool:
    """Whether Open MPI's launcher started this process with ``--with-ft ulfm`` (it passes
    the MCA setting ``mpi_ft_enable`` to every process through the environment)."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes")


def bucket_bytes() -> int:
    """Fusion bucket size in bytes, ``HPCADAPT_BUCKET_BYTES`` (default 4 MiB)."""
    raw = os.environ.get("HPCADAPT_BUCKET_BYTES")
    if raw is None:
        return _DEFAULT_BUCKET_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value <= 0:
        from hpcadapt.base.errors import ConfigurationError

        raise ConfigurationError(
            f"HPCADAPT_BUCKET_BYTES={raw!r} is not a positive integer number of bytes"
        )
    return value


def check_collectives() -> bool:
    """``HPCADAPT_CHECK_COLLECTIVES=1`` compares shapes and dtypes across ranks before
    every collective (one extra small allgather each): a debugging aid."""
    return os.environ.get("HPCADAPT_CHECK_COLLECTIVES", "0") not in ("", "0", "false", "no")


def log_level() -> str:
    """Log level for the entry point's handler, ``HPCADAPT_LOG_LEVEL`` (default INFO)."""
    return os.environ.get("HPCADAPT_LOG_LEVEL", "INFO").upper()


def slurm_node_name() -> Optional[str]:
    """Slurm's name for this node (``SLURMD_NODENAME``), validated; None outside Slurm.

    Emulated nodes on one machine share a hostname, so Slurm's name is the one that
    tells them apart."""
    name = os.environ.get("SLURMD_NODENAME")
    if name and _NODE_NAME.match(name):
        return name
    return None


def slurm_job_id() -> Optional[str]:
    """The Slurm job this process runs in (``SLURM_JOB_ID``, digits, ``_`` for an array's
    task), None outside Slurm or when malformed."""
    value = os.environ.get("SLURM_JOB_ID", "")
    return value if value and value.replace("_", "").isdigit() else None


JOIN_DIR_VARIABLE = "HPCADAPT_JOIN_DIR"


def take_join_dir() -> Optional[str]:
    """``HPCADAPT_JOIN_DIR``: set by the job for a worker it starts to join it (the folder
    with the job's port). Removed from the environment once read, so that nothing this
    worker starts later inherits it."""
    return os.environ.pop(JOIN_DIR_VARIABLE, None) or None


COMPANION_OF_VARIABLE = "HPCADAPT_COMPANION_OF"


def take_companion_of() -> Optional[str]:
    """``HPCADAPT_COMPANION_OF``: the Slurm job id of the training that a companion job's
    worker joins (set by the Slurm allocator when it submits the companion); None in any
    other process. Removed once read, like the join folder."""
    return os.environ.pop(COMPANION_OF_VARIABLE, None) or None


SPAWNED_VARIABLE = "HPCADAPT_SPAWNED"


SPARE_OF_VARIABLE = "HPCADAPT_SPARE_OF"

SPAWNED_BY_VARIABLE = "HPCADAPT_SPAWNED_BY"  # NODE:PID of the rank 0 that spawned a joiner


def take_spare_mark() -> str:
    """``HPCADAPT_SPARE_OF``: ``NODE:PID`` of the rank 0 that spawned this worker as a warm
    spare (Open MPI); "" in any other worker. Removed once read."""
    return os.environ.pop(SPARE_OF_VARIABLE, "")


def take_spawned_mark() -> bool:
    """``HPCADAPT_SPAWNED``: set (through MPI_Comm_spawn's info) in a worker that the job
    started with MPI_Comm_spawn to join it (Open MPI); removed once read, like the join
    folder."""
    return os.environ.pop(SPAWNED_VARIABLE, "") == "1"


_STATE_TRANSPORTS = ("auto", "mpi")


def state_transport() -> str:
    """How joins and recoveries move the training state, ``HPCADAPT_STATE_TRANSPORT``:
    ``auto`` (the default: through a memory file between processes of one node, over MPI
    otherwise) or ``mpi`` (always over MPI, for comparison)."""
    value = os.environ.get("HPCADAPT_STATE_TRANSPORT", "auto").strip().lower() or "auto"
    if value not in _STATE_TRANSPORTS:
        from hpcadapt.base.errors import ConfigurationError

        raise ConfigurationError(f"HPCADAPT_STATE_TRANSPORT={value!r} is not one of "
                                 f"{', '.join(_STATE_TRANSPORTS)}")
    return value


AGENT_DIR_VARIABLE = "HPCADAPT_AGENT_DIR"


def agent_dir() -> Optional[str]:
    """``HPCADAPT_AGENT_DIR``: the private folder of the ``hpcadapt.agent`` this job runs
    under (its workers inherit it), or None without an agent. Only a folder that exists,
    is this user's and is private counts: anything else is ignored."""
    path = os.environ.get(AGENT_DIR_VARIABLE)
    if not path:
        return None
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    import stat

    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path
