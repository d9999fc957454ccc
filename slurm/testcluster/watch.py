"""Submit a job script and record what Slurm shows of it: the tests and the slurm-resize
benchmark assert and measure from these observations, taken as a user would (squeue, sinfo)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, TypeVar

from hpcadapt.slurm.commands import (SINFO_FORMAT, SQUEUE_FORMAT, JobState, NodeState,
                                     SlurmCommandError, parse_sbatch_job_id, parse_sinfo_nodes,
                                     parse_squeue, run_slurm)

__all__ = ["Observation", "JobWatcher", "submit", "job_environment", "job_state", "wait_for",
           "WaitFailed"]

T = TypeVar("T")


@dataclass(frozen=True)
class Observation:
    """One look at the cluster: every job squeue lists, and every node's state."""

    unix_time: float
    jobs: Dict[str, JobState]
    names: Dict[str, str]        # job id -> job name
    nodes: Dict[str, NodeState]

    def named(self, prefix: str) -> List[JobState]:
        return [j for i, j in self.jobs.items() if self.names.get(i, "").startswith(prefix)]


def job_environment(python: str, **extra: object) -> Dict[str, str]:
    """This environment for a job script (PYTHON and ``extra`` set), without the variables of
    a job or MPI launcher it may itself run in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_JOB", "PMI_"))}
    env.update(PYTHON=python, **{k: str(v) for k, v in extra.items()})
    return env


def submit(script: str, args: Sequence[str] = (), *, env: Optional[Mapping[str, str]] = None,
           cwd: Optional[str] = None, sbatch_options: Sequence[str] = ()) -> str:
    """``sbatch --parsable [options] SCRIPT ARGS`` run in ``cwd``; returns the job id."""
    cmd = ["sbatch", "--parsable"] + list(sbatch_options) + [script] + list(args)
    return parse_sbatch_job_id(run_slurm(cmd, env=dict(env) if env else None, cwd=cwd))


def job_state(job_id: str) -> Optional[JobState]:
    """What squeue shows of the job now (None if it is not known, or squeue did not answer)."""
    try:
        return parse_squeue(run_slurm(["squeue", "-h", "-t", "all", "-j", job_id,
                                       "-o", SQUEUE_FORMAT])).get(job_id)
    except (SlurmCommandError, ValueError):
        return None


class WaitFailed(RuntimeError):
    """What was awaited did not happen: the job ended first, or the deadline passed."""


def wait_for(predicate: Callable[[], Optional[T]], what: str, job: Optional[str] = None,
             timeout: float = 300.0, interval: float = 0.25) -> T:
    """Poll ``predicate()`` until it returns something true, and return that. Waits for an
    event, not for a time: ``timeout`` is only a generous deadline against a hang.

    With ``job`` (a job id), fail early when that job has finished (a requeued job has not):
    the predicate is asked once more after the job's end, so an event just before it counts.
    Raises WaitFailed saying ``what`` was awaited and why the wait ended."""
    deadline = time.monotonic() + timeout
    next_check = 0.0
    while True:
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if job is not None and now >= next_check:
            next_check = now + 1.0
            state = job_state(job)
            if state is not None and state.finished:
                value = predicate()
                if value:
                    return value
                raise WaitFailed(f"job {job} ended ({state.state}, reason {state.reason}) "
                                 f"before {what}")
        if now >= deadline:
            raise WaitFailed(f"no {what} within {timeout:.0f} s" +
                             (f" (job {job}: {getattr(job_state(job), 'state', 'unknown')})"
                              if job is not None else ""))
        time.sleep(interval)


class JobWatcher:
    """Polls squeue and sinfo every ``interval`` seconds in a thread, keeping every look."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.observations: List[Observation] = []
        self._stop = threading.Event()
        self._looking = threading.Lock()  # keeps the observations in the order of the looks
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def look(self) -> Observation:
        jobs_text = run_slurm(["squeue", "-h", "-t", "all", "-o", SQUEUE_FORMAT])
        names_text = run_slurm(["squeue", "-h", "-t", "all", "-o", "%i|%j"])
        nodes_text = run_slurm(["sinfo", "-h", "-N", "-o", SINFO_FORMAT])
        names = dict(line.split("|", 1) for line in names_text.splitlines() if "|" in line)
        return Observation(time.time(), parse_squeue(jobs_text), names,
                           parse_sinfo_nodes(nodes_text))

    def _look_and_keep(self) -> None:
        with self._looking:
            try:
                self.observations.append(self.look())
            except Exception:  # a slow answer is skipped, the next look counts
                pass

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._look_and_keep()
            self._stop.wait(self.interval)

    def __enter__(self) -> "JobWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def wait_until_gone(self, job_id: str, timeout: float) -> JobState:
        """Wait until the job has finished (and is not requeued); returns its last state.
        A squeue that does not answer in time (a busy machine) is asked again."""
        def finished() -> Optional[JobState]:
            state = job_state(job_id)
            return state if state is not None and state.finished else None

        try:
            state = wait_for(finished, f"end of job {job_id}", timeout=timeout, interval=0.5)
        except WaitFailed as exc:
            raise TimeoutError(str(exc)) from None
        if self._thread.is_alive():
            self._look_and_keep()  # so that the observations end after the job's end
        return state
