"""Starting MPI jobs from a benchmark driver."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

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


class Skipped(Exception):
    """Raised by a driver that cannot run here (say, Slurm missing and no root to install
    it): the runner reports the benchmark as skipped, with this message as the reason."""


def quick_defaults(ap: argparse.ArgumentParser, extra: List[str], **defaults) -> None:
    """Add ``--quick`` to ``ap``; with it in ``extra`` the options named in ``defaults`` take
    those smaller values, unless given on the command line."""
    ap.add_argument("--quick", action="store_true",
                    help="smaller sizes, fewer steps and repeats (seconds, not minutes): "
                         + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in defaults.items()))
    if "--quick" in extra:
        ap.set_defaults(**defaults)


def _stop_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


class TempSession:
    """One folder for everything a benchmark run writes to the temporary directory: the
    drivers' folders, and through TMPDIR the MPI ranks' files (the library's join and agent
    folders, loader workers' ``pymp-*``). Removed by ``close`` (success, failure, Ctrl-C,
    and SIGTERM, which raises SystemExit so that every ``finally`` runs and every child
    started with ``subprocess.run`` is killed) unless ``keep``."""

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self.path = tempfile.mkdtemp(prefix="hpcadapt-bench-")
        self._old_tmpdir: Optional[str] = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = self.path
        tempfile.tempdir = self.path
        self._old_term = signal.signal(signal.SIGTERM, _stop_on_sigterm)

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._old_term)
        tempfile.tempdir = None
        if self._old_tmpdir is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = self._old_tmpdir
        if self.keep:
            print(f"temporary files kept in {self.path} (--keep-tmp)", flush=True)
        else:
            shutil.rmtree(self.path, ignore_errors=True)
