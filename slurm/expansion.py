"""Growing by job expansion, where the site permits it (``SchedulerParameters=
permit_job_expansion``): the job itself gains the nodes, and workers start there as steps.

Grow: ``salloc --no-shell --dependency=expand:JOB -N k --exclude=<the job's nodes>`` (in a
thread, so training goes on while it is pending), then ``scontrol update JobId=NEW
NumNodes=0`` and ``scontrol update JobId=JOB NumNodes=ALL`` hand its nodes to the job; one
``srun --jobid=JOB --nodelist=NODE`` per worker starts it (one step per worker, so each has a
COMM_WORLD of its own and can leave alone). Shrink: once a leaver's step has ended,
``scontrol update JobId=JOB NodeList=<the rest>`` gives its node back."""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from hpcadapt.base.errors import AllocationError

from .commands import (SlurmCommandError, check_node_name, parse_salloc_job_id, run_slurm,
                       show_hostnames)

__all__ = ["ExpansionWorker", "JobExpansion"]

log = logging.getLogger(__name__)


class ExpansionWorker:
    """A joining worker started as a step of the job on a node the job gained."""

    def __init__(self, expansion: "JobExpansion", argv: Sequence[str], env: Dict[str, str]):
        self.expansion = expansion
        self.argv = list(argv)
        self.env = env
        self.node: Optional[str] = None
        self.proc: Optional[subprocess.Popen] = None
        self.error: Optional[str] = None
        self.node_returned = False

    def failed(self) -> Optional[str]:
        if self.error:
            return self.error
        if self.proc is not None and self.proc.poll() is not None:
            return f"srun on {self.node} exited with code {self.proc.returncode} during start-up"
        return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.expansion.return_nodes([self])


class JobExpansion:
    """Adds nodes to job ``job_id`` and gives them back; ``base_nodes`` are the job's own."""

    def __init__(self, job_id: str, base_nodes: Sequence[str], *, env: Dict[str, str],
                 mpi: str, pending_timeout: float, extra_sbatch: Callable[[], List[str]]):
        self.job_id = job_id
        self.base_nodes = list(base_nodes)
        self.env = env
        self.mpi = mpi
        self.pending_timeout = pending_timeout
        self.extra_options = extra_sbatch     # partition and time limit, known at request time
        self.added: List[str] = []            # nodes the job gained and still holds
        self.workers: List[ExpansionWorker] = []
        self._lock = threading.Lock()

    def nodes(self) -> List[str]:
        with self._lock:
            return self.base_nodes + self.added

    # -- grow ---------------------------------------------------------------------------
    def launch(self, argvs: Sequence[Sequence[str]],
               env: Optional[Dict[str, str]] = None) -> List[ExpansionWorker]:
        """Start the workers (``env``: their environment, by default the expansion's)."""
        workers = [ExpansionWorker(self, argv, env if env is not None else self.env)
                   for argv in argvs]
        with self._lock:
            self.workers += workers
        threading.Thread(target=self._grow, args=(workers,), name="hpcadapt-expand",
                         daemon=True).start()
        return workers

    def _grow(self, workers: List[ExpansionWorker]) -> None:
        try:
            nodes = self._expand(len(workers))
        except (AllocationError, ValueError, OSError, subprocess.SubprocessError) as exc:
            for w in workers:
                w.error = str(exc)
            return
        for w, node in zip(workers, nodes):
            w.node = node
            cmd = ["srun", f"--jobid={self.job_id}", f"--nodelist={node}", "--nodes=1",
                   "--ntasks=1", f"--mpi={self.mpi}", sys.executable] + w.argv
            try:
                with open(f"hpcadapt-join-{self.job_id}-{node}.out", "ab") as out:
                    w.proc = subprocess.Popen(cmd, env=w.env, stdin=subprocess.DEVNULL,
                                              stdout=out, stderr=subprocess.STDOUT)
            except OSError as exc:
                w.error = f"could not run srun on {node}: {exc}"

    def _expand(self, count: int) -> List[str]:
        """Request ``count`` nodes with an expansion job and merge them into the job."""
        cmd = ["salloc", "--no-shell", f"--dependency=expand:{self.job_id}",
               f"--nodes={count}", "--exclusive", f"--exclude={','.join(self.nodes())}",
               f"--job-name=hpcadapt-expand-{self.job_id}"] + self.extra_options()
        with tempfile.TemporaryFile("w+") as err:
            try:
                proc = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=err, text=True)
            except OSError as exc:
                raise SlurmCommandError(cmd, f"could not run: {exc}") from None
            try:
                code = proc.wait(timeout=self.pending_timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()  # salloc revokes a pending request when it is stopped
                proc.wait(timeout=30)
                err.seek(0)
                new = parse_salloc_job_id(err.read())
                if new:
                    run_slurm(["scancel", new])
                raise AllocationError(f"expansion of job {self.job_id} by {count} node(s) "
                                      f"(job {new}) still pending after "
                                      f"{self.pending_timeout:.0f} s; cancelled") from None
            err.seek(0)
            text = err.read()
        new = parse_salloc_job_id(text)
        if code != 0 or new is None:
            raise SlurmCommandError(cmd, f"exit code {code}: {text.strip() or '(no output)'}")
        try:
            listed = run_slurm(["squeue", "-h", "-j", new, "-o", "%N"]).strip()
            nodes = show_hostnames(listed)
            run_slurm(["scontrol", "update", f"JobId={new}", "NumNodes=0"])
            run_slurm(["scontrol", "update", f"JobId={self.job_id}", "NumNodes=ALL"])
        except AllocationError:
            run_slurm(["scancel", new])
            raise
        with self._lock:
            self.added += [check_node_name(n) for n in nodes]
        log.info("job %s expanded by %s (expansion job %s)", self.job_id, ",".join(nodes), new)
        return nodes

    # -- shrink ---------------------------------------------------------------------------
    def return_nodes(self, workers: Sequence[ExpansionWorker]) -> None:
        """Give the nodes of these (ended) workers back: shrink the job's node list."""
        with self._lock:
            gone = [w.node for w in workers if w.node and not w.node_returned]
            for w in workers:
                w.node_returned = True
            self.added = [n for n in self.added if n not in gone]
            keep = self.base_nodes + self.added
        if not gone:
            return
        try:
            run_slurm(["scontrol", "update", f"JobId={self.job_id}", f"NodeList={','.join(keep)}"])
            log.info("job %s gave back %s", self.job_id, ",".join(gone))
        except AllocationError as exc:
            log.error("could not give back %s: %s; they stay with the job until it ends",
                      ",".join(gone), exc)

    def released(self, count: int, wait_s: float = 30.0) -> None:
        """``count`` workers left: in a thread, wait for their steps to end, then return
        their nodes."""
        def wait_and_return() -> None:
            deadline = time.monotonic() + wait_s
            ended: List[ExpansionWorker] = []
            while time.monotonic() < deadline:
                with self._lock:
                    ended = [w for w in self.workers if w.proc is not None and
                             w.proc.poll() is not None and not w.node_returned]
                if len(ended) >= count:
                    break
                time.sleep(0.05)
            self.return_nodes(ended)

        threading.Thread(target=wait_and_return, name="hpcadapt-release", daemon=True).start()

    def close(self, wait_s: float = 30.0) -> None:
        """Workers end with the training; stop any that do not within ``wait_s``."""
        deadline = time.monotonic() + wait_s
        for w in list(self.workers):
            if w.proc is None:
                continue
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker on %s still running at exit; stopping it", w.node)
                w.stop()
        self.workers.clear()
