"""How training stops and resumes: a stop signal, divergence, a peer's failure that cannot be
recovered from, checkpoints (periodic and at a stop), the resume, and the end of the job
(summary, exit code).

``Stops`` is the Job's collaborator for it: it moves the job's phase to stopped or finished
(``loop.phase``) and owns whether a stop asks for a requeue, the exit code and the step it
resumed at; it reads the job's parts (``loop.parts``) and assigns none of the Job's
attributes."""

from __future__ import annotations

import logging

import json
import os
import sys
import time
from typing import Any, Dict, Optional, Protocol

from hpcadapt.base import agent_files as agent, config, lifecycle, strategies
from hpcadapt.base.errors import ConfigurationError, on_every_rank
from hpcadapt.base.metrics import FailureRecord, ResumeRecord, StopRecord
from hpcadapt.base.preemption import EXIT_REQUEUE, StopSignals
from hpcadapt.comm import world as world_mod
from hpcadapt.comm.tell import root_tells
from hpcadapt.data.loader import sweep_dead_worker_dirs
from hpcadapt.state.lease import CheckpointLease
from hpcadapt.state.training import checkpoint_step
from hpcadapt.loop.parts import JobParts
from hpcadapt.loop.phase import JobPhase
from hpcadapt.loop.recording import Recorder

__all__ = ["Stops"]

log = logging.getLogger("hpcadapt.job")


class StopsMembership(Protocol):
    """What the stops ask of the job's membership (``loop.resizing.Resizing``)."""

    def owns_the_end(self) -> bool: ...

    def sync_state(self) -> None: ...

    def release_workers(self, *, failed: bool = False) -> None: ...


class Stops:
    """How training stops and resumes: a stop signal, divergence, a peer's failure that
    cannot be recovered from, checkpoints (periodic and at a stop), the resume, and the end
    of the job (summary, exit code)."""

    def __init__(self, parts: JobParts, recorder: Recorder, phase: JobPhase,
                 membership: StopsMembership,
                 signals: Optional[StopSignals] = None):
        self.parts = parts
        self.recorder = recorder
        self.phase = phase  # the job's life: a stop, the stop file move it
        self.membership = membership
        #: the stop signals' handlers (installed before MPI starts): what was received
        self.signals = signals
        #: values a checkpoint must match to be resumed (``job.setup(identity=...)``)
        self.identity: Dict[str, Any] = {}
        self.requeue = True      # whether a stop asks the job script to requeue (exit 75)
        self.exit_code = 0
        self.resumed_at: Optional[int] = None  # the step a resume started from
        self.lease_token: Optional[str] = None  # every rank: the job's --checkpoint lease token

    def expect_identity(self, identity: Optional[Dict[str, Any]]) -> None:
        """The values a checkpoint must match to be resumed, and that a save records."""
        self.identity = dict(identity or {})

    def finish_by_stop_file(self) -> None:
        """``--stop-file`` appeared: training ends at this boundary, as a finished run."""
        self.phase.finish("the stop file")
        parts = self.parts
        if parts.world.rank == 0:
            log.info("stop file %s found at step %d: training ends here",
                     parts.options.stops.stop_file, parts.state.step)

    def resume(self, path: str) -> bool:
        """Every rank: rank 0 takes the path's lease (one job per checkpoint), reads ``path``
        if it exists, and the state is broadcast with the lease's token."""
        parts = self.parts
        error, found, token = "", False, None
        if parts.world.rank == 0:
            try:
                token = CheckpointLease(path, job_id=config.slurm_job_id()).acquire()
            except ConfigurationError as exc:
                error = str(exc)
        if parts.world.rank == 0 and not error and os.path.exists(path):
            found = True
            try:
                parts.state.load(path, identity=self.identity)
            except (OSError, ValueError, KeyError, RuntimeError, TypeError,
                    ConfigurationError) as exc:
                error = (f"cannot resume from {path}: {exc}; remove it or pass another "
                         f"--checkpoint")
        verdict = root_tells({"error": error, "found": found, "token": token}
                             if parts.world.rank == 0 else None,
                             parts.world, what="the resume's verdict")
        self.lease_token = verdict["token"]
        if verdict["error"]:
            raise on_every_rank(ConfigurationError(verdict["error"]))
        if not verdict["found"]:
            return False
        self.membership.sync_state()
        self.resumed_at = parts.state.step
        if parts.world.rank == 0:
            log.info("resumed from %s at epoch %d, step %d", path, parts.state.epoch,
                     parts.state.step)
            self.recorder.write(ResumeRecord(step=parts.state.step, epoch=parts.state.epoch,
                                             world_size=parts.world.size,
                                             saved_world_size=parts.state.world_size,
                                             checkpoint=path,
                                             cluster_version=parts.world.cluster_version))
            flags = strategies.from_options(parts.options.steps)
            if parts.state.strategy != flags:
                log.warning("resumed with the checkpoint's strategy %s (the flags say %s: "
                            "the run had switched; a policy may switch again)",
                            parts.state.strategy.describe(), flags.describe())
            if parts.state.topology != parts.options.comm.topology:
                log.warning("resumed with the checkpoint's allreduce topology %s (the flags "
                            "say %s: the run had switched)", parts.state.topology,
                            parts.options.comm.topology)
        return True

    def save_checkpoint(self, path: str) -> None:
        """Rank 0: write the whole training state to ``path`` atomically."""
        parts = self.parts
        parts.state.save(path, cluster_version=parts.world.cluster_version,
                       identity=self.identity, world_size=parts.world.size)

    def stop_for_signal(self) -> None:
        """Every rank, at the boundary where a stop signal became known: rank 0 saves."""
        parts = self.parts
        name = (self.signals.received if self.signals and self.signals.received
                else "a stop signal on another rank")
        self.phase.stop(name)
        saved = None
        if parts.world.rank == 0:
            saved = self.save_for_stop(name)
            self.record_stop(name, saved, requeue=saved)
        if not root_tells(saved, parts.world, what="the stop's verdict"):
            self.phase.not_saved()

    def record_stop(self, why: str, saved: bool, *, requeue: bool) -> None:
        """Rank 0: the stop's line in the metrics (plots mark it)."""
        parts = self.parts
        st = parts.state
        self.recorder.write(StopRecord(step=st.step, epoch=st.epoch, world_size=parts.world.size,
                                       signal=why, saved=saved,
                                       checkpoint=parts.options.stops.checkpoint if saved else None,
                                       requeue=requeue,
                                       cluster_version=parts.world.cluster_version))

    def fail(self, exc: BaseException) -> None:
        """A peer died (or stayed silent past the deadline) in the middle of a step or a
        resize. The world's communicator cannot be used any more (MPICH neither errors nor
        completes a collective with a dead peer), so this rank ends the job: rank 0 saves
        the last committed state (the step in flight has changed nothing yet: the optimizer
        has not stepped, the cursor not moved) to --checkpoint, and every survivor exits
        with 75 so that the job script requeues and resumes from it. Never returns."""
        parts = self.parts
        st = parts.state
        exc = world_mod.as_failure(exc)  # under ULFM an MPI error is the failure
        detected = time.time()
        who = f"rank {exc.rank}" if exc.rank >= 0 else "a peer"
        log.error("%s of %d failed at step %d (%s); detected at %s: ending the job", who,
                  parts.world.size, st.step if st else 0, exc,
                  time.strftime("%H:%M:%S", time.localtime(detected)) +
                  f".{int(detected * 1000) % 1000:03d}")
        code = EXIT_REQUEUE
        if parts.world.rank == 0 and st is not None:
            self.recorder.write(FailureRecord(rank=exc.rank, cause=exc.cause, detail=str(exc),
                                              step=st.step, epoch=st.epoch,
                                              world_size=parts.world.size, detected_unix=detected,
                                              waited_s=exc.waited_s,
                                              cluster_version=parts.world.cluster_version))
            saved = False
            if parts.options.stops.checkpoint and self.membership.owns_the_end():
                self.phase.stop("peer failure")
                saved = self.save_for_stop(f"the failure of {who}")
                if not saved:
                    code = 1
            else:
                log.error("nothing saved (%s): the state of step %d is lost; exit %d",
                          "no --checkpoint" if not parts.options.stops.checkpoint else
                          "a joined worker does not save", st.step, code)
            self.record_stop(f"the failure of {who}", saved, requeue=code == EXIT_REQUEUE)
        self.recorder.close()
        self.close_loader()
        self.membership.release_workers(failed=True)
        if parts.world.rank == 0:
            agent.record_exit_code(code)
        world_mod.leave_with_launch_siblings(5.0)
        lifecycle.end_process(code)

    def stop_for_divergence(self, n: int) -> None:
        """Every rank: the loss stayed non-finite for --max-nonfinite-steps steps (updates
        under bounded delay). The state in memory is not the last good one: the update
        before the run (a finite but exploding loss) was applied, so it is not saved; the
        last checkpoint on disk (a --checkpoint-every save or an earlier stop's) is kept
        and named. The job ends with exit code 1, not requeued (it would diverge again).
        ``n``: the non-finite steps in a row."""
        parts = self.parts
        st = parts.state
        self.requeue = False
        unit = "updates" if st.strategy.asynchronous and parts.world.size > 1 else "steps"
        name = f"{n} {unit} with a non-finite loss"
        self.phase.stop(name, saved=False)
        if parts.world.rank != 0:
            return
        log.error("the loss was not finite for %d %s in a row (up to step %d, learning "
                  "rate %.4g, batch %d): training stops. Lower the learning rate (--lr), "
                  "clip gradients, or raise --max-nonfinite-steps", n, unit, st.step,
                  st.hyper.lr, st.hyper.batch_size)
        self.record_stop(name, False, requeue=False)
        path = parts.options.stops.checkpoint
        kept = checkpoint_step(path) if path else None
        if kept is not None:
            log.error("the state in memory holds the update that diverged and is not saved; "
                      "%s keeps the checkpoint of step %d", path, kept)
        else:
            log.error("the state in memory holds the update that diverged and is not saved; "
                      "no earlier checkpoint exists%s", "" if path else " (no --checkpoint)")

    def save_periodically(self) -> None:
        """Rank 0, --checkpoint-every: a failed write is logged and training goes on."""
        parts = self.parts
        try:
            self.save_checkpoint(parts.options.stops.checkpoint)
        except (OSError, RuntimeError) as exc:
            log.error("step %d: the periodic checkpoint could not be written to %s: %s; "
                      "training goes on, the previous checkpoint stays", parts.state.step,
                      parts.options.stops.checkpoint, exc)

    def save_for_stop(self, name: str) -> bool:
        parts = self.parts
        st = parts.state
        if self.resumed_at is not None and st.step - self.resumed_at < 20:
            log.warning("stopped again %d step(s) after resuming: the job gets its stop "
                        "signal right after it starts. Slurm sends --signal=SIG@T up to "
                        "60 s before T; make the time limit (--time) well longer than "
                        "T + 60 s", st.step - self.resumed_at)
        path = parts.options.stops.checkpoint
        if not path:
            log.warning("stopped on %s at step %d; no --checkpoint given, state not saved "
                        "(pass --checkpoint PATH to save it and resume)", name, st.step)
            return False
        try:
            self.save_checkpoint(path)
        except (OSError, RuntimeError) as exc:
            log.error("stopped on %s at step %d, but the state could not be saved to %s: %s; "
                      "the job must not be requeued from it (free space, or pass another "
                      "--checkpoint)", name, st.step, path, exc)
            return False
        log.warning("stopped on %s at epoch %d, step %d; state saved to %s",
                    name, st.epoch, st.step, path)
        return True

    def announce(self, summary: Dict[str, Any]) -> None:
        """Rank 0, at the end: the summary as one line of JSON (and ``--summary-json``)."""
        print(json.dumps(summary), flush=True)
        path = self.parts.options.recording.summary_json
        if path:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(summary, f)

    def end(self, *, owns_checkpoint: bool, exit: bool = True) -> None:
        """The end of ``job.finish`` on every rank, after the summary: the exit code (75
        after a stop with the state saved, 1 when it could not be saved), the checkpoint of
        a finished training and its lease released (``owns_checkpoint``: not a worker that
        is still joining), MPI released; exits unless ``exit=False``."""
        parts = self.parts
        self.exit_code = 0
        if self.phase.stopped:
            # Requeue only from a saved state (rank 0 saves; the others follow its word).
            self.exit_code = EXIT_REQUEUE if self.requeue and self.phase.saved else 1
        elif parts.options.stops.checkpoint and parts.world.rank == 0 and owns_checkpoint:
            # what this job owns: the checkpoint and its lease (another job may hold the
            # path now, if this one's lease was taken over while it ran)
            CheckpointLease(parts.options.stops.checkpoint, job_id=config.slurm_job_id()
                            ).release(self.lease_token, remove_checkpoint=True)
        if parts.world.rank == 0:
            agent.record_exit_code(self.exit_code)
        lifecycle.plan_exit(self.exit_code)
        world_mod.shutdown()
        if exit and self.exit_code:
            sys.exit(self.exit_code)

    def close_loader(self) -> None:
        """The loader's worker processes end now, cleanly (their temporary folders go with
        them), not when the interpreter kills them on its way out; the folders of workers
        that were killed with their rank (a failure) are removed here too."""
        parts = self.parts
        loader = getattr(parts, "loader", None)
        if loader is not None:
            try:
                loader.close()
            except Exception as exc:  # best effort on the way out
                log.warning("the data loader's workers did not stop cleanly: %s", exc)
        sweep_dead_worker_dirs()
