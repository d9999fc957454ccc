"""Starting MPI jobs from a benchmark driver."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else (shutil.which("mpiexec") or "mpiexec")


def env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")]))


def run_mpi(ranks: int, args: List[str], *, timeout: float = 3600) -> None:
    cmd = [mpiexec(), "-n", str(ranks), sys.executable] + args
    proc = subprocess.run(cmd, env=env(), cwd=ROOT, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(cmd)}")


def run_worker(script: str, ranks: int, extra: List[str]) -> dict:
    """Run ``script`` on ``ranks`` ranks; it writes its result JSON to ``--out``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        run_mpi(ranks, [str(HERE / script), "--out", out] + extra)
        with open(out, encoding="utf-8") as f:
            return json.load(f)
