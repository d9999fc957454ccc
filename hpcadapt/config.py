"""The one place that reads environment variables (``HPCADAPT_*`` and ``SLURM_*``)."""

from __future__ import annotations

import os
import re
from typing import Optional

__all__ = [
    "bucket_bytes",
    "check_collectives",
    "log_level",
    "slurm_node_name",
    "slurm_job_id",
    "launched_by_mpi",
]

_DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


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
        from .errors import ConfigurationError

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


def slurm_job_id() -> Optional[int]:
    """The Slurm job id (``SLURM_JOB_ID``) as an integer; None outside a job or if malformed."""
    raw = os.environ.get("SLURM_JOB_ID", "")
    return int(raw) if raw.isdigit() else None


def launched_by_mpi() -> bool:
    """True when a launcher (mpiexec/hydra, Open MPI, srun with PMI) started this process."""
    keys = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS")
    return any(k in os.environ for k in keys)
