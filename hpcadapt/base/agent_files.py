"""The agent's folder, as the job's workers see it: the coordinator writes its pid and, at
the end, the job's exit code there; the agent (``python -m hpcadapt.agent``) reads them.
Without an agent (``HPCADAPT_AGENT_DIR`` unset) every call here does nothing."""

from __future__ import annotations

import os
import tempfile
from typing import Optional

from hpcadapt.base import config

__all__ = ["record_coordinator", "record_exit_code", "agent_pid", "stopping", "write_file",
           "read_int"]

COORDINATOR_FILE = "coordinator"
EXIT_FILE = "exit-code"
AGENT_FILE = "agent"
STOPPING_FILE = "stopping"


def record_coordinator() -> None:
    """The new coordinator (rank 0) writes its pid for the agent, if there is one."""
    write_file(COORDINATOR_FILE, str(os.getpid()))


def agent_pid() -> Optional[int]:
    """The agent's pid, when this process runs under one."""
    folder = config.agent_dir()
    return read_int(folder, AGENT_FILE) if folder is not None else None


def record_exit_code(code: int) -> None:
    """The coordinator's exit code, which the agent returns."""
    write_file(EXIT_FILE, str(int(code)))


def stopping() -> bool:
    """Whether the agent was asked to stop the job (a worker's death is then not recovered
    from: the job is ending)."""
    folder = config.agent_dir()
    return folder is not None and os.path.exists(os.path.join(folder, STOPPING_FILE))


def write_file(name: str, text: str, folder: Optional[str] = None) -> None:
    folder = folder or config.agent_dir()
    if folder is None:
        return
    # A private folder of the agent's: a temporary file created exclusively there, renamed.
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=folder)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)
    os.replace(tmp, os.path.join(folder, name))


def read_int(folder: str, name: str) -> Optional[int]:
    try:
        with open(os.path.join(folder, name), encoding="ascii") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None
