"""The Slurm allocator: grow by companion allocations (any Slurm) or by job expansion (where
the site permits it: ``--slurm-grow expand``, or ``auto`` to detect it), shrink by giving the
nodes back.

Each joining worker gets a node of its own through a companion job (``sbatch``, one node,
``--exclusive``, excluding the nodes the training already holds) whose batch script
``srun``s the worker; the worker then joins the running job through the MPI port like any
other. This works on any Slurm version and needs no site option. ``sbatch`` returns at once,
so training goes on while the request is pending; a background thread follows the
companion jobs with ``squeue``. A request pending past ``pending_timeout`` is cancelled and
reported, and the grow is abandoned (training goes on at its size).

Shrinking: a worker that leaves exits at once (it has a COMM_WORLD of its own), its ``srun``
and then its companion job end, and the node shows idle in ``sinfo``. Job expansion lives in ``expansion``."""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from importlib import resources
from typing import Dict, List, Optional, Sequence

from hpcadapt.elastic.allocator import launcher_free_environ
from hpcadapt.base.config import COMPANION_OF_VARIABLE
from hpcadapt.base.errors import AllocationError

from .allocation import Allocation, time_left
from .commands import (SINFO_FORMAT, SQUEUE_FORMAT, JobState,
                       SlurmCommandError, check_node_name, check_partition, parse_sbatch_job_id,
                       parse_show_config, parse_sinfo_nodes, parse_squeue,
                       permits_job_expansion, run_slurm, show_hostnames)
from .expansion import JobExpansion

__all__ = ["SlurmAllocator", "CompanionJob", "companion_script"]

log = logging.getLogger(__name__)

MPI_PLUGINS = ("pmi2", "pmix", "none")
GROW_MODES = ("companion", "expand", "auto")


def companion_script() -> str:
    """The batch script a companion job runs (``srun "$@"``), shipped with the package."""
    return str(resources.files("hpcadapt.slurm").joinpath("companion.sbatch"))


def _companion_environ() -> Dict[str, str]:
    """The submitting rank's environment without its launcher's and its job's variables: the
    companion job must not inherit SLURM_JOB_ID, SLURM_NTASKS or PMI_* from this one."""
    env = launcher_free_environ()
    return {k: v for k, v in env.items()
            if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) or k == "SLURM_CONF"}


class CompanionJob:
    """One joining worker in a companion allocation, as the allocator follows it."""

    def __init__(self, job_id: str, submitted_at: float, pending_timeout: float):
        self.job_id = job_id
        self.submitted_at = submitted_at
        self.pending_timeout = pending_timeout
        self.state: Optional[JobState] = None
        self.error: Optional[str] = None

    def failed(self) -> Optional[str]:
        return self.error

    def stop(self) -> None:
        if self.state is not None and self.state.finished:
            return
        try:
            run_slurm(["scancel", self.job_id])
            log.info("companion job %s cancelled by the training", self.job_id)
        except SlurmCommandError as exc:
            log.warning("could not cancel companion job %s: %s", self.job_id, exc)

    @property
    def nodes(self) -> str:
        return self.state.nodes if self.state is not None else ""

    def update(self, state: Optional[JobState], now: float) -> None:
        """Follow the job; decide whether it failed (called by the allocator's thread)."""
        if state is None:
            self.error = self.error or f"companion job {self.job_id} is no longer known to Slurm"
            return
        if state.finished and (self.state is None or not self.state.finished):
            # The training's own record of each companion's end (sacct has Slurm's).
            nodes = state.nodes or self.nodes
            log.info("companion job %s%s ended %s (reason %s)", self.job_id,
                     f" on {nodes}" if nodes else "", state.state, state.reason)
        self.state = state
        if state.finished and self.error is None:
            self.error = (f"companion job {self.job_id} ended ({state.state}, reason "
                          f"{state.reason}) before its worker joined")
        elif state.state == "PENDING" and now - self.submitted_at > self.pending_timeout:
            self.error = (f"companion job {self.job_id} still pending after "
                          f"{self.pending_timeout:.0f} s (reason {state.reason}); cancelled")
            self.stop()


class SlurmAllocator:
    """Workers from Slurm: one node per joining worker, up to ``max_workers`` in all.

    ``allocation`` None: read from the job environment at the first request (only the rank
    that launches workers ever needs it)."""

    def __init__(self, allocation: Optional[Allocation], max_workers: int, *,
                 partition: Optional[str] = None, pending_timeout: float = 60.0,
                 mpi: str = "pmi2", grow: str = "companion", poll_interval: float = 0.5,
                 output: str = "hpcadapt-join-%j.out"):
        if max_workers < 1:
            raise AllocationError(f"--max-workers must be at least 1, got {max_workers}")
        if mpi not in MPI_PLUGINS:
            raise AllocationError(f"unknown srun MPI plugin {mpi!r}; choose from {MPI_PLUGINS}")
        if grow not in GROW_MODES:
            raise AllocationError(f"unknown grow mode {grow!r}; choose from {GROW_MODES}")
        self.grow = grow
        self._expansion: Optional[JobExpansion] = None
        self._allocation = allocation
        self.max_workers = max_workers
        self._partition = check_partition(partition) if partition else None
        self.pending_timeout = pending_timeout
        self.mpi = mpi
        self.poll_interval = poll_interval
        self.output = output
        self.jobs: List[CompanionJob] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    @property
    def allocation(self) -> Allocation:
        if self._allocation is None:
            self._allocation = Allocation.from_environment()
        return self._allocation

    @property
    def partition(self) -> str:
        return self._partition or self.allocation.partition

    def capacity(self) -> int:
        return self.max_workers

    def _grow_mode(self) -> str:
        """companion or expand; ``auto`` asks ``scontrol show config`` once."""
        if self.grow == "auto":
            config = parse_show_config(run_slurm(["scontrol", "show", "config"]))
            self.grow = "expand" if permits_job_expansion(config) else "companion"
            log.info("the site %s job expansion: growing by %s",
                     "permits" if self.grow == "expand" else "does not permit",
                     "expanding the job" if self.grow == "expand" else "companion jobs")
        return self.grow

    def _request_options(self) -> List[str]:
        """Partition and time limit for node requests: a new node need not outlive the job."""
        options = [f"--partition={self.partition}"] if self.partition else []
        left = time_left(self.allocation.job_id)
        if math.isfinite(left):
            options.append(f"--time={max(1, math.ceil(left / 60))}")
        return options

    # -- grow -----------------------------------------------------------------------------
    def _nodes_in_use(self) -> List[str]:
        if self._expansion is not None:
            return self._expansion.nodes()
        with self._lock:
            live = [j for j in self.jobs if j.error is None]
        used = list(self.allocation.nodes)
        for job in live:
            if job.nodes:
                used += show_hostnames(job.nodes)
        return sorted(set(check_node_name(n) for n in used))

    def _check_partition(self, count: int, in_use: Sequence[str]) -> None:
        cmd = ["sinfo", "-h", "-N", "-o", SINFO_FORMAT] + (["-p", self.partition]
                                                            if self.partition else [])
        try:
            nodes = parse_sinfo_nodes(run_slurm(cmd))
        except ValueError as exc:
            raise SlurmCommandError(cmd, f"unparsable output: {exc}") from None
        if not nodes:
            raise AllocationError(f"partition {self.partition!r} has no nodes or does not "
                                  f"exist (sinfo lists none); pass --slurm-partition with one "
                                  f"that `sinfo -s` shows")
        free = [n for n in nodes if n not in in_use]
        if count > len(free):
            raise AllocationError(
                f"{count} more node(s) requested, but partition {self.partition!r} has "
                f"{len(nodes)} nodes and {len(nodes) - len(free)} of them are this job's")

    def launch(self, argvs: Sequence[Sequence[str]], env: dict) -> list:
        in_use = self._nodes_in_use()
        self._check_partition(len(argvs), in_use)
        submit_env = {**_companion_environ(), **env}
        if self._grow_mode() == "expand":
            if self._expansion is None:
                self._expansion = JobExpansion(
                    self.allocation.job_id, self.allocation.nodes, env=submit_env,
                    mpi=self.mpi, pending_timeout=self.pending_timeout,
                    extra_sbatch=self._request_options)
            return self._expansion.launch(argvs, submit_env)
        # A companion belongs to its training: never requeued on its own (a requeued
        # training grows again if it needs to), named and commented after it; its worker
        # knows whose it is, so that a signal to the companion ends the worker, not the job.
        training = self.allocation.job_id
        submit_env[COMPANION_OF_VARIABLE] = training
        base = ["sbatch", "--parsable", "--nodes=1", "--ntasks=1", "--exclusive",
                "--no-requeue", f"--job-name=hpcadapt-join-{training}",
                f"--comment=hpcadapt companion of job {training}",
                f"--output={self.output}", f"--exclude={','.join(in_use)}"]
        base += self._request_options()
        started: List[CompanionJob] = []
        try:
            for argv in argvs:
                cmd = base + [companion_script(), f"--mpi={self.mpi}", "--nodes=1",
                              "--ntasks=1", sys.executable] + list(argv)
                try:
                    job_id = parse_sbatch_job_id(run_slurm(cmd, env=submit_env))
                except ValueError as exc:
                    raise SlurmCommandError(cmd[:1], str(exc)) from None
                started.append(CompanionJob(job_id, time.monotonic(), self.pending_timeout))
                log.info("companion job %s submitted for a joining worker", job_id)
        except AllocationError:
            for job in started:
                job.stop()
            raise
        with self._lock:
            self.jobs += started
        if self._thread is None:
            self._thread = threading.Thread(target=self._follow, name="hpcadapt-squeue",
                                            daemon=True)
            self._thread.start()
        self._wake.set()
        return started

    # -- following the companion jobs ------------------------------------------------------
    def _follow(self) -> None:
        while not self._closed:
            self._wake.wait(self.poll_interval)
            self._wake.clear()
            with self._lock:
                watched = [j for j in self.jobs if j.error is None]
            if not watched:
                continue
            try:
                ids = ",".join(j.job_id for j in watched)
                states = parse_squeue(run_slurm(["squeue", "-h", "-t", "all", "-j", ids,
                                                 "-o", SQUEUE_FORMAT]))
            except (SlurmCommandError, ValueError) as exc:
                log.warning("following companion jobs: %s", exc)
                continue
            now = time.monotonic()
            for job in watched:
                job.update(states.get(job.job_id), now)
            with self._lock:
                # Jobs that ended (their worker left, or they failed) need no more following.
                self.jobs = [j for j in self.jobs
                             if not (j.state is not None and j.state.finished)]

    # -- shrink -----------------------------------------------------------------------------
    def released(self, count: int) -> None:
        """The leavers exit at once; their companion jobs end with them."""
        if self._expansion is not None:
            self._expansion.released(count)
            return
        log.info("%d worker(s) left; their companion jobs end as they exit", count)
        self._wake.set()

    def reap(self) -> int:
        """Nothing to collect here: companion jobs are Slurm's, not this process's children."""
        return 0

    def close(self, wait_s: float = 30.0) -> None:
        """Cancel companions still pending; give running ones (workers finishing with us)
        ``wait_s`` to end, then cancel them."""
        if self._expansion is not None:
            self._expansion.close(wait_s)
        deadline = time.monotonic() + wait_s
        with self._lock:
            jobs = list(self.jobs)
        for job in jobs:
            if job.state is None or job.state.state == "PENDING":
                job.stop()
        while time.monotonic() < deadline:
            with self._lock:
                alive = [j for j in self.jobs if not (j.state and j.state.finished)
                         and j.error is None]
            if not alive:
                break
            self._wake.set()
            time.sleep(self.poll_interval)
        self._closed = True
        self._wake.set()
        with self._lock:
            for job in self.jobs:
                job.stop()  # does nothing for a job that has finished
            self.jobs.clear()
        if self._thread is not None:
            self._thread.join(timeout=10)
