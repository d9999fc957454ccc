"""Allocators: where new workers come from and where leaving ones go back.

An allocator starts joining worker processes (they initialise while training goes on and
then connect to the running job through an MPI port) and takes back the resources of workers
that leave. The local allocator uses slots on this host; the Slurm one (hpcadapt.slurm) asks
the scheduler for nodes."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence

from hpcadapt.base.errors import AllocationError, ConfigurationError

__all__ = ["Allocator", "Worker", "LocalAllocator", "LAUNCHERS", "find_mpiexec"]

log = logging.getLogger(__name__)

LAUNCHERS = ("process", "spawn")


class Worker(Protocol):
    """A joining worker process as its allocator sees it."""

    def failed(self) -> Optional[str]:
        """Why the worker died before joining (None while it is alive)."""

    def stop(self) -> None:
        """Kill a worker that will not join (abandoned resize)."""


class Allocator(Protocol):
    """Where workers come from. Implementations: LocalAllocator, hpcadapt.slurm.SlurmAllocator."""

    def capacity(self) -> int:
        """The largest world this allocator can provide."""

    def launch(self, argvs: Sequence[Sequence[str]], env: dict) -> List[Worker]:
        """Start one worker per entry, running ``python ARGV``; all or none (raises
        AllocationError, having stopped what it started)."""

    def released(self, count: int) -> None:
        """``count`` workers have left; their resources may go back."""

    def reap(self) -> int:
        """Collect what ended of the workers it started (no zombies); called at every step
        boundary, so cheap. Returns how many were collected."""

    def close(self) -> None:
        """Stop whatever the allocator still runs."""


@dataclass
class _ProcessWorker:
    """A worker started as its own MPI job (``mpiexec -n 1``): its COMM_WORLD is its own, so
    it can leave early, and its crash cannot take the running job down."""

    proc: subprocess.Popen

    def failed(self) -> Optional[str]:
        code = self.proc.poll()
        return None if code is None else f"exited with code {code} during start-up"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - kill does not fail on Linux
            log.error("worker %d did not stop", self.proc.pid)


class _SpawnedWorker:
    """A worker started by ``MPI_Comm_spawn`` from a background thread of rank 0, so the
    other ranks keep training while it starts. Under MPICH's mpiexec a crashing spawned
    process ends the whole job unless mpiexec runs with ``-disable-auto-cleanup``."""

    def __init__(self, argv: Sequence[str], env: dict):
        from hpcadapt.comm.mpi import MPI  # here, not at import: importing it starts MPI

        self.error: Optional[str] = None
        info = MPI.Info.Create()
        # The joining worker reads its settings from the command line; environment
        # variables are passed explicitly where the MPI supports it.
        env_text = "\n".join(f"{k}={v}" for k, v in env.items())
        if env_text:
            info.Set("env", env_text)
        self._thread = threading.Thread(target=self._spawn, args=(list(argv), info), daemon=True)
        self._thread.start()

    def _spawn(self, argv: List[str], info) -> None:
        from hpcadapt.comm.mpi import MPI

        try:
            inter = MPI.COMM_SELF.Spawn(sys.executable, args=argv, maxprocs=1, info=info)
            # The worker joins through the port like any other; dropping the spawn link lets
            # it leave (and exit) on its own later. The worker disconnects its side too.
            inter.Disconnect()
        except MPI.Exception as exc:
            self.error = f"MPI_Comm_spawn failed: {exc}"
        finally:
            info.Free()

    def failed(self) -> Optional[str]:
        return self.error

    def stop(self) -> None:
        # A spawned worker that will not join exits when its connect attempt times out
        # (MPICH's CVAR_CH4_COMM_CONNECT_TIMEOUT); there is no pid to kill here.
        self._thread.join(timeout=30)


_LAUNCH_VARS = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID",
                "OMPI_COMM_WORLD_", "OMPI_MCA_orte_", "OMPI_MCA_ess_")


def launcher_free_environ() -> dict:
    """This process's environment without the variables its own MPI launcher set: a worker
    started from here must register with its new launcher, not with ours."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_VARS)}


def _agent_output():
    """Under ``hpcadapt.agent``: the agent's own stdout and stderr, opened anew (appending),
    for a worker's launcher. Without the agent (None, None) the launcher inherits this
    process's, which are pipes to this rank's launcher: they break when this rank dies, and
    a worker that outlives it (its role moved) must keep its output."""
    from hpcadapt.base import agent_files as agent

    pid = agent.agent_pid()
    if pid is None:
        return None, None
    opened = []
    try:
        for fd in (1, 2):
            opened.append(os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND |
                                  os.O_CLOEXEC))
    except OSError as exc:
        for f in opened:
            os.close(f)
        log.debug("the agent's output cannot be opened (%s): the worker inherits ours", exc)
        return None, None
    return opened[0], opened[1]


def find_mpiexec(given: Optional[str]) -> str:
    """``given``, else the mpiexec beside this Python, else the one on PATH."""
    if given:
        return given
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.path.exists(beside) else shutil.which("mpiexec")
    if not found:
        raise AllocationError("no mpiexec to start workers with; install an MPI or pass "
                              "--launcher spawn")
    return found


class LocalAllocator:
    """Slots on this host, up to ``max_workers`` in all."""

    def __init__(self, max_workers: int, *, launcher: str = "process",
                 mpiexec: Optional[str] = None):
        if max_workers < 1:
            raise ConfigurationError(f"--max-workers must be at least 1, got {max_workers}")
        if launcher not in LAUNCHERS:
            raise ConfigurationError(f"unknown launcher {launcher!r}; choose from {list(LAUNCHERS)}")
        self.max_workers = max_workers
        self.launcher = launcher
        self._mpiexec = mpiexec
        self._workers: List[object] = []

    def capacity(self) -> int:
        return self.max_workers

    def _find_mpiexec(self) -> str:
        return find_mpiexec(self._mpiexec)

    def launch(self, argvs: Sequence[Sequence[str]], env: dict) -> List[Worker]:
        workers: List[Worker] = []
        try:
            for argv in argvs:
                if self.launcher == "spawn":
                    workers.append(_SpawnedWorker(argv, env))
                else:
                    cmd = [self._find_mpiexec(), "-n", "1", sys.executable] + list(argv)
                    out, err = _agent_output()
                    try:
                        # A session of its own: rank 0's launcher, cleaning up after rank
                        # 0 dies, signals rank 0's process group, not the workers'.
                        proc = subprocess.Popen(cmd, env={**launcher_free_environ(), **env},
                                                stdin=subprocess.DEVNULL, stdout=out,
                                                stderr=err, start_new_session=True)
                    finally:
                        for f in (out, err):
                            if f is not None:
                                os.close(f)
                    workers.append(_ProcessWorker(proc))
        except OSError as exc:
            for w in workers:
                w.stop()
            raise AllocationError(f"could not start a worker: {exc}") from exc
        self._workers.extend(workers)
        return workers

    def released(self, count: int) -> None:
        log.debug("%d local slots released", count)

    def reap(self) -> int:
        """Collect the launchers of workers that have exited (no zombie per grow/shrink
        cycle); cheap enough for every step boundary. Returns how many were collected."""
        alive = []
        for w in self._workers:
            if isinstance(w, _ProcessWorker) and w.proc.poll() is not None:
                continue
            alive.append(w)
        collected = len(self._workers) - len(alive)
        self._workers = alive
        return collected

    def close(self, timeout: float = 30.0) -> None:
        for w in self._workers:
            if isinstance(w, _ProcessWorker):
                try:
                    w.proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    log.warning("worker %d still running at exit; killing it", w.proc.pid)
                    w.stop()
            elif isinstance(w, _SpawnedWorker):
                w.stop()
        self._workers.clear()
