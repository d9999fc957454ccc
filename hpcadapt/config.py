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


JOIN_DIR_VARIABLE = "HPCADAPT_JOIN_DIR"


def take_join_dir() -> Optional[str]:
    """``HPCADAPT_JOIN_DIR``: set by the job for a worker it starts to join it (the folder
    with the job's port). Removed from the environment once read, so that nothing this
    worker starts later inherits it."""
    return os.environ.pop(JOIN_DIR_VARIABLE, None) or None
