"""The public API for a user's own training loop: ``Job``.

    job = hpcadapt.Job(args)                       # flags from hpcadapt.add_arguments(parser)
    loader = hpcadapt.ElasticDataLoader(train_set, batch_size=64, num_workers=2)
    job.setup(model, optimizer, loader, extra={"ema": ema})
    for epoch in job.epochs(10):
        for x, y in loader:
            job.step(loss_fn(model(x), y))         # backward, allreduce, optimizer step
        job.log_epoch(test_accuracy=evaluate(model))
    job.finish()

The job owns the step boundary: between two steps it writes the metrics, runs the policies
(rank 0 decides, every rank applies the same typed plan), completes or starts resizes, and
stops on a signal or a stop file. The training state (model, optimizer, data cursor,
hyper-parameters, policy, monitor and RNG state, the user's state) lives in
``hpcadapt.state.training.TrainingState``; the policy engine is a pure function of a snapshot."""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional

import numpy as np
import torch
from torch import nn

from hpcadapt.base import agent_files as agent
from hpcadapt.base import config, faults, lifecycle
from hpcadapt.base.errors import ConfigurationError, on_every_rank
from hpcadapt.base.metrics import json_safe
from hpcadapt.base.options import JobOptions, refuse_inconsistent
from hpcadapt.base.preemption import StopSignals
from hpcadapt.base import strategies
from hpcadapt.base.strategies import Strategy, registered
from hpcadapt.comm import world as world_mod
from hpcadapt.comm.mpiflavour import flavour
from hpcadapt.data.loader import ElasticDataLoader, split_micro
from hpcadapt.loop.adaptation import Adaptation
from hpcadapt.adapt.control import StepTimes
from hpcadapt.loop.failures import Failures, RecoveryScope
from hpcadapt.loop.resizing import ResizeDone, Resizing
from hpcadapt.adapt.monitors import GradientNoiseScale
from hpcadapt.loop.phase import JobPhase
from hpcadapt.loop.monitoring import Monitoring
from hpcadapt.loop.recording import Recorder
from hpcadapt.loop.steps import StepRunner
from hpcadapt.loop import setup_checks
from hpcadapt.loop.stops import Stops
from hpcadapt.parallel.optimizer import DistributedOptimizer
from hpcadapt.state.training import HyperParams, TrainingState, UserState, reference_lr


__all__ = ["Job", "JobOptions", "StepTimes"]

log = logging.getLogger(__name__)


class Job:
    """One data-parallel, adaptive training job on the ranks of this MPI launch.

    ``args``: the namespace parsed from a parser that ``hpcadapt.add_arguments`` extended;
    or flat keyword options (``policies=[GNSBatchSize(...)]``, ``checkpoint=...``: the names
    ``JobOptions.of`` takes, kept in a group per collaborator). Creating
    the job joins the MPI world, sets up rank-prefixed logging, the stop-signal handlers
    and the abort-on-exception hook. A worker started to join a running
    job (``HPCADAPT_JOIN_DIR`` set) joins it in ``setup``."""

    def __init__(self, args: Optional[argparse.Namespace] = None, **options: Any):
        from hpcadapt.base.logs import setup_logging
        from hpcadapt.base.preemption import block_stop_signals

        block_stop_signals()  # until the handlers below are in place (before MPI starts)
        lifecycle.install_abort_on_exception()
        setup_logging()  # before the flags are read: their warnings, once, rank-prefixed
        self.options = _options_of(args, options)
        o = self.options
        why = refuse_inconsistent(o)
        if why:  # the same flags on every rank: said once, by rank 0
            raise on_every_rank(ConfigurationError(why))
        faults.arm()  # a wrong HPCADAPT_FAULT is refused here
        # the metrics file's writer, handed to every collaborator (opened once the rank is
        # known)
        self.recorder = Recorder()
        join_dir, spawned_to_join = config.take_join_dir(), config.take_spawned_mark()
        # this process's life (joining, training, finished, stopped, left): one value that
        # the membership and the stops move and the loop reads
        self.phase = JobPhase(joining=join_dir is not None or spawned_to_join)
        # resizes, joins, leaving; how this process was started (to join a running job
        # through a port's folder, spawned by Open MPI's grow, a warm spare of a rank 0).
        # A completed resize comes back as a ResizeDone, handed on by _resized.
        self.resizing = Resizing(
            self, self.recorder, self.phase, fail=lambda exc: self.stops.fail(exc),
            recovery_scope=self.recovery_scope,
            join_dir=join_dir, spawned_to_join=spawned_to_join,
            spare_of=config.take_spare_mark())
        config.state_transport()  # a bad HPCADAPT_STATE_TRANSPORT is refused here, not mid-join
        strategies.from_options(o.steps)  # a strategy's unusable settings are refused here
        from hpcadapt.comm.topology import parse_ranks_per_node, parse_topology

        parse_topology(o.comm.topology)
        parse_ranks_per_node(o.comm.ranks_per_node)
        for flag, factor in (("--slow-compute", o.steps.slow_compute),
                             ("--slow-comm", o.steps.slow_comm)):
            if not (math.isfinite(factor) and factor >= 1.0):
                raise ConfigurationError(f"{flag} {factor!r}: give a factor of 1 or more "
                                         f"(2 makes the rank take twice as long)")
        # Why it stopped, checkpoints, the resume, the exit code; the stop signals' handlers.
        # Always: without --checkpoint a stop signal (or Ctrl-C) still ends the job at the
        # next step boundary, saying nothing was saved, instead of being swallowed.
        self.stops = Stops(self, self.recorder, self.phase, self.resizing, StopSignals.named(
            o.stops.stop_signals, saves=bool(o.stops.checkpoint)).install())
        companion_of = config.take_companion_of()
        if companion_of is not None:
            self.stops.signals.leave_instead(f"its companion job of Slurm job {companion_of} "
                                             f"is ending (cancelled, or its node taken back)")
        self.world = world_mod.init()
        self.resizing.listen_early()  # a spawned joiner hears the job from now on
        self.stops.signals.announce = lambda: (self.world.rank == 0
                                               and not self.resizing.joining)
        # A peer that dies during the user's own collective work: saved, exit 75.
        lifecycle.set_failure_handler(
            lambda exc: self.stops.fail(exc) if isinstance(exc, world_mod.PeerFailure) else None)
        setup_logging(lambda: self.world.rank if self.phase.holds_state
                      else f"joiner {os.getpid()}")
        most = max(self.world.size, o.membership.max_workers or 0,
                   o.membership.initial_workers or 0)
        if o.steps.slow_rank is not None and o.steps.slow_rank >= most and self.world.rank == 0:
            log.warning("--slow-rank %d: the job has at most %d worker(s), so no rank is "
                        "slowed", o.steps.slow_rank, most)
        # Every wait on a peer is bounded (runtime.PeerWatch); a stop signal is seen there.
        self.world.watch.floor = o.failures.peer_timeout
        self.world.watch.stop_signals = self.stops.signals
        self.device_choice = setup_checks.choose_device(o, self.world)
        # the policies' plans; the hyper-parameters' writer (unusable policies refused here)
        self.adaptation = Adaptation(
            self, self.recorder, snapshot=self._snapshot,
            check_replicas=lambda: self.monitoring.check_replicas_if_asked(),
            request_resize=self.request_resize)
        if o.membership.max_workers is not None:
            self.resizing.setup_elastic()
        if not self.resizing.joining:
            setup_checks.check_output_folders(o, self.world)
        # A run that will resume (its checkpoint is there) goes on in its metrics file;
        # any other starts the file anew.
        resuming = bool(o.stops.checkpoint) and os.path.exists(o.stops.checkpoint)
        self.recorder.open(None if self.resizing.joining else o.recording.metrics_file,
                           enabled=self.world.rank == 0, resuming=resuming)
        if self.world.rank == 0 and not self.resizing.joining:
            agent.record_coordinator()  # for the agent's signals, when there is one
        self.state: Optional[TrainingState] = None
        self.extra = UserState()
        # noise scale, timings, snapshot, metrics lines
        self.monitoring = Monitoring(self, self.recorder, self.adaptation.engine)
        # the step in flight and what it leaves behind
        self.steps = StepRunner(self, self.recorder, self.adaptation.engine, self.stops.signals,
                                self.monitoring, follow_ramp=self.adaptation.follow_ramp,
                                recoverable=lambda: self.failures.recoverable,
                                slot_ranks=self.resizing.slot_ranks,
                                restart_pending=lambda: self.failures.restart_pending)
        # a peer's death, recovered from in place
        self.failures = Failures(self, self.recorder, self.adaptation.engine,
                                 self.stops.fail, self.resizing, self.steps.roll_back)
        if o.recording.sample_log:
            self.recorder.open_sample_log(o.recording.sample_log)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer,
              loader: ElasticDataLoader, *, extra: Optional[Mapping[str, Any]] = None,
              identity: Optional[Mapping[str, Any]] = None) -> "Job":
        """Make ``model`` and ``optimizer`` data-parallel and bind ``loader`` to the job.

        ``extra``: the user's own state that travels with every resize and checkpoint
        (objects with ``state_dict``/``load_state_dict``, loaded in place; or plain values,
        read back as ``job.extra[key]``). Rank 0's copy is the one saved and sent to joiners:
        keep it the same on every rank. ``identity``: values a checkpoint must
        match to be resumed (e.g. a model name). On every rank, in the same order. Raises
        ConfigurationError with the reason for unusable input."""
        o = self.options
        if not isinstance(loader, ElasticDataLoader):
            raise on_every_rank(ConfigurationError(
                "the loader must be an hpcadapt.ElasticDataLoader (it "
                "follows the job's global data cursor)"))
        if loader.batch_size < self.world.size and not self.resizing.joining:
            raise on_every_rank(ConfigurationError(
                f"the global batch size {loader.batch_size} is below the {self.world.size} "
                f"workers: each needs at least one sample per step; use a batch size of at "
                f"least {self.world.size}"))
        strategy = strategies.from_options(o.steps)
        if strategy.min_workers > max(self.world.size, o.membership.initial_workers or 0) \
                and not self.resizing.joining:
            what = ("a peer to average with" if strategy.pairs_models
                    else "an aggregator (rank 0) and a worker")
            raise on_every_rank(ConfigurationError(
                f"--strategy {strategy.name} needs at least {strategy.min_workers} workers "
                f"({what}); {self.world.size} is running: start more (mpiexec -n 2 or "
                f"--initial-workers 2) or use --strategy ssgd"))
        self.extra = UserState(extra)
        self.extra.check_serialisable()
        setup_checks.schedule_for_policies(self.extra, self.adaptation.engine.policies,
                                           self.world)
        setup_checks.step_scheduler_under_a_batch_policy(
            optimizer, self.adaptation.engine.policies, o.adaptation.resize_batch, self.world)
        self.stops.expect_identity(identity)
        self.model, self.loader = model, loader
        plane = setup_checks.data_plane(model, o, self.device, self.device_choice)
        self.optimizer = DistributedOptimizer(
            optimizer, model.named_parameters(), world=self.world,
            bucket_bytes=o.comm.bucket_bytes,
            extra_slots=self.steps.control_layout().length, data_plane=plane,
            buffers=model.buffers() if o.comm.broadcast_buffers else ())
        group = optimizer.param_groups[0]
        hyper = HyperParams(batch_size=loader.batch_size, lr=reference_lr(group),
                            momentum=None, base_lr=reference_lr(group),
                            base_batch_size=loader.batch_size)
        self.monitoring.configure()
        self.state = TrainingState(model, optimizer, loader.sampler, hyper,
                                   GradientNoiseScale(o.monitoring.monitor_ema,
                                                      self.monitoring.config.window),
                                   self.extra, self.adaptation.engine)
        self.state.switch_strategy(strategy)
        self.state.switch_topology(o.comm.topology)
        # the optimizer and its data plane read both from the state (their one owner)
        self.optimizer.follow(self.state, o.comm.ranks_per_node)
        loader.bind(self._batches, self.state.global_batch_size)
        loader.sampler.job_driven = True
        if self.resizing.joining:
            self._resized(self.resizing.join())
        else:
            resumed = bool(o.stops.checkpoint) and self.stops.resume(o.stops.checkpoint)
            start_size, reason = self.resizing.start_size(resumed)
            if start_size > self.world.size:
                grown = self.resizing.start_initial_workers(start_size, reason)
                with self.recovery_scope():  # a death in its replica check: recovered
                    self._resized(grown)
            if self.resizing.elastic is not None:
                self.resizing.elastic.keep_spares()  # rank 0: they start while training starts
            if self.world.rank == 0:
                if self.device_choice.kind == "cuda":  # after every refusal: not before one
                    log.info("device: %s", self.device_choice.reason)
                log.info("training on %d %s, global batch %d, strategy %s, policies: %s",
                         self.world.size, "worker" if self.world.size == 1 else "workers",
                         self.state.hyper.batch_size,
                         self.state.strategy.describe(),
                         ", ".join(p.name for p in self.adaptation.engine.policies) or "none")
                log.info("%s", flavour().startup_line(o.failures.on_failure == "recover"))
        return self

    @property
    def device(self) -> torch.device:
        """Where this rank trains: move the model (and each batch) here before ``setup``."""
        return torch.device(self.device_choice.torch_device)

    @property
    def rank(self) -> int:
        """This worker's rank in the current world (it changes when the world does)."""
        return self.world.rank

    @property
    def size(self) -> int:
        """The number of workers now."""
        return self.world.size

    @property
    def step_count(self) -> int:
        """The number of committed steps: a step given up by a recovery is not counted,
        and the user's code after its ``job.step`` is undone at the loop's next batch."""
        return self.state.step if self.state is not None else 0

    @property
    def user_metrics(self) -> Dict[str, float]:
        """The last value of each metric you gave ``log_epoch`` (also in the summary)."""
        return self.recorder.user_metrics

    # -- progress, for schedulers: read-only, the same on every rank ------------------------
    @property
    def global_batch_size(self) -> int:
        """The global batch of the next step (policies change it)."""
        return self._require_setup().hyper.batch_size

    @property
    def local_batch_size(self) -> int:
        """This rank's share of the current step's global batch (0 for an empty share)."""
        if self.steps.part is not None:
            return len(self.steps.part.indices)
        return len(self._require_setup().sampler.peek(self.global_batch_size, self.rank,
                                                      self.size).indices)

    @property
    def accumulation_steps(self) -> int:
        """The micro-batches this rank's share is cut into (``--max-local-batch``; at world
        size 1 with a gradient monitor on, two halves): the batches the loader yields, and
        ``job.step`` calls, per step."""
        self._require_setup()
        return max(1, len(split_micro(np.arange(self.local_batch_size),
                                      self.steps.micro_cap())))

    @property
    def samples_seen(self) -> int:
        """Samples trained on in committed steps, over all epochs (the global cursor)."""
        return self._require_setup().samples_seen

    @property
    def epoch_progress(self) -> float:
        """Training progress in epochs, as a float (2.5: half-way through the third)."""
        return self._require_setup().epoch_progress

    @property
    def scale_invariant_steps(self) -> float:
        """The steps a run at the starting global batch would have taken for the samples
        seen so far (AdaptDL's progress): a step-based LR schedule keyed on this is the
        same whatever batch sizes the policies chose (see ``hpcadapt.ProgressLR``)."""
        return self._require_setup().scale_invariant_steps

    @property
    def gain_steps(self) -> float:
        """AdaScale's scale-invariant iterations: each committed step adds its gain r (the
        ``--lr-rule adascale`` factor, 1 <= r <= B/B0) and, under any other rule, B/B0 (so
        it equals ``scale_invariant_steps``). A schedule keyed on it
        (``ProgressLR(sched, job, key="gain")``) is AdaScale's: it moves as fast as the
        gradient's information, not its samples."""
        return self._require_setup().gain_steps

    @property
    def lr_factor(self) -> float:
        """The policies' factor on your rates (``--lr-rule``, its ramp, a policy's rate): the
        update uses every param group's rate times it, while ``param_groups`` keep the rates
        your optimizer and scheduler set (1 before ``setup``)."""
        return self.state.rate_factor() if self.state is not None else 1.0

    # -- stops, checkpoints, the end (loop/stops.py) ------------------------------------------
    @property
    def stopped(self) -> Optional[str]:
        """Why training stopped early (a stop signal, divergence, a peer's failure; ending
        in "NOT saved" when the state could not be saved), or None."""
        return self.phase.stopped

    @property
    def exit_code(self) -> int:
        """What ``finish(exit=False)`` decided: 0, 75 after a stop with the state saved (the
        job script requeues), 1 when it could not be saved or training diverged."""
        return self.stops.exit_code

    def save_checkpoint(self, path: str) -> None:
        """Rank 0: write the whole training state to ``path`` atomically."""
        self.stops.save_checkpoint(path)

    def summary(self) -> Dict[str, Any]:
        """What the job did, as rank 0 prints it at the end (JSON-safe)."""
        st = self._require_setup()
        rounds = self.steps.rounds.totals
        return json_safe({"final_test_accuracy": st.last_accuracy, "steps": st.step,
                          "epochs": st.epoch, "world_size": self.world.size,
                          "batch_size": st.hyper.batch_size, "lr": self.steps.last_rate(),
                          "left": self.phase.left,
                          "cluster_version": self.world.cluster_version,
                          "resizes": self.resizing.resizes, "stopped": self.stopped,
                          "strategy": st.strategy.name,
                          "model_digest": self.monitoring.model_digest(),
                          "user_metrics": dict(self.recorder.user_metrics),
                          **({"bounded_delay": rounds} if rounds else {})})

    def finish(self, *, exit: bool = True) -> Dict[str, Any]:
        """End the job on every rank: rank 0 prints the summary as one line of JSON (and
        writes ``--summary-json``), the checkpoint of a finished training is removed, MPI
        is released. After a stop signal it exits with 75 (the job script requeues) or 1
        when the state could not be saved, unless ``exit=False`` (then see ``exit_code``)."""
        summary = self.summary()
        self.stops.close_loader()
        if self.world.rank == 0:
            self.monitoring.end_progress()
            self.stops.announce(summary)
        self.recorder.close()
        self.resizing.release_workers()
        self.stops.end(owns_checkpoint=not self.resizing.joining, exit=exit)
        return summary

    # -- records and checks, on every rank (loop/monitoring.py) -----------------------------
    def log_epoch(self, *, test_accuracy: Optional[float] = None, **extra: Any) -> None:
        """Record the epoch that just ended (call on every rank, inside ``job.epochs()``):
        the metrics line, the log, and the accuracy the policies see. Other keywords are
        the user's own metrics (``ema_accuracy=0.91``): numbers, kept in the epoch line
        and, the last of each, in the summary. Raises ConfigurationError for a value that
        is not a number or a name that is a built-in field of the epoch line."""
        self.monitoring.log_epoch(self._require_setup(), self.steps.last_rate(),
                                  test_accuracy=test_accuracy, **extra)

    def log_eval(self, **metrics: Any) -> None:
        """Record an evaluation made during training (call on every rank, after a step;
        rank 0 writes): one ``"event": "eval"`` line of the metrics file with the committed
        ``step``, ``samples`` (``job.samples_seen``), ``epoch_progress``, the global
        ``batch_size``, the ``lr`` of the last step, and ``metrics`` as floats
        (``job.log_eval(val_loss=1.9, val_accuracy=0.42)``). Nothing is printed (it may run
        often); the summary is not changed. Raises ConfigurationError for a value that is
        not a number or a name that is a built-in field of the eval line."""
        self.monitoring.log_eval(self._require_setup(), self.steps.last_rate(), **metrics)

    def replicas_identical(self) -> bool:
        """Whether every rank holds bit-identical parameters and buffers (one small
        allreduce; call on every rank)."""
        return self.monitoring.replicas_identical()

    def model_digest(self) -> str:
        """A hash of this rank's parameters and buffers (hex): equal digests, identical
        replicas."""
        return self.monitoring.model_digest()

    def step(self, loss: torch.Tensor, *, clip_grad_norm: Optional[float] = None,
             scaler: Optional[Any] = None) -> bool:
        """Backward of ``loss`` (the mean over the batch the loader yielded), then, after
        the step's last micro-batch, the gradient allreduce (overlapped with backward) and
        the optimizer step. Use it instead of ``loss.backward(); optimizer.step()``.

        ``scaler``: a ``torch.amp.GradScaler`` for mixed precision (pass the unscaled
        loss): backward runs on the scaled loss, the averaged gradients are unscaled before
        the monitors, clipping and the update, and a step whose gradients overflowed is
        the scaler's to skip (it lowers the scale), not a divergence.

        Returns True when this call ended a step that committed (its last micro-batch; a
        bounded-delay worker's update handed to the aggregator); False for a step's other
        micro-batches and for a step that a peer's failure gave up (what the loop body does
        after it is then undone at the next batch). ``if job.step(loss): scheduler.step()``
        steps a scheduler once per step under ``--max-local-batch`` too."""
        outcome = self.steps.step(loss, clip_grad_norm=clip_grad_norm, scaler=scaler)
        if outcome.failure is not None:
            # In the user's code no exception may go: the recovery runs here, and the loop's
            # scope restarts the step when the loop asks for the next batch.
            self._recover(outcome.failure, step_given_up=outcome.given_up)  # or ends the job
        return outcome.committed

    def epochs(self, count: int) -> Iterator[int]:
        """Yield the epochs still to train (a resumed or joined worker starts where the job
        stands). The policies' epoch hooks run around each."""
        if count < 1:
            raise on_every_rank(ConfigurationError(
                f"the number of epochs must be positive, got {count}"))
        st = self._require_setup()
        self.monitoring.expect_epochs(count)
        # A resumed job, or a worker that joined a started one, skips the start's hooks; a
        # worker that joined before the first step (--initial-workers) runs them with all.
        resuming = st.start()
        if not resuming:
            self._hook_in_scope("before_train")
        first = True
        skip_before = False
        while True:
            while st.epoch < count and not self._over():
                if not (resuming and first) and not skip_before:
                    # A recovery inside it: the other survivors may already be training;
                    # every rank goes straight to the steps, from the state all agreed on.
                    self._hook_in_scope("before_epoch")
                skip_before = False
                first = False
                self.recorder.start_epoch()
                yielded = st.epoch
                with self.steps.epoch_body():
                    yield st.epoch
                if self.phase.left or self.phase.stopped:
                    break
                if st.epoch != yielded:
                    # A recovery gave this rank the state of a survivor that had finished
                    # the epoch: its end (and the next one's start) came with that state.
                    skip_before = True
                    continue
                if not self.recorder.epoch_logged:
                    self.log_epoch()
                if self.phase.finished_by_stop_file or self._max_steps_reached():
                    break
                done = st.sampler.epoch_done
                if self._hook_in_scope("after_epoch"):
                    skip_before = True  # the agreed state says which epoch this is
                    continue
                if done:
                    st.next_epoch()
            if self.phase.left or self.phase.stopped or not self._agree_on_the_end():
                break
            skip_before = True  # recovered at the end: the agreed state says where it is
        if not self.phase.left and not self.phase.stopped:
            self._hook_in_scope("after_train")
        self.resizing.finish()

    def _batches(self) -> Iterator[Any]:
        """This rank's (micro-)batches of the current epoch from the cursor on; the step
        boundary runs between steps. A rank whose share of a step is empty trains on none
        (its gradient contribution is zero) and yields nothing for that step."""
        st = self._require_setup()
        if st.sampler.epoch_done and not self.steps.in_epochs:
            # torch's `for epoch in range(n)` around the loader: hpcadapt keeps the epoch
            # itself (resume, joins), so the second pass would silently train nothing.
            raise on_every_rank(ConfigurationError(
                f"the loader's epoch {st.epoch} is already done and hpcadapt counts epochs "
                f"itself (for resume and joining workers): write `for epoch in "
                f"job.epochs(N):` around the loader instead of `for epoch in range(N):`"))
        epoch = st.epoch
        # A recovery may hand this rank the state of a survivor already in the next epoch:
        # this epoch's iteration then ends (job.epochs() goes on from that state).
        while st.epoch == epoch and not st.sampler.epoch_done and not self._over():
            self.failures.take_restart()  # a recovery in an epoch hook needs no redo
            rounds = st.strategy.asynchronous and self.world.size > 1
            going_on = True
            # The loop's recovery scope: a peer's failure anywhere in the step (round) or at
            # its boundary is recovered from here, and the iteration starts again from the
            # state the survivors agreed on (the step from the cursor, at the new size).
            # job.step, which runs in the user's code where no exception may go, recovers
            # in place and leaves the restart for this loop to see (as do the scopes of a
            # join and of switch_strategy).
            with self.recovery_scope() as scope:
                scope.step_given_up = True
                count = yield from (self.steps.rounds.round() if rounds
                                    else self.steps.sync_step())
                scope.step_given_up = False
                if not self.failures.restart_pending:
                    going_on = self._boundary(count, round_end=rounds)
            self.steps.undo_user_code_of_given_up_step()
            if self.failures.take_restart():
                continue
            if self.phase.left:
                self.stops.close_loader()
                self.resizing.leave()
            if not going_on:
                break

    def _recover(self, exc: BaseException, *, step_given_up: bool = False) -> None:
        """Recover from a peer's failure (``Failures.recover``; or the job ends) and
        act on what it did: the loop's iteration starts again from the agreed state (the
        step from its cursor, at the new size), the resize is recorded, and with
        --replace-failed workers are asked for in the dead's place. ``step_given_up``: the
        death cut a step (round) short, so what the loop body does after that ``job.step``
        is undone at the next batch; a death at a boundary, in a join or after the step
        committed leaves the body's work of the committed step."""
        from hpcadapt.elastic.membership import ResizeOutcome

        done = self.failures.recover(exc, holds_state=self.phase.holds_state)
        self.resizing.took_state()
        self.steps.recovered(given_up=step_given_up)
        dead = list(done.dead)
        if self.world.rank == 0:
            log.warning("rank(s) %s of %d died (%s): recovered in %.3f s on %d workers, "
                        "training from step %d", dead, done.old_size, done.why,
                        time.perf_counter() - done.started, self.world.size, self.state.step)
        self._resized(self.resizing.completed(
            ResizeOutcome(done.old_size, done.new_size, f"failure of rank(s) {dead}", 0.0,
                          True), done.started))
        if self.options.failures.replace_failed and self.resizing.elastic is not None:
            self.request_resize(self.world.size + len(dead),
                                f"replacing failed rank(s) {dead}")

    def _resized(self, done: Optional[ResizeDone]) -> None:
        """A resize completed on this rank (``Resizing``'s ``ResizeDone``; None: none):
        its follow-ups, handed to their owners in the same order on every rank of the new
        world (the comparison is collective): the step runner forgets the old world's
        per-rank times, the replicas are compared (--check-replicas), the resize is
        recorded, and the policies' ``on_resize`` is queued for the next boundary (every
        rank queues it: the hook is collective; only rank 0, never a joiner, decides)."""
        if done is None:
            return
        self.steps.resized()
        identical = self.monitoring.check_replicas_if_asked() if done.compare_replicas \
            else None
        self.resizing.record_done(done, identical)
        self.adaptation.queue_hook("on_resize", old_size=done.outcome.old_size,
                                   new_size=done.outcome.new_size)

    def _agree_on_the_end(self) -> bool:
        """ULFM: no rank leaves before every rank has reached the end (a barrier bounded by
        the peers' watch). A death in the last step's exchange can let some ranks complete
        it (ULFM's collectives may complete on some members and fail on others): without
        this they would leave while the others wait for them in the shrink. The barrier
        cannot complete while a peer is dead or recovering (its revoke interrupts it), so
        either all pass or all recover, taking the state of the one furthest on. Returns
        whether a recovery happened (training goes on from the agreed state)."""
        if not (world_mod.ULFM and self.failures.recoverable and self.world.size > 1):
            return False
        with self.recovery_scope():
            world_mod.wait_request(self.world.comm.Ibarrier(), self.world.watch,
                                   "the end of training")
        return self.failures.take_restart()

    def _boundary(self, count: int, *, round_end: bool = False) -> bool:
        """Between two steps, on every rank: metrics, stop, policies, resizes. Returns
        whether training goes on in this epoch."""
        st = self.state
        self.recorder.count_step(count, self.steps.last_loss)
        self.monitoring.log_step(count, self.steps.report())
        if self.steps.stop_requested:
            self.stops.stop_for_signal()
            return False
        if self.steps.nonfinite_run >= self.options.steps.max_nonfinite_steps:
            self.stops.stop_for_divergence(self.steps.nonfinite_run)
            return False
        if self.steps.finish_requested:
            self.stops.finish_by_stop_file()
            return False
        if self._max_steps_reached():
            return False
        every = self.options.stops.checkpoint_every
        # the steps this boundary closes: one, or a bounded-delay round's
        closed = max(1, -(-count // st.hyper.batch_size))
        # (not while the loss is non-finite: the last good save is not written over)
        if every and self.options.stops.checkpoint and self.world.rank == 0 \
                and st.step // every > (st.step - closed) // every and not self.steps.nonfinite_run:
            self.stops.save_periodically()
        # A recovery inside a hook or the grow's poll ends the boundary at once: the other
        # survivors may already be in the next step, which every rank then starts afresh
        # (another collective of this boundary would meet no partner).
        for name, extra in self.adaptation.take_queued_hooks():
            self.adaptation.hook(name, **extra)
            if self.phase.left:
                return False
        if self.adaptation.due(monitored=self.steps.monitored, round_end=round_end):
            self.adaptation.hook("after_step")
        if not self.phase.left:
            self._resized(self.resizing.poll())
        if self.resizing.allocator is not None:
            self.resizing.allocator.reap()  # launchers of workers that exited: no zombies
        return not self.phase.left

    def _snapshot(self):
        """Rank 0 at a step boundary: what the policies decide on (the last step's report,
        the membership's room to grow)."""
        elastic = self.resizing.elastic
        return self.monitoring.snapshot(
            self.steps.report(),
            max_workers=self.resizing.slot_ranks() if elastic is not None
            else self.world.size,
            can_resize=elastic is not None, resizing=bool(elastic is not None
                                                          and elastic.growing))

    def _over(self) -> bool:
        return self.phase.over or self._max_steps_reached()

    def _max_steps_reached(self) -> bool:
        most = self.options.steps.max_steps
        return most is not None and self.state.step >= most

    def request_resize(self, new_size: int, reason: str = "user request", *,
                       remove: Optional[List[int]] = None) -> None:
        """Change the number of workers; call on every rank at the same point between steps
        (policies do it through a plan). A shrink happens now; a grow starts now and
        completes at a later step boundary, when the new workers are ready. Requests that
        cannot be met are clipped or refused with a logged reason; training goes on.
        ``remove``: the ranks a shrink should let go first."""
        self._resized(self.resizing.request_resize(new_size, reason, remove=remove))

    def switch_strategy(self, strategy: Strategy, reason: str = "user request") -> None:
        """Change the synchronisation strategy from the next step on; call on every rank at
        the same point between steps (policies do it through a plan). A peer that dies in
        it is recovered from here; the old strategy stays."""
        registered(strategy)  # one line, on every rank alike, before any collective
        with self.recovery_scope():
            self.adaptation.switch_strategy(strategy, reason)

    def switch_topology(self, topology: str, reason: str = "user request") -> None:
        """The gradients' allreduce topology from the next step on (``hpcadapt.comm.topology``:
        flat, hierarchical, ring, tree); every rank at the same point between steps. The
        new communicators are built collectively before the next step's first allreduce;
        the cluster version goes up."""
        self.adaptation.switch_topology(topology, reason)

    def _hook_in_scope(self, name: str) -> bool:
        """An epoch-level hook (before and after training and each epoch) inside the loop's
        recovery scope; whether a recovery cut it short."""
        with self.recovery_scope():
            self.adaptation.hook(name)
        return self.failures.take_restart()

    def recovery_scope(self) -> RecoveryScope:
        """Where a peer's failure is recovered from: see ``RecoveryScope``."""
        return RecoveryScope(self._recover)

    def _require_setup(self) -> TrainingState:
        if self.state is None:
            raise on_every_rank(ConfigurationError(
                "call job.setup(model, optimizer, loader) first"))
        return self.state


def _options_of(args: Optional[argparse.Namespace], keywords: Mapping[str, Any]) -> JobOptions:
    """The options from a namespace of hpcadapt's flags (its unused flags warned about once,
    its policies built: ConfigurationError names a policy whose settings are unusable), or
    from keywords alone."""
    if args is None:
        return JobOptions.of(**keywords)
    from hpcadapt.policies import build_policies, unused_flags

    for message in unused_flags(args):
        log.warning("%s", message)
    policies = build_policies(args) if getattr(args, "policy", None) else []
    return JobOptions.from_args(args, **dict({"policies": policies}, **keywords))
