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
import hashlib
import json
import logging
import math
import os
import sys
import time
import zlib
from dataclasses import asdict, replace
from typing import Any, Dict, Iterator, List, Mapping, Optional

import numpy as np
import torch
from torch import nn

from hpcadapt.base import agent_files as agent
from hpcadapt.base import config, faults, lifecycle
from hpcadapt.comm import world as world_mod
from hpcadapt.comm.world import CommView
from hpcadapt.comm.collectives import ReduceOp, communicator
from hpcadapt.comm.tell import root_tells
from hpcadapt.loop.control import ControlLayout, StepTimes
from hpcadapt.loop.engine import PolicyEngine
from hpcadapt.base.errors import ConfigurationError, HpcAdaptError, MembershipError, on_every_rank
from hpcadapt.data.loader import ElasticDataLoader, WalkKey, split_micro
from hpcadapt.base.options import JobOptions, refuse_inconsistent
from hpcadapt.base.paths import unwritable
from hpcadapt.base.metrics import (DecisionRecord, EpochRecord, MetricsSink, ResizeRecord, StepRecord,
                                   json_safe)
from hpcadapt.comm.mpiflavour import flavour
from hpcadapt.loop.monitor import (GradientNoiseScale, MonitorConfig, estimate_from_consecutive,
                      estimate_from_replicas)
from hpcadapt.parallel.optimizer import DistributedOptimizer, GradientStats
from hpcadapt.base.plan import Plan
from hpcadapt.base.preemption import EXIT_REQUEUE, StopSignals
from hpcadapt.state.rollback import StepCommit
from hpcadapt.state.training import (HyperParams, TrainingState, UserState, checkpoint_step,
                                     momentum_of, optimizer_settings)
from hpcadapt.base.strategy import Strategy

__all__ = ["Job", "JobOptions", "StepTimes"]

log = logging.getLogger(__name__)



class Job:
    """One data-parallel, adaptive training job on the ranks of this MPI launch.

    ``args``: the namespace parsed from a parser that ``hpcadapt.add_arguments`` extended;
    or keyword options of ``JobOptions`` (``policies=[GNSBatchSize(...)]``, ...). Creating
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
        self._join_dir = config.take_join_dir()
        self._spawned_to_join = config.take_spawned_mark()  # Open MPI's grow
        self._spare_of = config.take_spare_mark()  # Open MPI: a warm spare's rank 0 (NODE:PID)
        config.state_transport()  # a bad HPCADAPT_STATE_TRANSPORT is refused here, not mid-join
        self._initial_strategy = Strategy(o.strategy, o.sma_alpha, o.local_sgd_period,
                                           o.max_delay, o.async_round_steps)
        from hpcadapt.comm.topology import parse_ranks_per_node, parse_topology

        parse_topology(o.topology)
        parse_ranks_per_node(o.ranks_per_node)
        for flag, factor in (("--slow-compute", o.slow_compute), ("--slow-comm", o.slow_comm)):
            if not (math.isfinite(factor) and factor >= 1.0):
                raise ConfigurationError(f"{flag} {factor!r}: give a factor of 1 or more "
                                         f"(2 makes the rank take twice as long)")
        self.joining = self._join_dir is not None or self._spawned_to_join
        # Whether this process holds the training state (a joiner does once it has joined):
        # a recovery during a join takes the state from a survivor that holds it.
        self._holds_state = not self.joining
        # Always: without --checkpoint a stop signal (or Ctrl-C) still ends the job at the
        # next step boundary, saying nothing was saved, instead of being swallowed.
        self.stop_signals: Optional[StopSignals] = StopSignals.named(
            o.stop_signals, saves=bool(o.checkpoint)).install()
        self.world = world_mod.init()
        # A peer that dies during the user's own collective work: saved, exit 75.
        lifecycle.set_failure_handler(
            lambda exc: self._fail(exc) if isinstance(exc, world_mod.PeerFailure) else None)
        setup_logging(lambda: self.world.rank)
        most = max(self.world.size, o.max_workers or 0, o.initial_workers or 0)
        if o.slow_rank is not None and o.slow_rank >= most and self.world.rank == 0:
            log.warning("--slow-rank %d: the job has at most %d worker(s), so no rank is "
                        "slowed", o.slow_rank, most)
        # Every wait on a peer is bounded (runtime.PeerWatch); a stop signal is seen there.
        self.world.watch.floor = o.peer_timeout
        self.world.watch.stop_flag = lambda: bool(self.stop_signals is not None
                                                  and self.stop_signals.received)
        self.device_choice = self._choose_device()
        #: where this rank trains: move the model (and each batch) here before ``setup``
        self.device = torch.device(self.device_choice.torch_device)
        from hpcadapt.policies.lr_rules import LRRule

        self.engine = PolicyEngine(o.policies, LRRule(o.lr_rule, o.lr_ramp_steps),
                                   resize_batch=o.resize_batch)
        self.elastic = None
        self.allocator = None
        if o.max_workers is not None:
            self._setup_elastic()
        if not self.joining:
            self._check_output_folders()
        self.sink = MetricsSink(o.metrics_file if not self.joining else None,
                                enabled=self.world.rank == 0)
        if self.world.rank == 0 and not self.joining:
            agent.record_coordinator()  # for the agent's signals, when there is one
        self.state: Optional[TrainingState] = None
        self.extra = UserState()
        self.left = False
        self.stopped: Optional[str] = None
        self.finished_by_stop_file = False
        self.resizes: List[Dict[str, Any]] = []
        self.last_loss = float("nan")
        self.last_times: Optional[StepTimes] = None
        self.monitored = False
        self._resumed = False
        self._resumed_at: Optional[int] = None
        self._queued_hooks: List[tuple] = []
        self._prev_grads: Optional[List[torch.Tensor]] = None
        self._prev_count = 0  # the global batch of the step whose gradients _prev_grads hold
        self._prev_local = (0.0, 0.0, 0.0)
        self._step_time = 0.0
        self._last_count = 0
        self._micro_left = 0
        self._step_open = False
        self._loss_sum = 0.0
        self._t_step = 0.0
        self._slept = 0.0        # --slow-compute's sleep in this step
        self._own_compute = 0.0  # the last step's compute without that sleep
        self._walk: Optional[WalkKey] = None
        self._walk_cursor = -1
        self._stop_requested = False
        self._recovered = False  # set when a recovery cut the step or boundary short
        # The state the step (round) in flight may change, as of its start (rollback.py):
        # a recovery undoes the uncommitted step with it. None once the step commits.
        self._in_flight: Optional[StepCommit] = None
        # The agreed state after a recovery inside job.step: the user's code after that
        # call ran for a step given up, and is undone when the loop asks for the next batch.
        self._undo_at_next_batch: Optional[StepCommit] = None
        self._used_settings: Dict[str, Any] = {}  # the optimizer's, at the last update
        self.user_metrics: Dict[str, float] = {}  # the last value of each (log_epoch)
        self._part = None  # this rank's share of the step in flight (sampler.StepSlice)
        self._round_nonfinite = 0  # a bounded-delay round's non-finite updates (control)
        self._nonfinite_run = 0  # consecutive steps whose loss or gradient was not finite
        self._requeue = True     # whether a stop asks the job script to requeue (exit 75)
        self._finish_requested = False
        self._epoch_logged = False
        self.exit_code = 0
        self._sample_file = None
        self._async_work = None     # a bounded-delay worker's batch in progress
        self._async_totals: Dict[str, Any] = {}  # rank 0: bounded-delay rounds so far
        self._identical_after_resize: Optional[bool] = None
        self._epoch_samples = 0
        self._epoch_losses: List[float] = []
        self._t_epoch = time.perf_counter()
        if o.sample_log:
            os.makedirs(o.sample_log, exist_ok=True)
            # Line-buffered: a worker killed at any moment has written every step it
            # committed (the failure tests count samples from these files).
            self._sample_file = open(os.path.join(o.sample_log, f"samples-{os.getpid()}.jsonl"),
                                     "a", encoding="utf-8", buffering=1)

    # -- set-up ------------------------------------------------------------------------------
    def _choose_device(self):
        """--device: this rank's device from its local rank (one GPU per rank; ranks share
        GPUs, over the host-staged plane, when a node has more ranks than GPUs)."""
        from hpcadapt.cuda.device import choose_device

        choice, error = None, ""
        try:
            choice = choose_device(self.options.device, local_rank=self.world.local_rank,
                                   local_size=self.world.local_size)
        except ConfigurationError as exc:
            error = str(exc)
        self._agree(error)  # rank 0's problem: raised on every rank together, printed once
        if choice is None:
            raise ConfigurationError(error)  # this rank's alone: the job ends (exception hook)
        if choice.kind == "cuda":
            torch.cuda.set_device(choice.index)
        if self.world.rank == 0 and choice.kind == "cuda":
            log.info("device: %s", choice.reason)
        return choice

    def _data_plane(self, model: nn.Module) -> str:
        """The plane for ``model``'s gradients; ConfigurationError when the model is not
        on the device the job trains on (``--device`` asked explicitly)."""
        o = self.options
        params = [p for p in model.parameters()]
        where = params[0].device if params else torch.device("cpu")
        if o.device != "auto" and where.type != self.device.type:
            raise ConfigurationError(
                f"the model is on {where} but --device {o.device} trains on {self.device}: "
                f"call model.to(job.device) before job.setup")
        if o.data_plane == "auto" and where.type == "cuda":
            return self.device_choice.data_plane if self.device_choice.kind == "cuda" \
                else "auto"
        return o.data_plane

    def _setup_elastic(self) -> None:
        from hpcadapt.elastic.allocator import build_allocator
        from hpcadapt.elastic.membership import ElasticController, joiner_argv

        o = self.options
        if o.max_workers < self.world.size and not self.joining:
            raise ConfigurationError(f"--max-workers {o.max_workers} is below the "
                                     f"{self.world.size} workers already running")
        if o.min_workers > o.max_workers:
            raise ConfigurationError(f"--min-workers {o.min_workers} is above "
                                     f"--max-workers {o.max_workers}")
        if o.warm_spares < 0:
            raise ConfigurationError(f"--warm-spares {o.warm_spares}: give 0 or more")
        if o.initial_workers is not None and o.initial_workers > o.max_workers:
            raise ConfigurationError(f"--initial-workers {o.initial_workers} is above "
                                     f"--max-workers {o.max_workers}")
        if o.min_workers > max(self.world.size, o.initial_workers or 0) and not self.joining:
            raise ConfigurationError(f"--min-workers {o.min_workers} is above the "
                                     f"{self.world.size} workers running; start at least "
                                     f"{o.min_workers}")
        self.allocator, join_root = build_allocator(o, self.world.rank)
        self.elastic = ElasticController(self.world, self.allocator, joiner_argv(),
                                         join_timeout=o.join_timeout,
                                         min_workers=o.min_workers, join_root=join_root)
        # Rank 0 gives up a joiner that does not connect well before the others' bounded
        # waits for its word (--peer-timeout) expire: the grow is then abandoned and training
        # goes on, instead of the job ending (the 200-event soak met exactly that race).
        self.elastic.accept_timeout = o.peer_timeout / 3
        self.elastic.warm_spares = 0 if self.joining else o.warm_spares
        self.elastic.spare_pool_used = bool(o.warm_spares) and self.elastic.spawns

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
            raise ConfigurationError("the loader must be an hpcadapt.ElasticDataLoader (it "
                                     "follows the job's global data cursor)")
        if loader.batch_size < self.world.size and not self.joining:
            raise ConfigurationError(
                f"the global batch size {loader.batch_size} is below the {self.world.size} "
                f"workers: each needs at least one sample per step; use a batch size of at "
                f"least {self.world.size}")
        strategy = self._initial_strategy
        if strategy.min_workers > max(self.world.size, o.initial_workers or 0) \
                and not self.joining:
            what = ("a peer to average with" if strategy.pairs_models
                    else "an aggregator (rank 0) and a worker")
            raise ConfigurationError(
                f"--strategy {strategy.name} needs at least {strategy.min_workers} workers "
                f"({what}); {self.world.size} is running: start more (mpiexec -n 2 or "
                f"--initial-workers 2) or use --strategy ssgd")
        self.extra = UserState(extra)
        self.extra.check_serialisable()
        self.identity = dict(identity or {})
        self.model, self.loader = model, loader
        self.optimizer = DistributedOptimizer(
            optimizer, model.named_parameters(), world=self.world, bucket_bytes=o.bucket_bytes,
            extra_slots=self._control_layout().length, data_plane=self._data_plane(model),
            buffers=model.buffers() if o.broadcast_buffers else ())
        group = optimizer.param_groups[0]
        hyper = HyperParams(batch_size=loader.batch_size, lr=float(group["lr"]),
                            momentum=float(momentum_of(group)), base_lr=float(group["lr"]),
                            base_batch_size=loader.batch_size)
        monitors = list(dict.fromkeys(list(o.monitors) + self.engine.required_monitors))
        self.monitor_cfg = MonitorConfig(tuple(monitors), self._monitor_interval(),
                                         o.monitor_ema)
        self.state = TrainingState(model, optimizer, loader.sampler, hyper,
                                   GradientNoiseScale(o.monitor_ema), self.extra, self.engine)
        self.state.strategy = self._initial_strategy
        self.state.topology = o.topology
        loader._job = self
        if self.joining:
            self._join()
        else:
            if o.checkpoint:
                self._resumed = self._resume(o.checkpoint)
            if o.warm_spares and self.elastic is None:
                raise on_every_rank(ConfigurationError(
                    "--warm-spares needs --max-workers (the allocator that starts them)"))
            start_size, reason = self._start_size()
            if start_size > self.world.size:
                self._start_initial_workers(start_size, reason)
            if self.elastic is not None:
                self.elastic.keep_spares()  # rank 0: they start while training starts
            if self.world.rank == 0:
                log.info("training on %d workers, global batch %d, strategy %s, policies: %s",
                         self.world.size, self.state.hyper.batch_size,
                         self.state.strategy.describe(),
                         ", ".join(p.name for p in self.engine.policies) or "none")
                log.info("%s", flavour().startup_line(o.on_failure == "recover"))
        return self

    def _start_size(self) -> tuple:
        """(the size to train at from the first step, why): --initial-workers, or on a
        resume the size the checkpoint was written at (--resume-size saved), capped by
        --max-workers; each case that does not grow back says so in one line."""
        o = self.options
        want = o.initial_workers or 0
        saved = self.state.world_size if self._resumed else 0
        if saved <= max(want, self.world.size):
            return want, "initial workers"
        now = max(want, self.world.size)
        if o.resume_size == "launch":
            self._say_once("the checkpoint was written by %d workers; --resume-size launch: "
                           "training goes on at %d", saved, now)
            return want, "initial workers"
        if self.elastic is None:
            self._say_once("the checkpoint was written by %d workers; without --max-workers "
                           "the job cannot grow back: training goes on at %d (start with "
                           "--max-workers %d, or -n %d)", saved, now, saved, saved)
            return want, "initial workers"
        reach = min(saved, o.max_workers)
        self._say_once("the checkpoint was written by %d workers: growing back to %d before "
                       "the first step%s (--resume-size launch keeps the launch's %d)", saved,
                       reach, f" (--max-workers {o.max_workers})" if reach < saved else "",
                       self.world.size)
        return reach, f"resuming at the checkpoint's {saved} workers"

    def _say_once(self, message: str, *args: Any) -> None:
        if self.world.rank == 0:
            log.warning(message, *args)

    def _start_initial_workers(self, count: int, reason: str = "initial workers") -> None:
        """--initial-workers: the workers the launch lacks join before the first step, each
        its own launch (a dead one is then recovered from; a rank of a shared launch is not).
        A grow that fails or times out leaves the job training at the size it has."""
        if self.elastic is None:
            raise ConfigurationError("--initial-workers needs --max-workers (the allocator "
                                     "that starts them)")
        self.request_resize(count, reason)
        while self.elastic.growing:
            self._poll_elastic()
            time.sleep(0.02)

    def _monitor_interval(self) -> int:
        import functools

        o = self.options
        intervals = [o.monitor_interval] if o.monitors else []
        intervals += [max(1, int(p.interval)) for p in self.engine.policies if p.requires]
        if self.engine.lr_rule.rule == "adascale":
            intervals.append(o.monitor_interval)
        return functools.reduce(math.gcd, intervals) if intervals else o.monitor_interval

    def _agree(self, error: str) -> None:
        """Rank 0's verdict for everyone: ConfigurationError on every rank if it is one."""
        error = root_tells(error or None, self.world, what="rank 0's verdict")
        if error:
            raise on_every_rank(ConfigurationError(error))

    def _check_output_folders(self) -> None:
        """Refuse at start (not at the first write, nor when the stop signal comes) an output
        path that cannot be written, itself or its folder: rank 0 probes, every rank hears
        its verdict."""
        o = self.options
        error = ""
        if self.world.rank == 0:
            for flag, path in (("--checkpoint", o.checkpoint), ("--metrics-file", o.metrics_file),
                               ("--summary-json", o.summary_json)):
                if path and not error:
                    error = unwritable(flag, path, replaced=flag == "--checkpoint")
            if o.sample_log and not error:
                error = unwritable("--sample-log", o.sample_log, folder_path=True)
        self._agree(error)

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

    # -- progress, for schedulers (read-only; every rank sees the same values) ---------------
    @property
    def global_batch_size(self) -> int:
        """The global batch of the next step (policies change it)."""
        return self._require_setup().hyper.batch_size

    @property
    def local_batch_size(self) -> int:
        """This rank's share of the current step's global batch (0 for an empty share)."""
        if self._part is not None:
            return len(self._part.indices)
        return len(self._require_setup().sampler.peek(self.global_batch_size, self.rank,
                                                      self.size).indices)

    @property
    def accumulation_steps(self) -> int:
        """The micro-batches this rank's share is cut into (``--max-local-batch``): the
        batches the loader yields, and ``job.step`` calls, per step."""
        return max(1, len(split_micro(np.arange(self.local_batch_size),
                                      self.options.max_local_batch)))

    @property
    def samples_seen(self) -> int:
        """Samples trained on in committed steps, over all epochs (the global cursor)."""
        st = self._require_setup()
        return st.epoch * st.sampler.num_samples + st.sampler.cursor

    @property
    def epoch_progress(self) -> float:
        """Training progress in epochs, as a float (2.5: half-way through the third)."""
        st = self._require_setup()
        return self.samples_seen / st.sampler.num_samples

    @property
    def scale_invariant_steps(self) -> float:
        """The steps a run at the starting global batch would have taken for the samples
        seen so far (AdaptDL's progress): a step-based LR schedule keyed on this is the
        same whatever batch sizes the policies chose (see ``hpcadapt.ProgressLR``)."""
        st = self._require_setup()
        return self.samples_seen / st.origin["batch_size"]

    @property
    def _recoverable(self) -> bool:
        """Whether a peer's death can be survived here (then each step keeps what it may
        change, to undo it): more than one worker now, or workers that may join."""
        return self.options.on_failure == "recover" and (self.world.size > 1
                                                         or self.elastic is not None)

    # -- the loops -------------------------------------------------------------------------
    def epochs(self, count: int) -> Iterator[int]:
        """Yield the epochs still to train (a resumed or joined worker starts where the job
        stands). The policies' epoch hooks run around each."""
        if count < 1:
            raise ConfigurationError(f"the number of epochs must be positive, got {count}")
        st = self._require_setup()
        # A resumed job, or a worker that joined a started one, skips the start's hooks; a
        # worker that joined before the first step (--initial-workers) runs them with all.
        resuming = st.started
        st.started = True
        if not resuming:
            self._hook("before_train")
        first = True
        skip_before = False
        while st.epoch < count and not self._over():
            if st.sampler.epoch != st.epoch:
                st.sampler.set_epoch(st.epoch)
            if not (resuming and first) and not skip_before:
                self._hook("before_epoch")
            # A recovery inside an epoch hook: the other survivors may already be training;
            # every rank goes straight to the steps, from the state all agreed on.
            self._recovered = skip_before = False
            first = False
            self._epoch_samples, self._epoch_losses = 0, []
            self._t_epoch = time.perf_counter()
            self._epoch_logged = False
            yield st.epoch
            if self.left or self.stopped:
                break
            if not self._epoch_logged:
                self.log_epoch()
            if self.finished_by_stop_file or self._max_steps_reached():
                break
            done = st.sampler.epoch_done
            self._hook("after_epoch")
            if self._recovered:
                skip_before = True  # the agreed state says which epoch this is
                continue
            if done:
                st.epoch += 1
                st.sampler.set_epoch(st.epoch)
        if not self.left and not self.stopped:
            self._hook("after_train")
        self._finish_elastic()

    def _batches(self) -> Iterator[Any]:
        """This rank's (micro-)batches of the current epoch from the cursor on; the step
        boundary runs between steps. A rank whose share of a step is empty trains on none
        (its gradient contribution is zero) and yields nothing for that step."""
        st = self._require_setup()
        while not st.sampler.epoch_done and not self._over():
            self._recovered = False  # a recovery in an epoch hook needs no redo
            rounds = st.strategy.asynchronous and self.world.size > 1
            count = yield from (self._async_round() if rounds else self._sync_step())
            self._undo_user_code_of_given_up_step()
            if self._recovered:
                # A peer died during this step (round): the survivors took the state of the
                # one furthest on; the step from the cursor is trained (again) at the new size.
                self._recovered = False
                continue
            going_on = self._boundary(count, round_end=rounds)
            if self._recovered:
                self._recovered = False  # the boundary was cut short by a recovery
                continue
            if self.left:
                self._leave()
            if not going_on:
                break

    def _keep_in_flight(self, batches: int) -> None:
        """At a step's (round's) start: what it may change, for a recovery to undo. The
        user's state and the param groups only when the loop body runs more than once
        before the step commits (micro-batches, a round's batches): with one batch, the
        body after the failed ``job.step`` has not run when the recovery restores, and
        ``_undo_at_next_batch`` covers it (no copy of an EMA model every step)."""
        if self._recoverable:
            self._in_flight = StepCommit.take(self.state.step, self.extra,
                                              self.optimizer.optimizer, self.model,
                                              user=batches > 1)

    def _undo_user_code_of_given_up_step(self) -> None:
        """The loop's next batch after a recovery inside ``job.step``: whatever the user's
        code after that call changed in the registered state (scheduler, EMA, counters,
        rates, buffers, random generator) goes back to the state the survivors agreed on,
        so that each committed step reaches the user's code once."""
        if self._undo_at_next_batch is not None:
            self._undo_at_next_batch.restore(self.extra, self.optimizer.optimizer, self.model)
            self._undo_at_next_batch = None

    def _sync_step(self) -> Iterator[Any]:
        """One synchronous step's (micro-)batches; returns the step's global sample count."""
        part, micro = self._begin_step()
        if not micro:
            self._stage_control()
            self._finish_step()
        yield from self._yield_micro(micro, len(part.indices), self.loader.next_batch)
        return part.global_count

    def _yield_micro(self, micro, total: int, load) -> Iterator[Any]:
        """The micro-batches of one share of ``total`` samples, each loaded by ``load``;
        ``job.step(loss)`` must come once after each."""
        for i, indices in enumerate(micro):
            batch = load(indices)
            self._micro_left = len(micro) - i
            self._micro_share = len(indices) / total
            self._micro_n = len(indices)
            yield batch
            if self._micro_left == len(micro) - i:
                raise ConfigurationError("call job.step(loss) once for every batch the "
                                         "loader yields")

    def _follow_ramp(self) -> None:
        """The rate of this step (a batch change's ramp moves it), set on the optimizer."""
        h = self.state.hyper
        if h.ramp is not None:
            h.lr = h.lr_at(self.state.step)
            if self.state.step - h.ramp[0] >= h.ramp[1]:
                h.ramp = None
        self._apply_lr(h.lr)

    def _begin_step(self):
        st = self.state
        o = self.options
        self._t_step = time.perf_counter()
        self._follow_ramp()
        part = st.sampler.peek(st.hyper.batch_size, self.world.rank, self.world.size)
        micro = split_micro(part.indices, o.max_local_batch)
        # before a loader restart (its workers' seeds) and forward (buffers) use the RNG
        self._keep_in_flight(len(micro))
        key = WalkKey(st.epoch, st.hyper.batch_size, self.world.rank, self.world.size,
                      o.max_local_batch)
        if key != self._walk or self._walk_cursor != st.sampler.cursor:
            self.loader.restart(key, st.sampler.cursor)
            self._walk = key
        self._walk_cursor = st.sampler.cursor + part.global_count
        self._part = part
        opt = self.optimizer
        self.monitored = self.monitor_cfg.enabled and (st.step + 1) % self.monitor_cfg.interval == 0
        opt.track_grad_norms = self.monitored and self.world.size > 1
        opt.set_local_weight(part.weight)
        opt.set_extra_slots(self._control_layout().length)
        opt.zero_grad()
        # --slow-compute: before forward, (F - 1) x the last step's own compute (the sleep
        # left out of it, or each step's sleep would feed the next one's)
        self._slept = self._slow_down(o.slow_compute, self._own_compute)
        opt.set_strategy(st.strategy)
        opt.set_topology(st.topology, o.ranks_per_node)
        opt.begin_step(st.step)
        self._loss_sum = 0.0
        self._step_open = True
        if self._sample_file is not None:
            # A step given up by a recovery is logged again when it is redone, with the
            # new world's cluster version: per step, the records of the highest version
            # are the ones that trained.
            self._sample_file.write(json.dumps({
                "epoch": st.epoch, "step": st.step, "rank": self.world.rank,
                "size": self.world.size, "version": self.world.cluster_version,
                "indices": part.indices.tolist()}) + "\n")
        return part, micro

    # -- bounded-delay rounds (hpcadapt.parallel.bounded) ----------------------------------------
    def _async_round(self) -> Iterator[Any]:
        """One round of bounded-delay aggregation: rank 0 aggregates, the other ranks yield
        the batches it hands them. Every rank starts from rank 0's model and ends with it;
        the round's control values (loss, per-rank times, stop votes) then travel in one
        small allreduce, and the round counts as ``ceil(samples / B)`` steps. Returns the
        round's samples (0 after a recovery: a peer died in the round, which is then
        trained again from the agreed state)."""
        from hpcadapt.parallel.bounded import Aggregator, AsyncWorker, FlatModel
        from hpcadapt.comm.collectives import MPICommunicator
        from hpcadapt.parallel.optimizer import broadcast_parameters

        st, o = self.state, self.options
        strategy, batch = st.strategy, st.hyper.batch_size
        self._t_step = time.perf_counter()
        self.monitored = False
        self._follow_ramp()
        self._keep_in_flight(batches=2)  # a worker's batches in a round: the body runs often
        count = min(strategy.round_steps * batch, st.sampler.remaining)
        if o.max_steps is not None:  # the round ends where --max-steps does
            count = min(count, max(1, o.max_steps - st.step) * batch)
        steps = -(-count // batch)
        flat = FlatModel(self.model)
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        report = None
        try:
            broadcast_parameters(tensors, root=0, world=self.world)  # version 0 everywhere
            if self.world.rank == 0:
                indices = st.sampler.slice_at(st.sampler.cursor, count, 0, 1).indices
                step0 = st.step
                report = Aggregator(
                    self.world, flat, indices, global_batch=batch,
                    max_delay=strategy.max_delay,
                    apply=lambda n, slot: self._apply_async_update(n, batch, step0 + slot)).run()
            else:
                worker = AsyncWorker(self.world, flat)
                while True:
                    work = worker.next_batch()
                    if work is None:
                        break
                    yield from self._async_batch(worker, work)
            control = self._round_control(report)
            MPICommunicator(self.world).allreduce(control, ReduceOp.SUM)
            broadcast_parameters(tensors, root=0, world=self.world)  # rank 0's model for all
        except world_mod.FAILURES as exc:
            self._step_open = False
            self._recover(exc, step_given_up=True)  # or ends the job
            return 0
        step0 = st.step
        self._used_settings = optimizer_settings(self.optimizer.optimizer)
        st.sampler.advance(count)
        st.step += steps
        self._in_flight = None  # committed
        self._read_control(control, count)
        # Only finite updates were applied; the guard counts updates, not rounds: a round
        # that applied none adds its non-finite updates to the run, one that applied any
        # ends it.
        self._nonfinite_run = 0 if math.isfinite(self.last_loss) else \
            self._nonfinite_run + max(1, self._round_nonfinite)
        t_end = time.perf_counter()
        self._step_time = t_end - self._t_step
        self.world.watch.note_step(self._step_time / max(steps, 1))
        self._last_count = count
        if report is not None:
            self._record_round(report, step0, steps)
        return count

    def _async_batch(self, worker, work) -> Iterator[Any]:
        """A worker's batch of a round: the (micro-)batches to yield; ``step(loss)`` after
        the last sends the gradient to the aggregator."""
        o = self.options
        micro = split_micro(work.indices, o.max_local_batch)
        for p in self.model.parameters():
            p.grad = None
        self._async_work = (worker, work, time.perf_counter())
        # --slow-compute: the rank's straggling, as in synchronous steps
        self._slept = self._slow_down(o.slow_compute, self._own_compute)
        self._loss_sum = 0.0
        self._step_open = True
        yield from self._yield_micro(micro, len(work.indices), self.loader.load)
        self._async_work = None

    def _send_async_update(self, clip_grad_norm: Optional[float]) -> None:
        worker, work, t0 = self._async_work
        if clip_grad_norm is not None:  # each update's gradient, as each step's
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip_grad_norm)
        compute = time.perf_counter() - t0
        self._own_compute = max(0.0, compute - self._slept)
        try:
            worker.send_update(work.batch_id, len(work.indices), self._loss_sum, compute)
        finally:
            self._step_open = False

    def _apply_async_update(self, samples: int, batch: int, step: int) -> None:
        """The aggregator's application of ``samples`` samples' aggregated gradient (set
        in ``.grad``) as part of global batch ``step``: the job's optimizer at that step's
        rate (a ramp moves it within a round) scaled by samples / batch."""
        inner = self.optimizer.optimizer
        h = self.state.hyper
        rate = h.lr_at(step) if h.ramp is not None else h.lr
        factor = rate / self.state.applied_lr * samples / batch
        rates = [g["lr"] for g in inner.param_groups]
        for g, lr in zip(inner.param_groups, rates):
            g["lr"] = lr * factor
        try:
            inner.step()
        finally:
            for g, lr in zip(inner.param_groups, rates):
                g["lr"] = lr

    def _round_control(self, report) -> np.ndarray:
        """The control slots of a round: rank 0 fills the loss and each worker's mean time
        per update (its own compute slot stays 0: it trained nothing), every rank its stop
        signal, rank 0 the stop file."""
        layout = self._control_layout()
        values = layout.zeros()
        if report is not None:
            # a round in which every update was non-finite reads as a non-finite loss
            nothing = report.nonfinite_updates and not report.applied_updates
            values[layout.LOSS] = float("nan") if nothing else report.loss_sum
            for w, n in report.updates.items():
                per_update = report.round_s / n
                compute = report.compute_s.get(w, 0.0) / n
                layout.put_rank(values, w, step_s=per_update, compute_s=compute,
                                wait_s=max(0.0, per_update - compute),
                                samples=report.trained.get(w, 0))
            values[layout.slot(layout.STEP, 0)] = report.round_s / max(report.applications, 1)
            stop_file = self.options.stop_file
            values[layout.STOP_FILE] = 1.0 if stop_file and os.path.exists(stop_file) else 0.0
            values[layout.NONFINITE_UPDATES] = report.nonfinite_updates
        values[layout.STOP_SIGNAL] = 1.0 if self.stop_signals is not None and \
            self.stop_signals.received else 0.0
        return values

    def _record_round(self, report, step0: int, steps: int) -> None:
        """Rank 0: the round's line in the metrics (updates applied and dropped, delays),
        the job's totals, and the samples each applied update trained on."""
        st = self.state
        if report.nonfinite_updates:
            log.warning("steps %d-%d: %d update(s) with a non-finite loss or gradient skipped "
                        "(their samples count as used)", step0, st.step - 1,
                        report.nonfinite_updates)
        totals = self._async_totals
        for key in ("applied_updates", "dropped_updates", "nonfinite_updates", "applications",
                    "pulls"):
            totals[key] = totals.get(key, 0) + getattr(report, key)
        totals["rounds"] = totals.get("rounds", 0) + 1
        for name in ("delays_applied", "delays_dropped"):
            hist = totals.setdefault(name, {})
            for delay, n in getattr(report, name).items():
                hist[str(delay)] = hist.get(str(delay), 0) + n
        self.sink.write(dict({"event": "bounded-delay", "step": st.step, "epoch": st.epoch,
                              "first_step": step0, "steps": steps,
                              "max_delay": st.strategy.max_delay,
                              "world_size": self.world.size}, **report.to_dict()))
        if self._sample_file is not None:
            for slot, worker, indices in report.applied:
                self._sample_file.write(json.dumps({
                    "epoch": st.epoch, "step": step0 + slot, "rank": worker,
                    "size": self.world.size, "version": self.world.cluster_version,
                    "indices": indices.tolist()}) + "\n")

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
        if not self._step_open or self._micro_left <= 0:
            raise ConfigurationError("job.step(loss) is called once per batch the loader "
                                     "yields, inside `for batch in loader`")
        if scaler is not None and not scaler.is_enabled():
            scaler = None
        if scaler is not None and not self.state.strategy.averages_gradients:
            raise ConfigurationError(
                f"mixed precision with a GradScaler needs --strategy ssgd (under "
                f"{self.state.strategy.name} each replica's scaler would skip its own steps "
                f"and the scales would drift apart); train in bf16 without a scaler instead")
        self._loss_sum += float(loss.detach()) * self._micro_n
        scaled = loss * self._micro_share if self._micro_share != 1.0 else loss
        if self._async_work is not None:
            # bounded delay: the gradient stays local until it is sent to the aggregator
            with self.optimizer.no_sync():
                scaled.backward()
            self._micro_left -= 1
            if self._micro_left == 0:
                self._send_async_update(clip_grad_norm)
                return True
            return False
        if scaler is not None:
            scaled = scaler.scale(scaled)
        last = self._micro_left == 1
        if last:
            self._stage_control()
            scaled.backward()
        else:
            with self.optimizer.no_sync():
                scaled.backward()
        self._micro_left -= 1
        return self._finish_step(clip_grad_norm, scaler) if last else False

    def _finish_step(self, clip_grad_norm: Optional[float] = None,
                     scaler: Optional[Any] = None) -> bool:
        """The step's exchange and update; whether the step committed."""
        st = self.state
        t1 = time.perf_counter()
        try:
            faults.point("gradient", st.step)
            stats = self.optimizer.synchronize()
        except world_mod.FAILURES as exc:
            self._recover(exc, step_given_up=True)  # or ends the job
            return False
        self._slow_down(self.options.slow_comm, time.perf_counter() - t1)  # --slow-comm
        t2 = time.perf_counter()
        self._read_control(stats.extras, self._part.global_count)
        # The global loss arrived with the gradients: every rank sees the same value, so all
        # skip a non-finite step together, with no extra collective. (With a scaler,
        # overflowing gradients are the scaler's business: it skips and lowers the scale.)
        grads_finite = not (self.monitored and self.world.size > 1
                            and not math.isfinite(stats.global_sqnorm))
        finite = math.isfinite(self.last_loss) and (grads_finite or scaler is not None)
        self._used_settings = optimizer_settings(self.optimizer.optimizer)
        if finite:
            self._nonfinite_run = 0
            inner = self.optimizer.optimizer
            if scaler is not None:
                scale = float(scaler.get_scale())
                scaler.unscale_(inner)  # the averaged gradients, identical on every rank
                stats = GradientStats(stats.local_sqnorm_mean / scale ** 2,
                                      stats.global_sqnorm / scale ** 2, stats.extras)
                if self.monitored and self.world.size == 1:
                    grads_finite = all(bool(torch.isfinite(g).all())
                                       for g in self.optimizer.flat_gradients())
            if self.monitored and grads_finite:
                self._update_monitors(stats, self._part.global_count)
            self._keep_previous_gradients()
            if clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip_grad_norm)
            if scaler is None:
                inner.step()
            else:
                scaler.step(inner)
                scaler.update()
                if float(scaler.get_scale()) < scale:
                    self._prev_grads = None  # an overflow: no gradient to compare with
        else:
            self._nonfinite_run += 1
            self._prev_grads = None
            if self.world.rank == 0:
                log.warning("step %d: the loss or gradient is not finite (loss %s); the update "
                            "is skipped (%d in a row)", st.step, self.last_loss,
                            self._nonfinite_run)
        st.sampler.advance(self._part.global_count)
        st.step += 1
        self._in_flight = None  # committed: a failure from here on redoes nothing
        if st.strategy.averages_after(st.step - 1) and self.world.size > 1:
            try:
                self.optimizer.average_models()  # local SGD: the replicas become one
            except world_mod.FAILURES as exc:
                self._recover(exc)  # the step is done on every survivor; training goes on
                return True
        t3 = time.perf_counter()
        self._prev_local = (t3 - self._t_step, t1 - self._t_step, t2 - t1)
        self._own_compute = max(0.0, t1 - self._t_step - self._slept)
        self._step_time = t3 - self._t_step
        self.world.watch.note_step(self._step_time)
        self._last_count = self._part.global_count
        self._step_open = False
        return True

    def _slow_down(self, factor: float, seconds: float) -> float:
        """--slow-rank R with --slow-compute/--slow-comm F: rank R takes F times as long for
        its compute (a sleep before forward, as long as (F - 1) x the last step's compute)
        or its communication (after the step's exchange), so that strategies can be
        compared against a straggler or a slow link on one machine (tests, benchmarks)."""
        o = self.options
        if o.slow_until is not None and self.state.step >= o.slow_until:
            return 0.0
        if factor > 1.0 and o.slow_rank == self.world.rank and seconds > 0:
            time.sleep((factor - 1.0) * seconds)
            return (factor - 1.0) * seconds
        return 0.0

    # -- control slots: loss, timings, stop votes (the step's control reduction) ------------
    def _slot_ranks(self) -> int:
        """Ranks the slots have room for: the most this job can grow to (the layout stays
        the same across resizes)."""
        cap = self.elastic.allocator.capacity() if self.elastic is not None else 0
        return max(self.world.size, cap)

    def _control_layout(self) -> ControlLayout:
        return ControlLayout(self._slot_ranks())

    def _stage_control(self) -> None:
        """This rank's control values, sent with the step's gradients."""
        layout, rank = self._control_layout(), self.world.rank
        values = layout.zeros()
        values[layout.LOSS] = self._loss_sum
        step_t, compute_t, wait_t = self._prev_local
        layout.put_rank(values, rank, step_s=step_t, compute_s=compute_t, wait_s=wait_t,
                        samples=len(self._part.indices))
        stop_file = self.options.stop_file
        values[layout.STOP_FILE] = 1.0 if rank == 0 and stop_file and os.path.exists(stop_file) \
            else 0.0
        values[layout.STOP_SIGNAL] = 1.0 if self.stop_signals is not None and \
            self.stop_signals.received else 0.0
        self.optimizer.stage_extras(values)

    def _read_control(self, values: np.ndarray, global_count: int) -> None:
        reading = self._control_layout().read(values, self.world.size, global_count)
        self.last_loss = reading.loss
        self.last_times = reading.times
        self._stop_requested = reading.stop_signal
        self._finish_requested = reading.stop_file
        self._round_nonfinite = reading.nonfinite_updates

    # -- hyper-parameters ------------------------------------------------------------------
    def _apply_lr(self, lr: float) -> None:
        """Move every param group's rate by the factor the reference rate moved (groups keep
        their ratios; a user's scheduler composes with it)."""
        if lr == self.state.applied_lr:
            return
        factor = lr / self.state.applied_lr
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * factor
        self.state.applied_lr = lr

    def _apply_momentum(self, momentum: float) -> None:
        applied = False
        for group in self.optimizer.param_groups:
            if "momentum" in group:
                group["momentum"] = momentum
                applied = True
        if not applied and self.world.rank == 0:
            log.warning("momentum %.3g not applied: the optimizer (%s) has no SGD momentum "
                        "(Adam's betas are left as they are)", momentum,
                        type(self.optimizer.optimizer).__name__)

    # -- the step boundary -----------------------------------------------------------------
    def _boundary(self, count: int, *, round_end: bool = False) -> bool:
        """Between two steps, on every rank: metrics, stop, policies, resizes. Returns
        whether training goes on in this epoch."""
        st = self.state
        self._epoch_samples += count
        self._epoch_losses.append(self.last_loss)
        self._log_step(count)
        if self._stop_requested:
            self._stop_for_signal()
            return False
        if self._nonfinite_run >= self.options.max_nonfinite_steps:
            self._stop_for_divergence()
            return False
        if self._finish_requested:
            self.finished_by_stop_file = True
            if self.world.rank == 0:
                log.info("stop file %s found at step %d: training ends here",
                         self.options.stop_file, st.step)
            return False
        if self._max_steps_reached():
            return False
        every = self.options.checkpoint_every
        # the steps this boundary closes: one, or a bounded-delay round's
        closed = max(1, -(-count // st.hyper.batch_size))
        # (not while the loss is non-finite: the last good save is not written over)
        if every and self.options.checkpoint and self.world.rank == 0 \
                and st.step // every > (st.step - closed) // every and not self._nonfinite_run:
            self._save_periodically()
        # A recovery inside a hook or the grow's poll ends the boundary at once: the other
        # survivors may already be in the next step, which every rank then starts afresh
        # (another collective of this boundary would meet no partner).
        queued, self._queued_hooks = self._queued_hooks, []
        for name, extra in queued:
            self._hook(name, **extra)
            if self.left:
                return False
            if self._recovered:
                return True
        if self.engine.active and (round_end or self.engine.due(st.step, self.monitored)):
            self._hook("after_step")
            if self._recovered:
                return True
        if not self.left:
            self._poll_elastic()
        if self.allocator is not None and hasattr(self.allocator, "reap"):
            self.allocator.reap()  # launchers of workers that exited: no zombies
        return not self.left

    def _over(self) -> bool:
        return bool(self.left or self.stopped or self.finished_by_stop_file
                    or self._max_steps_reached())

    def _max_steps_reached(self) -> bool:
        return self.options.max_steps is not None and self.state.step >= self.options.max_steps

    def _hook(self, name: str, **extra: Any) -> None:
        """Rank 0 decides with the policies; every rank applies the same plan."""
        if not self.engine.active:
            return
        plan_text = ""
        snap = decisions = None
        if self.world.rank == 0:
            snap = self.snapshot()
            decisions = self.engine.decide(name, snap, **extra)
            if decisions:
                plan_text = self.engine.plan(decisions, snap, self.world.cluster_version).to_json()
        try:
            faults.point("plan", self.state.step)
            plan_text = root_tells(plan_text or None, self.world, what="the plan's broadcast")
            if plan_text:
                self._apply_decided_plan(plan_text, snap, decisions)
        except world_mod.FAILURES as exc:
            self._recover(exc)  # or ends the job

    def _apply_decided_plan(self, plan_text: str, snap, decisions) -> None:
        """Every rank: the plan rank 0 broadcast, checked, recorded (rank 0) and applied."""
        plan = Plan.from_json(plan_text)
        if plan.version != self.world.cluster_version:
            raise HpcAdaptError(f"a plan of cluster version {plan.version} reached version "
                                f"{self.world.cluster_version}")
        if self.world.rank == 0:
            for d in plan.decisions:
                self.sink.write(DecisionRecord(
                    step=snap.step, epoch=snap.epoch, policy=d["policy"], changes=d["changes"],
                    reason=d["reason"], metrics=d["metrics"], world_size=self.world.size,
                    batch_size=plan.batch_size or snap.batch_size,
                    lr=plan.lr or (plan.ramp[3] if plan.ramp else snap.lr)))
                log.info("decision at step %d by %s: %s (%s)", snap.step, d["policy"],
                         d["changes"], d["reason"])
        if self.world.rank == 0:
            self.engine.told(decisions, snap)
        # The policies' state after a decision goes to every rank (one small broadcast per
        # decision, in the world that decided, before a resize changes it): a worker that
        # becomes the coordinator (rank 0 died) then holds it as of the last decision, so no
        # decision already applied is taken again.
        state = root_tells(self.engine.state_dict() if self.world.rank == 0 else None,
                           self.world, what="the policies' state")
        if self.world.rank != 0:
            self.engine.load_state_dict(state)
        self._apply_plan(plan)

    def _apply_plan(self, plan: Plan) -> None:
        """The hyper-parameters change together; then a resize, if asked for."""
        h = self.state.hyper
        new = replace(h)
        if plan.batch_size is not None:
            new.batch_size = plan.batch_size
        if plan.momentum is not None:
            new.momentum = plan.momentum
        if plan.lr is not None:
            new.lr, new.ramp = plan.lr, None
            new.base_lr, new.base_batch_size = plan.base_lr, plan.base_batch_size
        if plan.ramp is not None:
            new.ramp = tuple(plan.ramp)
            if plan.ramp[1] == 0:
                new.lr, new.ramp = plan.ramp[3], None
        self.state.hyper = new
        if plan.momentum is not None:
            self._apply_momentum(plan.momentum)
        if plan.strategy is not None:
            self._switch_strategy(Strategy.from_dict(plan.strategy), plan.reason or "policy")
            if self._recovered:
                return  # a peer died in the switch: the rest of the plan was for that world
        if plan.topology is not None:
            self.switch_topology(plan.topology, plan.reason or "policy")
        if plan.world_size is not None and plan.world_size != self.world.size:
            self.request_resize(plan.world_size, plan.reason or "policy",
                                remove=[plan.remove_rank] if plan.remove_rank is not None else None)

    def switch_strategy(self, strategy: Strategy, reason: str = "user request") -> None:
        """Change the synchronisation strategy from the next step on; call on every rank at
        the same point between steps (policies do it through a plan)."""
        self._switch_strategy(strategy, reason)

    def switch_topology(self, topology: str, reason: str = "user request") -> None:
        """The gradients' allreduce topology from the next step on (``hpcadapt.comm.topology``:
        flat, hierarchical, ring, tree); every rank at the same point between steps. The
        new communicators are built collectively before the next step's first allreduce;
        the cluster version goes up."""
        from hpcadapt.comm.topology import parse_topology

        name = parse_topology(topology).value
        st = self.state
        if name == st.topology:
            return
        if self.optimizer.data_plane == "nccl":
            if self.world.rank == 0:
                log.warning("allreduce topology %s not applied (%s): the gradients travel "
                            "over NCCL, which routes them itself", name, reason)
            return
        old, version = st.topology, self.world.cluster_version
        st.topology = name
        self.world.bump_version()
        if self.world.rank == 0:
            log.info("allreduce topology %s -> %s at step %d (%s)", old, name, st.step, reason)
        self.sink.write({"event": "topology", "step": st.step, "epoch": st.epoch,
                         "from": old, "to": name, "reason": reason,
                         "previous_cluster_version": version,
                         "cluster_version": self.world.cluster_version})

    def _switch_strategy(self, new: Strategy, reason: str) -> None:
        """Every rank, at a step boundary. Into S-SGD or bounded delay from model averaging
        the replicas become one again: the plain average of all models, then rank 0's
        parameters and optimizer state broadcast (so they are bit-identical whatever the
        reduction order); out of bounded delay rank 0's optimizer state is broadcast.
        A peer dying in these collectives is recovered from like any step's: the plan is
        then dropped and the old strategy kept (the cluster version went up)."""
        from hpcadapt.parallel.optimizer import broadcast_optimizer_state, broadcast_parameters

        st = self.state
        old = st.strategy
        if new == old:
            return
        version = self.world.cluster_version
        identical = None
        t0 = time.perf_counter()
        # Into ssgd, or into bounded delay (which starts from rank 0's model), from a
        # strategy whose replicas drift apart: the replicas become one (their average).
        into_one = new.averages_gradients or new.asynchronous
        drifting = not (old.averages_gradients or old.asynchronous)
        if into_one and drifting and self.world.size > 1:
            try:
                self.optimizer.average_models()
                broadcast_parameters(list(self.model.parameters()) + list(self.model.buffers()),
                                     root=0, world=self.world)
                broadcast_optimizer_state(self.optimizer.optimizer, root=0, world=self.world)
            except world_mod.FAILURES as exc:
                self._recover(exc)
                if self.world.rank == 0:
                    log.error("strategy switch %s -> %s discarded (a peer died in it); "
                              "training goes on with %s", old.name, new.name, old.describe())
                return
            identical = self.replicas_identical() if self.options.check_replicas else None
        elif old.asynchronous and self.world.size > 1:
            # out of bounded delay: only rank 0's optimizer stepped (the models are rank
            # 0's since the round's end); its state goes to every rank
            try:
                broadcast_optimizer_state(self.optimizer.optimizer, root=0, world=self.world)
            except world_mod.FAILURES as exc:
                self._recover(exc)
                return
            identical = self.replicas_identical() if self.options.check_replicas else None
        st.strategy = new
        self.world.bump_version()
        if self.world.rank == 0:
            log.info("strategy %s -> %s at step %d (%s)", old.describe(), new.describe(),
                     st.step, reason)
        self.sink.write({"event": "strategy", "step": st.step, "epoch": st.epoch,
                         "from": old.to_dict(), "to": new.to_dict(), "reason": reason,
                         "previous_cluster_version": version,
                         "cluster_version": self.world.cluster_version,
                         "switch_s": time.perf_counter() - t0,
                         "replicas_identical": identical})

    # -- elastic membership ------------------------------------------------------------------
    def request_resize(self, new_size: int, reason: str = "user request", *,
                       remove: Optional[List[int]] = None) -> None:
        """Change the number of workers; call on every rank at the same point between steps
        (policies do it through a plan). A shrink happens now; a grow starts now and
        completes at a later step boundary, when the new workers are ready. Requests that
        cannot be met are clipped or refused with a logged reason; training goes on."""
        if self.elastic is None:
            if self.world.rank == 0:
                log.warning("resize to %d workers refused (%s): no allocator (start with "
                            "--max-workers); training goes on with %d", new_size, reason,
                            self.world.size)
            return
        target = self.elastic.clip(new_size, reason)
        if target is None:
            return
        if target < self.world.size:
            self._shrink(target, reason, remove)
        else:
            failed = self.elastic.start_grow(target, reason)
            if failed is not None:
                self._record_resize(failed)

    def _shrink(self, target: int, reason: str, remove: Optional[List[int]]) -> None:
        from hpcadapt.elastic.membership import ResizeOutcome, split_leavers

        old = self.world.size
        leavers = [r for r in (remove or []) if 0 < r < old][: old - target]
        for r in range(old - 1, 0, -1):
            if len(leavers) >= old - target:
                break
            if r not in leavers:
                leavers.append(r)
        t0 = time.perf_counter()
        new = split_leavers(self.world.comm, leavers)
        if new is None:
            self.left = True
            log.info("leaving the job (%s)", reason)
            return
        self.world.replace(new)
        self.elastic.allocator.released(old - target)
        self._after_resize(ResizeOutcome(old, target, reason, 0.0, True), t0, t0)

    def _poll_elastic(self) -> None:
        from hpcadapt.elastic.membership import ABANDON, JOIN, JoinAborted, ResizeOutcome

        if self.elastic is None:
            return
        self.elastic.keep_spares()  # rank 0, not while a grow is pending
        if not self.elastic.growing:
            return
        try:
            status, joiners, detail = self.elastic.poll_grow()
        except world_mod.FAILURES as exc:
            self._recover(exc)  # or ends the job
            return
        if status == ABANDON:
            self._record_resize(self.elastic.abandon(detail))
        elif status == JOIN:
            t0 = time.perf_counter()
            decided = self.elastic.decided_at()
            reason = self.elastic.pending.reason if self.elastic.pending else ""
            old, version = self.world.size, self.world.cluster_version
            workers = list(self.elastic.pending.workers) if self.elastic.pending else []
            previous, merged = self.world.comm, None
            try:
                # What cannot be polled between the joiner's first word and the
                # confirmation (Create_intercomm, Merge) runs under a watchdog.
                with self._join_watchdog(workers):
                    # Rank 0 sends each joiner the state over its own bridge before the
                    # whole job takes it in: a joiner dying until then is abandoned.
                    faults.point("join", self.state.step)
                    merged = self.elastic.join(joiners, self._send_state_over_bridge)
                    self.world.replace(merged, keep_old=True)
                    if self.elastic.spawns:  # spawned joiners take the state now
                        faults.point("state", self.state.step)
                        world_mod.agree_all_alive(self.world.comm)  # the joiners too
                        self._sync_state(receiving=False)
                    self._confirm_join()
            except JoinAborted as exc:
                self._record_resize(self.elastic.abandon(str(exc)))
                return
            except world_mod.FAILURES as exc:
                if world_mod.ULFM:
                    self._recover_during_join(exc, previous, merged, old,
                                              old + joiners, reason)
                    return
                if merged is None:
                    self._fail(exc)  # a rank of the running job itself failed
                # A joiner died after it merged: back to the old world, which holds only
                # the ranks that trained on (their state is untouched); the merged
                # communicator is left unfreed (freeing it would wait on the dead).
                self.world.replace(previous, version=version, keep_old=True)
                self.optimizer._ensure_current()
                if self.world.rank == 0:
                    for w in workers:
                        w.stop()
                self._record_resize(ResizeOutcome(
                    old, self.world.size, f"{reason}; abandoned: a joining worker died "
                    f"while it merged ({exc})", 0.0, False))
                return
            if previous != MPI_COMM_NULL():
                previous.Free()
            self._after_resize(ResizeOutcome(old, self.world.size, reason, 0.0, True), t0,
                               decided)

    def _recover_during_join(self, exc: BaseException, previous, merged, old: int,
                             target: int, reason: str) -> None:
        """ULFM: a death while the job joins spawned workers. Before the merge the parents
        agreed that one of them died and let the joiners go: the job recovers on its own.
        After it, every member of the merged world recovers together, the joiners too
        (they take the state from a survivor that holds it), so the grow is kept."""
        from hpcadapt.elastic.membership import ResizeOutcome

        if merged is not None:
            # Recorded first (by rank 0 while it lives; else the failure's old size says it).
            self._identical_after_resize = None
            self._record_resize(ResizeOutcome(old, self.world.size, f"{reason}; merged, then "
                                              f"a death during the join: the joiners recover "
                                              f"with the job", 0.0, True))
            if previous != MPI_COMM_NULL():
                world_mod.ABANDONED.append(previous)  # may hold the dead: never freed
        self._recover(exc)
        if merged is None:
            self._record_resize(ResizeOutcome(old, target, f"{reason}; abandoned: a rank of "
                                              f"the job died before the merge", 0.0, False))

    def _join_watchdog(self, workers):
        """The watchdog around a join's blocking steps: a joining worker whose launcher has
        exited (rank 0 sees it), a dead peer of the old world, or the --peer-timeout
        deadline ends the job as a failure does (state saved by rank 0, exit 75)."""
        old_watch = self.world.watch
        first_seen: Dict[str, float] = {}

        def check() -> Optional[str]:
            # A death the join's own bounded waits handle (the pending accept, the first
            # word, the state transfer) is given a few seconds to be handled there.
            reasons = [f"a joining worker {w.failed().replace(' during start-up', '')}"
                       for w in workers if w.failed()]
            dead = old_watch.dead()
            if dead:
                reasons.append(dead[1])
            now = time.perf_counter()
            for reason in reasons:
                if now - first_seen.setdefault(reason, now) > 5.0:
                    return reason
            return None

        def expire(reason: str) -> None:
            self._fail(world_mod.PeerFailure(reason, cause="join"))

        return world_mod.Watchdog(self.options.peer_timeout, "a join", expire, check)

    def _send_state_over_bridge(self, bridge, watch) -> None:
        """Rank 0, during a join: the state to one joiner over their two-process bridge."""
        watch.floor = self.options.peer_timeout
        view = CommView(bridge, self.world.cluster_version + 1, watch)
        self.state.broadcast(view, is_root=True)

    def _receive_state_over_bridge(self, bridge) -> None:
        """A joiner: the state from rank 0 over the bridge (bounded by --peer-timeout)."""
        watch = world_mod.PeerWatch(1, [], blind=True)
        watch.floor = self.options.peer_timeout
        view = CommView(bridge, -1, watch)
        self._joined_version = self.state.broadcast(view, is_root=False)

    def _confirm_join(self) -> None:
        """Every rank of a grown world, after the state transfer: one bounded allreduce (a
        ULFM agreement under ULFM) that completes only when every member (the joiners too)
        is alive and has the state."""
        if world_mod.ULFM:
            # The same outcome on every survivor (a death seen by some members only would
            # leave the others training in a world the first ones recover from).
            world_mod.agree_all_alive(self.world.comm)
            return
        one = np.ones(1, dtype=np.int64)
        wait = world_mod.wait_request
        from mpi4py import MPI

        wait(self.world.comm.Iallreduce(MPI.IN_PLACE, one, op=MPI.SUM), self.world.watch,
             "the join's confirmation")

    def _fail(self, exc: BaseException) -> None:
        """A peer died (or stayed silent past the deadline) in the middle of a step or a
        resize. The world's communicator cannot be used any more (MPICH neither errors nor
        completes a collective with a dead peer), so this rank ends the job: rank 0 saves
        the last committed state (the step in flight has changed nothing yet: the optimizer
        has not stepped, the cursor not moved) to --checkpoint, and every survivor exits
        with 75 so that the job script requeues and resumes from it. Never returns."""
        st = self.state
        exc = world_mod.as_failure(exc)  # under ULFM an MPI error is the failure
        detected = time.time()
        who = f"rank {exc.rank}" if exc.rank >= 0 else "a peer"
        log.error("%s of %d failed at step %d (%s); detected at %s: ending the job", who,
                  self.world.size, st.step if st else 0, exc,
                  time.strftime("%H:%M:%S", time.localtime(detected)) +
                  f".{int(detected * 1000) % 1000:03d}")
        code = EXIT_REQUEUE
        if self.world.rank == 0 and st is not None:
            self.sink.write({"event": "failure", "rank": exc.rank, "cause": exc.cause,
                             "detail": str(exc), "step": st.step, "epoch": st.epoch,
                             "world_size": self.world.size, "detected_unix": detected,
                             "waited_s": exc.waited_s,
                             "cluster_version": self.world.cluster_version})
            saved = False
            if self.options.checkpoint and not self.joining:
                self.stopped = "peer failure"
                saved = self._save_for_stop(f"the failure of {who}")
                if not saved:
                    code = 1
            else:
                log.error("nothing saved (%s): the state of step %d is lost; exit %d",
                          "no --checkpoint" if not self.options.checkpoint else
                          "a joined worker does not save", st.step, code)
            self._record_stop(f"the failure of {who}", saved, requeue=code == EXIT_REQUEUE)
        self.sink.close()
        if self._sample_file is not None:
            self._sample_file.close()
        self._close_loader()
        if self.elastic is not None and self.world.rank == 0:
            self.elastic.stop_spares()
            for w in self.elastic.pending.workers if self.elastic.pending is not None else []:
                w.stop()
            self.elastic.remove_join_folders()  # a pending grow's (its joiners are stopped)
        if self.allocator is not None:
            try:
                self.allocator.close(10.0)   # joined workers end on their own; then killed
            except Exception as err:  # pragma: no cover - best effort on the way out
                log.error("could not stop the joined workers: %s", err)
        if self.world.rank == 0:
            agent.record_exit_code(code)
        world_mod.leave_with_launch_siblings(5.0)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _recover(self, exc: BaseException, *, step_given_up: bool = False) -> None:
        """A peer died in the middle of a step or at its boundary. The survivors agree on
        who died (hpcadapt.elastic.recovery), form a world without it, and take the state of the
        survivor furthest on (one that finished the step in flight before the others
        noticed is one step ahead; the others have changed nothing yet); the step from that
        state's cursor is trained at the smaller size, so no sample is skipped or trained
        twice. Returns with ``_recovered`` set, or ends the job through ``_fail`` when the
        death cannot be survived (see ``recovery.unrecoverable``) or recovery fails.
        ``step_given_up``: the death cut a step (round) short, so what the loop body does
        after that ``job.step`` is undone at the next batch; a death at a boundary, in a
        join or after the step committed leaves the body's work of the committed step."""
        from hpcadapt.elastic import recovery
        from hpcadapt.elastic.membership import ResizeOutcome

        exc = world_mod.as_failure(exc)  # under ULFM an MPI error is the failure
        if self.options.on_failure != "recover" or exc.cause not in ("dead", "notice"):
            self._fail(exc)
        t0 = time.perf_counter()
        old_size, version = self.world.size, self.world.cluster_version
        shrunk = None

        def expire(reason: str) -> None:
            self._fail(world_mod.PeerFailure(reason, cause="timeout"))

        try:
            faults.point("recovery", self.state.step)  # a second death, during the recovery
            if world_mod.ULFM:
                with world_mod.Watchdog(self.options.peer_timeout, "the shrink", expire):
                    agreement, shrunk = recovery.shrink(self.world)
            else:
                agreement = recovery.agree(self.world, [exc.rank] if exc.rank >= 0 else [],
                                           self.options.peer_timeout)
        except world_mod.FAILURES as again:
            self._fail(world_mod.as_failure(again, "the recovery"))
        t_agreed = time.perf_counter()
        why = recovery.unrecoverable(self.world, agreement,
                                     coordinator_may_move=self._coordinator_may_move(),
                                     launch_survives=world_mod.ULFM)
        if why is not None:
            self._fail(world_mod.PeerFailure(f"{exc}; no recovery: {why}",
                                             rank=agreement.dead[0] if agreement.dead else -1,
                                             cause="dead"))
        dead_pids = [self.world.pids[d] for d in agreement.dead]
        if self._in_flight is not None:
            # The step in flight is given up: this rank goes back to its last commit before
            # the survivors compare states (the one furthest on is then everyone's).
            self._in_flight.restore(self.extra, self.optimizer.optimizer, self.model)
            self._in_flight = None
        if self.elastic is not None and self.elastic.growing:
            # Joiners of a pending grow would connect to the old world: start again later.
            self._record_resize(self.elastic.abandon("a worker died"))
        rolled_from = self.state.step

        with world_mod.Watchdog(self.options.peer_timeout, "the recovery", expire):
            try:
                comm = shrunk if shrunk is not None else \
                    recovery.form_world(self.world.comm, agreement.survivors)
                t_formed = time.perf_counter()
                self.world.abandon()
                self.optimizer.abandon_in_flight()
                self.world.replace(comm)
                if 0 in agreement.dead and self.world.rank == 0:
                    self._take_coordinator_role()
                root, same = self._survey_survivors()
                t_surveyed = time.perf_counter()
                if not same:
                    policy_state = self.engine.state_dict() if self.world.rank == 0 else None
                    view = CommView(self.world.comm, self.world.cluster_version, self.world.watch)
                    self.state.broadcast(view, is_root=self.world.rank == root, root=root)
                    if policy_state is not None:
                        self.engine.load_state_dict(policy_state)  # rank 0's decide
                self._holds_state = True
            except world_mod.FAILURES as again:
                self._fail(world_mod.as_failure(again, "the recovery"))
        self._walk = None
        self._recovered = True
        self._step_open = False
        if step_given_up:
            self._undo_at_next_batch = StepCommit.take(self.state.step, self.extra,
                                                       self.optimizer.optimizer, self.model)
        recovered = time.time()
        phases = {"agree_s": t_agreed - t0, "form_world_s": t_formed - t_agreed,
                  "survey_s": t_surveyed - t_formed,
                  "state_broadcast_s": time.perf_counter() - t_surveyed if not same else None}
        if self.allocator is not None:
            self.allocator.released(len(agreement.dead))
            if hasattr(self.allocator, "reap"):
                self.allocator.reap()
        if self.world.rank == 0:
            log.warning("rank(s) %s of %d died (%s): recovered in %.3f s on %d workers, "
                        "training from step %d", list(agreement.dead), old_size, exc,
                        time.perf_counter() - t0, self.world.size, self.state.step)
        self.sink.write({"event": "failure", "recovered": True, "dead": list(agreement.dead),
                         "dead_pids": dead_pids, "rank": agreement.dead[0], "cause": exc.cause,
                         "detail": str(exc), "step": self.state.step, "step_in_flight":
                         rolled_from, "epoch": self.state.epoch, "old_size": old_size,
                         "world_size": self.world.size, "detected_unix": exc.detected_at,
                         "recovered_unix": recovered, "waited_s": exc.waited_s,
                         "recovery_s": recovered - exc.detected_at,
                         "cluster_version": self.world.cluster_version,
                         "previous_cluster_version": version, **phases})
        self._after_resize(ResizeOutcome(old_size, self.world.size,
                                         f"failure of rank(s) {list(agreement.dead)}", 0.0,
                                         True), t0)
        if self.options.replace_failed and self.elastic is not None:
            self.request_resize(self.world.size + len(agreement.dead),
                                f"replacing failed rank(s) {list(agreement.dead)}")

    def _coordinator_may_move(self) -> bool:
        """Rank 0's role can move where an agent waits for every worker: under
        ``hpcadapt.agent`` with the local allocator (a companion Slurm job's workers are
        not the agent's descendants, and the job step ends with rank 0's launch), unless
        the agent was asked to stop the job (a coordinator that a stop signal ended
        without --checkpoint is not replaced); and anywhere under ULFM, whose launch
        survives any rank. The same on every survivor: one agent, one environment, one
        allocator kind, one MPI."""
        from hpcadapt.elastic.allocator import LocalAllocator

        if world_mod.ULFM:
            return True  # the launch survives any rank's death; mpirun waits for the rest
        return (config.agent_dir() is not None and not agent.stopping()
                and isinstance(self.allocator, LocalAllocator))

    def _take_coordinator_role(self) -> None:
        """The lowest survivor after rank 0 died: it writes the metrics file from here on,
        decides with the policies, saves checkpoints, starts workers (its allocator) and
        prints the summary; the agent forwards stop signals to it. The policies' state
        reached every rank with the last applied decision; what is lost are the counters
        that moved since (cooldowns, probes: rank 0 alone held them). Every decision already
        applied (batch, rate, size) is in the training state that all ranks hold."""
        self.sink.close()
        self.sink = MetricsSink.take_over(self.options.metrics_file)
        self.joining = False  # a joiner no longer: it owns the checkpoint and the end
        if self.elastic is not None:
            self.elastic.warm_spares = self.options.warm_spares
        agent.record_coordinator()
        log.warning("rank 0 died: this worker (pid %d) is the coordinator now (metrics "
                    "file, decisions, checkpoint, allocator); the policies' counters "
                    "since the last decision are lost", os.getpid())

    def _survey_survivors(self):
        """(the lowest rank whose state is furthest on, whether every survivor's state is
        the same): one bounded allgather of each rank's step, a fingerprint of the rest
        (epoch, data cursor, hyper-parameters, strategy, topology) and cluster version. Equal
        steps mean equal weights under S-SGD (every rank applied the same updates; under
        model averaging the replicas differ by design), so equal fingerprints need no state
        broadcast."""
        st = self.state
        plain = json.dumps([st.epoch, st.sampler.cursor, asdict(st.hyper), st.applied_lr,
                            st.strategy.to_dict(), st.topology], sort_keys=True, default=str)
        # A joiner that has no state yet (a death during its join) counts as step -1.
        mine = np.array([st.step if self._holds_state else -1, zlib.crc32(plain.encode()),
                         self.world.cluster_version], dtype=np.int64)
        table = np.empty((self.world.size, 3), dtype=np.int64)
        world_mod.wait_request(self.world.comm.Iallgather(mine, table), self.world.watch,
                               "the recovery's state survey")
        # A survivor that applied one more boundary's switch than another holds a higher
        # version: all take the highest, so the next plan's version check agrees everywhere.
        self.world._version = int(table[:, 2].max())
        if table[:, 0].max() < 0:
            raise world_mod.PeerFailure("no survivor holds the training state (the ranks "
                                        "that did died during a join)", cause="dead")
        same = bool((table[:, :2] == table[0, :2]).all())
        return int(np.argmax(table[:, 0])), same

    def _join(self) -> None:
        """A worker started for a grow: connect, merge, receive the state."""
        from hpcadapt.elastic.membership import JoinTicket, ResizeOutcome, join_running_job

        from hpcadapt.elastic.membership import JoinAborted

        if self._spawned_to_join:
            self._join_spawned()
            return
        self._drop_spawn_parent()
        try:
            ticket = JoinTicket.claim(self._join_dir)
            # A warm spare idles here until a grow takes it (the deadline starts after).
            port = ticket.wait_for_port()
        except MembershipError as exc:
            log.info("not joining (%s): this worker exits", exc)
            logging.shutdown()
            os._exit(3)

        try:
            with world_mod.Watchdog(self.options.peer_timeout, "joining the job",
                                    _give_up_join):
                self.world.replace(join_running_job(ticket, self._receive_state_over_bridge,
                                                    port),
                                   version=self._joined_version)
                self._confirm_join()
        except (JoinAborted, world_mod.PeerFailure, MembershipError) as exc:
            _give_up_join(exc)
        self._holds_state = True
        self._after_resize(ResizeOutcome(-1, self.world.size, "joined", 0.0, True))
        log.info("joined as rank %d of %d at step %d", self.world.rank, self.world.size,
                 self.state.step)

    def _join_spawned(self) -> None:
        """A worker the job spawned (Open MPI): ready, merge, receive the state from rank 0.
        The wait for the job's word lasts as long as the job waits for its joiners."""
        from hpcadapt.elastic.membership import JoinAborted, ResizeOutcome, join_spawning_job

        wait_s = self.options.join_timeout + self.options.peer_timeout
        if self._spare_of:
            # A warm spare waits until a grow takes it (or its rank 0 is gone, or the job
            # tells it to go); its merge is bounded like a joiner's.
            wait_s = float("inf")
        try:
            # Bounded twice: the wait for the job's word has its deadline, and the watchdog
            # ends this process when Open MPI's connection set-up blocks (the job is gone).
            with world_mod.Watchdog(wait_s + 10.0, "waiting for the job's word",
                                    _give_up_join):
                merged = join_spawning_job(wait_s, self._spare_of)
        except MembershipError as exc:
            # The job gave the grow up, or ended: nothing failed here. This process's exit
            # is part of the launch's (mpirun's), whose code is the training's: exit 0
            # through MPI_Finalize (Open MPI counts an exit without it as a failure).
            log.info("not joining (%s): this worker exits", exc)
            sys.exit(0)
        except JoinAborted as exc:
            # A rank of the job died during the merge: the job recovers without this worker.
            # It ends through MPI_Finalize with 0 (Open MPI counts an exit without it as a
            # failure of the launch, whose code is the training's); the line says why.
            log.error("the join was given up (%s): this worker exits", exc)
            sys.exit(0)
        failure = None
        try:
            with world_mod.Watchdog(self.options.peer_timeout, "joining the job",
                                    _give_up_join):
                self.world.replace(merged)
                world_mod.agree_all_alive(merged)  # the job's ranks agree on it too
                self._sync_state(receiving=True)
                self._confirm_join()
        except world_mod.FAILURES as exc:
            if not (world_mod.ULFM and self.world.comm is merged):
                # The merged world is not this worker's: the job recovers without it. It
                # ends through MPI_Finalize with 0, so that the launch's exit code stays
                # the training's (the line says what happened).
                log.error("the join was given up (%s): this worker exits", exc)
                sys.exit(0)
            failure = exc
        if failure is not None:
            # A death during the join (ULFM): this worker recovers with the merged world and
            # takes the state from a survivor that holds it.
            self._recover(failure)
            log.info("joined as rank %d of %d at step %d, through the recovery from a death "
                     "during the join", self.world.rank, self.world.size, self.state.step)
            return
        self._holds_state = True
        self._after_resize(ResizeOutcome(-1, self.world.size, "joined", 0.0, True))
        log.info("joined as rank %d of %d at step %d", self.world.rank, self.world.size,
                 self.state.step)

    @staticmethod
    def _drop_spawn_parent() -> None:
        """A worker started by MPI_Comm_spawn joins through the port; it lets go of its parent."""
        from mpi4py import MPI

        parent = MPI.Comm.Get_parent()
        if parent != MPI.COMM_NULL:
            parent.Disconnect()

    def _sync_state(self, *, receiving: bool = True) -> None:
        """Broadcast the training state from rank 0 so every replica is identical. Ranks
        that already hold it (``receiving=False``: the running job's, after a grow) split
        off and take no part; the broadcast then reaches only the joiners."""
        from mpi4py import MPI

        rank = self.world.rank
        part = self.world.comm.Split(0 if (receiving or rank == 0) else MPI.UNDEFINED, rank)
        if part == MPI.COMM_NULL:
            return
        view = CommView(part, self.world.cluster_version, self.world.watch)
        try:
            version = self.state.broadcast(view, is_root=rank == 0)
        finally:
            part.Free()
        if rank != 0 and version != self.world.cluster_version:
            self.world._version = version

    def _after_resize(self, outcome, paused_at: float = float("nan"),
                      decided_at: float = float("nan")) -> None:
        """Every rank of the new world: rebuild what depends on the size, record the resize,
        and queue the policies' ``on_resize`` for the next boundary."""
        self.optimizer.set_extra_slots(self._control_layout().length)
        self.optimizer._ensure_current()
        self._identical_after_resize = None
        # Under model averaging the replicas differ by design: nothing to compare.
        if self.options.check_replicas and outcome.ok and self.state.strategy.averages_gradients:
            identical = self.replicas_identical()
            if not identical and self.world.rank == 0:
                log.error("replicas differ after the resize to %d workers", self.world.size)
            self._identical_after_resize = identical
        self._prev_local = (0.0, 0.0, 0.0)
        self._prev_grads = None
        self.last_times = None
        now = time.perf_counter()
        outcome = replace(outcome, pause_s=now - paused_at if paused_at == paused_at else 0.0,
                          decision_to_first_step_s=now - decided_at)
        self._record_resize(outcome)
        # Every rank of the new world queues it (the hook is collective); only rank 0, never
        # a joiner, decides with the sizes.
        self._queued_hooks.append(("on_resize", {"old_size": outcome.old_size,
                                                 "new_size": outcome.new_size}))

    def _record_resize(self, outcome) -> None:
        st = self.state
        row = {"old_size": outcome.old_size, "new_size": outcome.new_size, "ok": outcome.ok,
               "pause_s": outcome.pause_s, "reason": outcome.reason,
               "decision_to_first_step_s": outcome.decision_to_first_step_s, "step": st.step}
        self.resizes.append(row)
        if outcome.old_size < 0:
            return  # a joiner's view; rank 0 of the running job records the resize
        self.sink.write(ResizeRecord(step=st.step, epoch=st.epoch, old_size=outcome.old_size,
                                     new_size=outcome.new_size, reason=outcome.reason,
                                     pause_s=outcome.pause_s, ok=outcome.ok,
                                     cluster_version=self.world.cluster_version,
                                     world_size=self.world.size,
                                     batch_size=st.hyper.batch_size, lr=st.hyper.lr,
                                     decision_to_first_step_s=outcome.decision_to_first_step_s,
                                     replicas_identical=self._identical_after_resize
                                     if outcome.ok else None,
                                     pids=list(self.world.pids) if outcome.ok else None))
        if self.world.rank == 0:
            level = logging.INFO if outcome.ok else logging.WARNING
            log.log(level, "resize %d -> %d %s in %.3f s (%s)", outcome.old_size,
                    outcome.new_size, "done" if outcome.ok else "not done", outcome.pause_s,
                    outcome.reason)

    def _finish_elastic(self) -> None:
        """A grow still pending when training ends is abandoned on every rank."""
        if self.elastic is not None and self.elastic.growing and not self.left:
            self._record_resize(self.elastic.abandon("training ended first",
                                                     wait_s=self.options.peer_timeout))

    def _leave(self) -> None:
        """This rank left the job in a shrink: nothing of it is needed any more."""
        self._close_loader()
        self.sink.close()
        if self._sample_file is not None:
            self._sample_file.close()
        world_mod.shutdown()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # A rank that shares its launch leaves through the interpreter's normal exit (MPI
        # finalised by mpi4py's exit hook) after its siblings reached the end (shutdown
        # waited for them): ending it with os._exit made mpiexec SIGKILL the others in the
        # middle of their own exit now and then (exit 9 after a shrink of the first
        # launch). A rank alone in its launch skips the interpreter's teardown (about 0.7 s
        # with torch loaded), which gives the node back to Slurm that much sooner.
        # Open MPI's launcher counts a process that ends without MPI_Finalize as a failure
        # of the launch (exit 1): there every leaver goes through the normal exit.
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1 or flavour().open_mpi:
            sys.exit(0)
        os._exit(0)

    def replicas_identical(self) -> bool:
        """Whether every rank holds bit-identical parameters and buffers (one small
        allreduce)."""
        digest = int.from_bytes(bytes.fromhex(self.model_digest())[:7], "little")
        pair = np.array([digest, -digest], dtype=np.int64)
        communicator(self.world).allreduce(pair, ReduceOp.MAX)
        return bool(pair[0] == -pair[1])

    def model_digest(self) -> str:
        """A hash of this rank's parameters and buffers (BatchNorm's running statistics;
        hex): equal digests, identical replicas."""
        h = hashlib.blake2b(digest_size=16)
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            # bytes, whatever the dtype (bfloat16 has no numpy twin)
            raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            h.update(raw.numpy().tobytes())
        return h.hexdigest()

    # -- monitoring --------------------------------------------------------------------------
    def _update_monitors(self, stats, global_count: int) -> None:
        if self.world.size >= 2:
            # Ranks whose share was empty (a short last batch) carry no gradient sample.
            replicas = int(np.count_nonzero(self.last_times.samples)) if self.last_times \
                is not None else self.world.size
            if replicas < 2:
                return
            est = estimate_from_replicas(stats.local_sqnorm_mean, stats.global_sqnorm,
                                         replicas, global_count)
        else:
            grads = self.optimizer.flat_gradients()
            if self._prev_grads is None:
                return  # the step before was not kept (a resize, a skipped step)
            est = estimate_from_consecutive(grads, self._prev_grads, global_count,
                                            self._prev_count)
        if not self.state.gns.update(est, global_count):
            log.warning("step %d: non-finite gradient statistics skipped (|G|^2=%s, trS=%s)",
                        self.state.step, est.grad_sq, est.trace_sigma)

    def _keep_previous_gradients(self) -> None:
        """At world size 1 the next monitored step needs this step's gradient."""
        st = self.state
        if self.world.size == 1 and self.monitor_cfg.enabled and \
                (st.step + 2) % self.monitor_cfg.interval == 0:
            grads = self.optimizer.flat_gradients()
            if self._prev_grads is None or len(self._prev_grads) != len(grads):
                self._prev_grads = [g.clone() for g in grads]
            else:
                for dst, src in zip(self._prev_grads, grads):
                    dst.copy_(src)
            self._prev_count = self._part.global_count
        elif self.world.size > 1:
            self._prev_grads = None

    def _step_monitors(self) -> Dict[str, Any]:
        gns = self.state.gns
        out: Dict[str, Any] = {}
        if self.monitored and gns.last is not None:
            out.update(noise_scale=gns.noise_scale, grad_sq=gns.grad_sq,
                       trace_sigma=gns.trace_sigma,
                       grad_variance=gns.trace_sigma / self.state.hyper.batch_size,
                       grad_snr=gns.snr(self.state.hyper.batch_size))
        if self.last_times is not None:
            out.update(rank_step_time=self.last_times.step_time.round(6).tolist(),
                       rank_compute_time=self.last_times.compute_time.round(6).tolist(),
                       rank_wait_time=self.last_times.wait_time.round(6).tolist())
        return out

    def _node_count(self) -> int:
        """Nodes the world spans: emulated ones (--ranks-per-node) or real ones."""
        from hpcadapt.comm.topology import emulated_layout, layout_from_keys

        k = self.options.ranks_per_node
        layout = emulated_layout(self.world.size, k) if k is not None else \
            layout_from_keys([key for _, key, _ in self.world.peers])
        return len(layout.nodes)

    def snapshot(self):
        """What rank 0 knows at this step boundary, for the policies."""
        from hpcadapt.policies.base import MetricsSnapshot

        st, t, h = self.state, self.last_times, self.state.hyper
        return MetricsSnapshot(
            step=st.step, epoch=st.epoch, world_size=self.world.size,
            batch_size=h.batch_size, lr=h.lr, momentum=h.momentum,
            base_lr=h.base_lr, base_batch_size=h.base_batch_size, loss=self.last_loss,
            samples_per_s=(self._last_count / self._step_time) if self._step_time else float("nan"),
            epoch_progress=st.sampler.cursor / st.sampler.num_samples,
            test_accuracy=st.last_accuracy, monitored=self.monitored,
            noise_scale=st.gns.noise_scale, grad_sq=st.gns.grad_sq,
            trace_sigma=st.gns.trace_sigma,
            grad_variance=st.gns.trace_sigma / h.batch_size,
            grad_snr=st.gns.snr(h.batch_size),
            step_time=tuple(t.step_time.tolist()) if t else (),
            compute_time=tuple(t.compute_time.tolist()) if t else (),
            wait_time=tuple(t.wait_time.tolist()) if t else (),
            rank_samples=tuple(t.samples.tolist()) if t else (),
            max_workers=self._slot_ranks() if self.elastic is not None else self.world.size,
            min_workers=self.options.min_workers, can_resize=self.elastic is not None,
            max_local_batch=self.options.max_local_batch,
            cluster_version=self.world.cluster_version,
            resizing=bool(self.elastic is not None and self.elastic.growing),
            strategy=st.strategy.name, topology=st.topology, nodes=self._node_count())

    # -- metrics -------------------------------------------------------------------------------
    def _log_step(self, count: int) -> None:
        st = self.state
        used = self._used_settings
        self.sink.write(StepRecord(step=st.step, epoch=st.epoch, world_size=self.world.size,
                                   batch_size=st.hyper.batch_size, lr=used["lr"],
                                   momentum=used["momentum"], loss=self.last_loss,
                                   samples_per_s=count / self._step_time if self._step_time else 0.0,
                                   step_time_s=self._step_time,
                                   cluster_version=self.world.cluster_version,
                                   monitors=self._step_monitors(), betas=used["betas"],
                                   lr_groups=used["lr_groups"]))
        if self.options.progress and self.world.rank == 0 and st.step % 20 == 0:
            sys.stderr.write(f"\repoch {st.epoch} step {st.step} loss {self.last_loss:.4f} "
                             f"batch {st.hyper.batch_size} on {self.world.size} workers   ")

    def log_epoch(self, *, test_accuracy: Optional[float] = None, **extra: Any) -> None:
        """Record the epoch that just ended (call on every rank, inside ``job.epochs()``):
        the metrics line, the log, and the accuracy the policies see. Other keywords are
        the user's own metrics (``ema_accuracy=0.91``): numbers, kept in the epoch line
        and, the last of each, in the summary. Raises ConfigurationError for a value that
        is not a number or a name that is a built-in field of the epoch line."""
        from hpcadapt.base.metrics import user_metrics

        st = self._require_setup()
        mine = user_metrics(extra)
        if test_accuracy is not None:
            st.last_accuracy = float(test_accuracy)
        elapsed = time.perf_counter() - self._t_epoch
        losses = [x for x in self._epoch_losses if x == x]
        rec = EpochRecord(step=st.step, epoch=st.epoch, world_size=self.world.size,
                          batch_size=st.hyper.batch_size, lr=self._last_lr(),
                          loss=float(np.mean(losses)) if losses else float("nan"),
                          samples_per_s=self._epoch_samples / elapsed if elapsed else 0.0,
                          test_accuracy=st.last_accuracy if test_accuracy is not None
                          else float("nan"), epoch_time_s=elapsed,
                          cluster_version=self.world.cluster_version)
        self.sink.write({**asdict(rec), **mine})
        self.user_metrics.update(mine)
        self._epoch_logged = True
        if self.world.rank == 0:
            log.info("epoch %d: loss %.4f, test accuracy %.4f, %.0f samples/s, batch %d on "
                     "%d workers%s", st.epoch, rec.loss, rec.test_accuracy, rec.samples_per_s,
                     st.hyper.batch_size, self.world.size,
                     "".join(f", {k} {v:.4g}" for k, v in mine.items()))

    # -- preemption and checkpoints ------------------------------------------------------------
    def _resume(self, path: str) -> bool:
        """Every rank: rank 0 reads ``path`` if it exists and the state is broadcast."""
        error, found = "", False
        if self.world.rank == 0 and os.path.exists(path):
            found = True
            try:
                self.state.load(path, identity=self.identity)
            except (OSError, ValueError, KeyError, RuntimeError, TypeError,
                    ConfigurationError) as exc:
                error = (f"cannot resume from {path}: {exc}; remove it or pass another "
                         f"--checkpoint")
        verdict = root_tells({"error": error, "found": found} if self.world.rank == 0 else None,
                             self.world, what="the resume's verdict")
        if verdict["error"]:
            raise on_every_rank(ConfigurationError(verdict["error"]))
        if not verdict["found"]:
            return False
        self._sync_state()
        self._resumed_at = self.state.step
        if self.world.rank == 0:
            log.info("resumed from %s at epoch %d, step %d", path, self.state.epoch,
                     self.state.step)
            self.sink.write({"event": "resume", "step": self.state.step,
                             "epoch": self.state.epoch, "world_size": self.world.size,
                             "saved_world_size": self.state.world_size, "checkpoint": path,
                             "cluster_version": self.world.cluster_version})
            if self.state.strategy != self._initial_strategy:
                log.warning("resumed with the checkpoint's strategy %s (the flags say %s: "
                            "the run had switched; a policy may switch again)",
                            self.state.strategy.describe(), self._initial_strategy.describe())
            if self.state.topology != self.options.topology:
                log.warning("resumed with the checkpoint's allreduce topology %s (the flags "
                            "say %s: the run had switched)", self.state.topology,
                            self.options.topology)
        return True

    def save_checkpoint(self, path: str) -> None:
        """Rank 0: write the whole training state to ``path`` atomically."""
        self.state.world_size = self.world.size
        self.state.save(path, cluster_version=self.world.cluster_version,
                        identity=self.identity)

    def _stop_for_signal(self) -> None:
        """Every rank, at the boundary where a stop signal became known: rank 0 saves."""
        name = (self.stop_signals.received if self.stop_signals and self.stop_signals.received
                else "a stop signal on another rank")
        self.stopped = name
        saved = None
        if self.world.rank == 0:
            saved = self._save_for_stop(name)
            self._record_stop(name, saved, requeue=saved)
        if not root_tells(saved, self.world, what="the stop's verdict"):
            self.stopped = f"{name}; state NOT saved"

    def _record_stop(self, why: str, saved: bool, *, requeue: bool) -> None:
        """Rank 0: the stop's line in the metrics (plots mark it)."""
        st = self.state
        self.sink.write({"event": "stop", "step": st.step, "epoch": st.epoch,
                         "world_size": self.world.size, "signal": why, "saved": saved,
                         "checkpoint": self.options.checkpoint if saved else None,
                         "requeue": requeue, "cluster_version": self.world.cluster_version})

    def _stop_for_divergence(self) -> None:
        """Every rank: the loss stayed non-finite for --max-nonfinite-steps steps (updates
        under bounded delay). The state in memory is not the last good one: the update
        before the run (a finite but exploding loss) was applied, so it is not saved; the
        last checkpoint on disk (a --checkpoint-every save or an earlier stop's) is kept
        and named. The job ends with exit code 1, not requeued (it would diverge again)."""
        st, n = self.state, self._nonfinite_run
        self._requeue = False
        unit = "updates" if st.strategy.asynchronous and self.world.size > 1 else "steps"
        name = f"{n} {unit} with a non-finite loss"
        self.stopped = f"{name}; state NOT saved"
        if self.world.rank != 0:
            return
        log.error("the loss was not finite for %d %s in a row (up to step %d, learning "
                  "rate %.4g, batch %d): training stops. Lower the learning rate (--lr), "
                  "clip gradients, or raise --max-nonfinite-steps", n, unit, st.step,
                  st.hyper.lr, st.hyper.batch_size)
        self._record_stop(name, False, requeue=False)
        path = self.options.checkpoint
        kept = checkpoint_step(path) if path else None
        if kept is not None:
            log.error("the state in memory holds the update that diverged and is not saved; "
                      "%s keeps the checkpoint of step %d", path, kept)
        else:
            log.error("the state in memory holds the update that diverged and is not saved; "
                      "no earlier checkpoint exists%s", "" if path else " (no --checkpoint)")

    def _save_periodically(self) -> None:
        """Rank 0, --checkpoint-every: a failed write is logged and training goes on."""
        try:
            self.save_checkpoint(self.options.checkpoint)
        except (OSError, RuntimeError) as exc:
            log.error("step %d: the periodic checkpoint could not be written to %s: %s; "
                      "training goes on, the previous checkpoint stays", self.state.step,
                      self.options.checkpoint, exc)

    def _save_for_stop(self, name: str) -> bool:
        st = self.state
        if self._resumed_at is not None and st.step - self._resumed_at < 20:
            log.warning("stopped again %d step(s) after resuming: the job gets its stop "
                        "signal right after it starts. Slurm sends --signal=SIG@T up to "
                        "60 s before T; make the time limit (--time) well longer than "
                        "T + 60 s", st.step - self._resumed_at)
        path = self.options.checkpoint
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

    # -- the end ---------------------------------------------------------------------------------
    def _last_lr(self) -> float:
        """The optimizer's rate at its last update (its rate now before the first)."""
        used = self._used_settings or optimizer_settings(self.optimizer.optimizer)
        return used["lr"]

    def summary(self) -> Dict[str, Any]:
        st = self._require_setup()
        return json_safe({"final_test_accuracy": st.last_accuracy, "steps": st.step,
                        "epochs": st.epoch, "world_size": self.world.size,
                        "batch_size": st.hyper.batch_size, "lr": self._last_lr(),
                        "left": self.left, "cluster_version": self.world.cluster_version,
                        "resizes": self.resizes, "stopped": self.stopped,
                        "strategy": st.strategy.name, "model_digest": self.model_digest(),
                        "user_metrics": dict(self.user_metrics),
                        **({"bounded_delay": self._async_totals}
                           if self._async_totals else {})})

    def finish(self, *, exit: bool = True) -> Dict[str, Any]:
        """End the job on every rank: rank 0 prints the summary as one line of JSON (and
        writes ``--summary-json``), the checkpoint of a finished training is removed, MPI
        is released. After a stop signal it exits with 75 (the job script requeues) or 1
        when the state could not be saved, unless ``exit=False`` (then see ``exit_code``)."""
        summary = self.summary()
        self._close_loader()
        if self.world.rank == 0:
            if self.options.progress:
                sys.stderr.write("\n")
            print(json.dumps(summary), flush=True)
            if self.options.summary_json:
                with open(self.options.summary_json, "w", encoding="utf-8") as f:
                    json.dump(summary, f)
        self.sink.close()
        if self._sample_file is not None:
            self._sample_file.close()
        if self.elastic is not None:
            self.elastic.stop_spares()
        if self.allocator is not None:
            self.allocator.close()
        self.exit_code = 0
        if self.stopped:
            # Requeue only from a saved state (rank 0 saves; the others follow its word).
            self.exit_code = EXIT_REQUEUE if self._requeue and \
                not self.stopped.endswith("NOT saved") else 1
        elif self.options.checkpoint and self.world.rank == 0 and not self.joining \
                and os.path.exists(self.options.checkpoint):
            os.unlink(self.options.checkpoint)
            log.info("training finished; removed the preemption checkpoint %s",
                     self.options.checkpoint)
        if self.world.rank == 0:
            agent.record_exit_code(self.exit_code)
        world_mod.shutdown()
        if exit and self.exit_code:
            sys.exit(self.exit_code)
        return summary

    def _close_loader(self) -> None:
        """The loader's worker processes end now, cleanly (their temporary folders go with
        them), not when the interpreter kills them on its way out."""
        loader = getattr(self, "loader", None)
        if loader is not None:
            try:
                loader.close()
            except Exception as exc:  # best effort on the way out
                log.warning("the data loader's workers did not stop cleanly: %s", exc)

    def _require_setup(self) -> TrainingState:
        if self.state is None:
            raise ConfigurationError("call job.setup(model, optimizer, loader) first")
        return self.state


def _options_of(args: Optional[argparse.Namespace], keywords: Mapping[str, Any]) -> JobOptions:
    """The options from a namespace of hpcadapt's flags (its unused flags warned about once,
    its policies built: ConfigurationError names a policy whose settings are unusable), or
    from keywords alone."""
    if args is None:
        return JobOptions(**keywords)
    from hpcadapt.policies import build_policies, unused_flags

    for message in unused_flags(args):
        log.warning("%s", message)
    policies = build_policies(args) if getattr(args, "policy", None) else []
    return JobOptions.from_args(args, **dict({"policies": policies}, **keywords))



def MPI_COMM_NULL():
    from mpi4py import MPI

    return MPI.COMM_NULL






def _give_up_join(reason) -> None:
    """A joining worker whose join failed (or whose watchdog expired, from its thread): one
    line, then exit 3 at once (a blocked MPI call cannot be left any other way)."""
    log.error("the join was given up (%s): this worker exits", reason)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(3)
