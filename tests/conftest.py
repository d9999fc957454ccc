"""Shared fixtures: the world, and how to launch MPI jobs from a test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mpiexec() -> str:
    """The mpiexec beside this Python (the venv's MPICH wheel), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec on this machine")
    return found


def run_mpi(n: int, args: List[str], *, timeout: float = 300, env: Optional[dict] = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on ``n`` MPI ranks and return the finished process."""
    cmd = [mpiexec(), "-n", str(n), sys.executable] + args
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed with {proc.returncode}:\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="session")
def world():
    import hpcadapt

    return hpcadapt.init()
