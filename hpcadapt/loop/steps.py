"""The step runner: one synchronous step's (micro-)batches, ``job.step``, the gradient
exchange with the control values, the update and its commit.

``StepRunner`` owns the step in flight (its share, micro-batch counters, timings, the state
a recovery undoes) and what the last committed step left for the boundary (loss, per-rank
times, stop votes, the optimizer's settings): no other module writes these. It reads the
job's parts (world, state, optimizer, options) and assigns none of the job's attributes
(it moves the training state's step and cursor, as a commit does): a failure in the
exchange comes back as a ``StepOutcome`` for ``Job.step`` to recover from, and one in the
loop's part of a step is raised to the loop's recovery scope."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from hpcadapt.base import faults
from hpcadapt.base.errors import ConfigurationError, on_every_rank
from hpcadapt.comm import world as world_mod
from hpcadapt.data.loader import WalkKey, split_micro
from hpcadapt.loop.parts import JobParts
from hpcadapt.loop.rounds import BoundedDelayRounds
from hpcadapt.adapt.control import ControlLayout, StepReport, StepTimes
from hpcadapt.parallel.optimizer import GradientStats
from hpcadapt.state.rollback import StepCommit
from hpcadapt.state.training import optimizer_settings, settings_applied
from hpcadapt.loop.recording import Recorder
from hpcadapt.adapt.engine import PolicyEngine
from hpcadapt.base.preemption import StopSignals
from hpcadapt.loop.monitoring import Monitoring

__all__ = ["StepOutcome", "StepRunner"]

log = logging.getLogger("hpcadapt.job")


@dataclass(frozen=True)
class StepOutcome:
    """What one ``job.step`` call ended in: ``committed`` (the step's update applied, or a
    bounded-delay worker's update sent); ``failure``, a peer's failure to recover from
    (``given_up``: it cut the step short, so the loop body's work after this call is undone
    at the next batch; a failure after the commit, in local SGD's averaging, keeps it)."""

    committed: bool
    failure: Optional[BaseException] = None
    given_up: bool = False


class StepRunner:
    """The synchronous step and what it leaves for the boundary; the bounded-delay rounds
    (``loop/rounds.py``) use its step-in-flight, control and commit parts."""

    def __init__(self, parts: JobParts, recorder: Recorder, engine: PolicyEngine,
                 signals: Optional[StopSignals], monitor: Monitoring, *,
                 follow_ramp: Callable[[], None], recoverable: Callable[[], bool],
                 slot_ranks: Callable[[], int], restart_pending: Callable[[], bool]):
        #: inside job.epochs()' loop body (a loader pass outside it is refused once done)
        self.in_epochs = False
        self.parts = parts
        self.recorder = recorder
        self.engine = engine     # its rate rule (adascale's gain is measured in the step)
        self.signals = signals   # a stop signal received: voted on in the step's control values
        self.monitor = monitor   # the noise scale measured inside the step
        self.follow_ramp = follow_ramp   # the reference rate of this step (Adaptation's)
        self.recoverable = recoverable   # whether a death is survived: keep what to undo
        self.slot_ranks = slot_ranks     # the control values' room: the most ranks (membership)
        #: bounded delay's rounds, driven through this runner's methods
        self.rounds = BoundedDelayRounds(parts, self, recorder, restart_pending=restart_pending)
        self.open = False            # a step (worker batch) whose job.step calls are due
        # The state the step (round) in flight may change, as of its start (rollback.py):
        # a recovery undoes the uncommitted step with it. None once the step commits.
        self.in_flight: Optional[StepCommit] = None
        # The agreed state after a recovery inside job.step: the user's code after that
        # call ran for a step given up, and is undone when the loop asks for the next batch.
        self.undo_at_next_batch: Optional[StepCommit] = None
        self.part = None             # this rank's share of the step in flight (StepSlice)
        self.micro_left = 0
        self._micro_share = 1.0
        self._micro_n = 0
        self.loss_sum = 0.0
        self._t_start = 0.0
        self._slept = 0.0            # --slow-compute's sleep in this step
        self._own_compute = 0.0      # the last step's compute without that sleep
        self._prev_local = (0.0, 0.0, 0.0)  # this rank's last (step, compute, wait) times
        self.step_time = 0.0
        self.last_count = 0          # the last step's (round's) global samples
        self.nonfinite_run = 0       # consecutive steps whose loss or gradient was not finite
        self.used_settings: dict = {}  # the optimizer's, at the last update
        self.monitored = False       # whether this step measures the gradient statistics
        self.last_loss = float("nan")
        self.last_times: Optional[StepTimes] = None
        self.stop_requested = False  # a stop signal, agreed with the last step's values
        self.finish_requested = False  # the stop file, seen by rank 0
        self._walk: Optional[WalkKey] = None
        self._walk_cursor = -1
        self._send: Optional[Callable[[Optional[float], float], None]] = None

    # -- the step in flight, for a recovery ----------------------------------------------
    def keep_in_flight(self, batches: int, weights: bool = False) -> None:
        """At a step's (round's) start: what it may change, for a recovery to undo. The
        user's state and the param groups only when the loop body runs more than once
        before the step commits (micro-batches, a round's batches): with one batch, the
        body after the failed ``job.step`` has not run when the recovery restores, and
        ``undo_at_next_batch`` covers it (no copy of an EMA model every step).
        ``weights``: the parameters too, and on rank 0 the optimizer's state (a
        bounded-delay round applies updates before it commits; only the aggregator, rank
        0, steps the optimizer in it)."""
        parts = self.parts
        if self.recoverable():
            self.in_flight = StepCommit.take(parts.state.step, parts.extra,
                                             parts.optimizer.optimizer, parts.model,
                                             user=batches > 1, weights=weights,
                                             optimizer_state=weights and parts.world.rank == 0)

    def roll_back(self) -> int:
        """A recovery: the step in flight is given up, this rank goes back to its last
        commit (before the survivors compare states). Returns the step it was at."""
        parts = self.parts
        if self.in_flight is not None:
            self.in_flight.restore(parts.extra, parts.optimizer.optimizer, parts.model)
            self.in_flight = None
        return parts.state.step

    def recovered(self, given_up: bool) -> None:
        """After a recovery, on the agreed state: the next step starts afresh (its loader
        walk too); ``given_up``: the loop body after the failed ``job.step`` ran for a step
        given up, so it is undone at the next batch (``undo_user_code_of_given_up_step``)."""
        parts = self.parts
        self._walk = None
        self.open = False
        if given_up:
            self.undo_at_next_batch = StepCommit.take(parts.state.step, parts.extra,
                                                      parts.optimizer.optimizer, parts.model)

    def undo_user_code_of_given_up_step(self) -> None:
        """The loop's next batch after a recovery inside ``job.step``: whatever the user's
        code after that call changed in the registered state (scheduler, EMA, counters,
        rates, buffers, random generator) goes back to the state the survivors agreed on,
        so that each committed step reaches the user's code once."""
        if self.undo_at_next_batch is not None:
            parts = self.parts
            self.undo_at_next_batch.restore(parts.extra, parts.optimizer.optimizer, parts.model)
            self.undo_at_next_batch = None

    def resized(self) -> None:
        """After a resize: the per-rank times of the old world mean nothing in the new."""
        self._prev_local = (0.0, 0.0, 0.0)
        self.last_times = None

    # -- the synchronous step ------------------------------------------------------------
    def sync_step(self) -> Iterator[Any]:
        """One synchronous step's (micro-)batches; returns the step's global sample count.
        A peer's failure in the exchange of an empty share goes to the loop's scope."""
        part, micro = self._begin_step()
        if not micro:
            self._stage_control()
            outcome = self._finish_step()
            if outcome.failure is not None:
                raise outcome.failure
        yield from self.yield_micro(micro, len(part.indices), self.parts.loader.next_batch)
        return part.global_count

    def yield_micro(self, micro, total: int, load) -> Iterator[Any]:
        """The micro-batches of one share of ``total`` samples, each loaded by ``load``;
        ``job.step(loss)`` must come once after each."""
        for i, indices in enumerate(micro):
            batch = load(indices)
            self.micro_left = len(micro) - i
            self._micro_share = len(indices) / total
            self._micro_n = len(indices)
            yield batch
            if self.micro_left == len(micro) - i:
                # this rank's alone (it may skip a step on its own data): every rank ends
                raise ConfigurationError("call job.step(loss) once for every batch the "
                                         "loader yields")

    @contextlib.contextmanager
    def epoch_body(self) -> Iterator[None]:
        """While the user's loop body of one epoch of ``job.epochs()`` runs."""
        self.in_epochs = True
        try:
            yield
        finally:
            self.in_epochs = False

    def begin_round(self) -> None:
        """A bounded-delay round's start: its clock, the ramp, the state it may change (a
        worker's batches: the loop body runs often; the aggregator's updates and the
        models the workers pull: a round given up is trained again from the weights every
        rank holds now), no gradient statistics."""
        self._t_start = time.perf_counter()
        self.monitored = False
        self.follow_ramp()
        self.keep_in_flight(batches=2, weights=True)

    def _begin_step(self):
        parts = self.parts
        st = parts.state
        world = parts.world
        self._t_start = time.perf_counter()
        self.follow_ramp()
        part = st.sampler.peek(st.hyper.batch_size, world.rank, world.size)
        cap = self.micro_cap()
        micro = split_micro(part.indices, cap)
        # before a loader restart (its workers' seeds) and forward (buffers) use the RNG
        self.keep_in_flight(len(micro))
        key = WalkKey(st.epoch, st.hyper.batch_size, world.rank, world.size, cap)
        if key != self._walk or self._walk_cursor != st.sampler.cursor:
            parts.loader.restart(key, st.sampler.cursor)
            self._walk = key
        self._walk_cursor = st.sampler.cursor + part.global_count
        self.part = part
        opt = parts.optimizer
        cfg = self.monitor.config
        self.monitored = cfg.enabled and (st.step + 1) % cfg.interval == 0
        opt.track_grad_norms = self.monitored and world.size > 1
        self.monitor.split.reset()
        opt.set_local_weight(part.weight)
        opt.set_extra_slots(self.control_layout().length)
        # The buckets zeroed in place and .grad left as their views: backward accumulates
        # into the buckets, and the hooks have nothing to copy (DDP's gradient_as_bucket_view).
        opt.zero_grad(set_to_none=False)
        # --slow-compute: before forward, (F - 1) x the last step's own compute (the sleep
        # left out of it, or each step's sleep would feed the next one's)
        self.open_step()
        opt.begin_step(st.step)
        # A step given up by a recovery is logged again when it is redone, with the new
        # world's cluster version: per step, the records of the highest version are the
        # ones that trained.
        self.recorder.log_samples(epoch=st.epoch, step=st.step, rank=world.rank,
                                  size=world.size, version=world.cluster_version,
                                  indices=part.indices)
        return part, micro

    def micro_cap(self) -> Optional[int]:
        """The most samples in one micro-batch: ``--max-local-batch``, and at world size 1
        with a gradient monitor on, half the batch: the two accumulation passes are the two
        replicas of the noise-scale estimator (``hpcadapt.adapt.monitors.SplitStep``). Every
        step is split then, monitored or not, so that the loader's walk stays one walk."""
        parts = self.parts
        cap = parts.options.steps.max_local_batch
        if self.monitor.split_is_on():
            half = -(-parts.state.hyper.batch_size // 2)
            cap = half if cap is None else min(cap, half)
        return cap

    def open_step(self, send: Optional[Callable[[Optional[float], float], None]] = None
                  ) -> None:
        """A step's (a bounded-delay worker's batch's) ``job.step`` calls are due: its
        --slow-compute sleep, its loss sum from zero. ``send(clip_grad_norm, loss_sum)``:
        a bounded-delay worker's way to hand the update on after the last micro-batch."""
        self._slept = self._slow_down(self.parts.options.steps.slow_compute, self._own_compute)
        self.loss_sum = 0.0
        self._send = send
        self.open = True

    def close_step(self) -> None:
        self.open = False
        self._send = None

    def note_compute(self, seconds: float) -> None:
        """A bounded-delay worker's compute for its batch, sleep included: the next batch's
        --slow-compute sleep follows it with the sleep left out, as each synchronous step's."""
        self._own_compute = max(0.0, seconds - self._slept)

    def step(self, loss: torch.Tensor, *, clip_grad_norm: Optional[float] = None,
             scaler: Optional[Any] = None) -> StepOutcome:
        """``job.step``: backward of ``loss``, and after the last micro-batch the exchange
        and the update (see ``Job.step``)."""
        parts = self.parts
        if not self.open or self.micro_left <= 0:
            raise on_every_rank(ConfigurationError(
                "job.step(loss) is called once per batch the loader "
                "yields, inside `for batch in loader`"))
        if scaler is not None and not scaler.is_enabled():
            scaler = None
        strategy = parts.state.strategy
        if scaler is not None and not strategy.averages_gradients:
            raise on_every_rank(ConfigurationError(
                f"mixed precision with a GradScaler needs --strategy ssgd (under "
                f"{strategy.name} each replica's scaler would skip its own steps "
                f"and the scales would drift apart); train in bf16 without a scaler instead"))
        self.loss_sum += float(loss.detach()) * self._micro_n
        scaled = loss * self._micro_share if self._micro_share != 1.0 else loss
        if self._send is not None:
            # bounded delay: the gradient stays local until it is sent to the aggregator
            with parts.optimizer.no_sync():
                scaled.backward()
            self.micro_left -= 1
            if self.micro_left == 0:
                send = self._send
                try:
                    send(clip_grad_norm, self.loss_sum)
                except world_mod.FAILURES as exc:
                    # The aggregator died, or a recovery elsewhere revoked the world, while
                    # this worker computed: the round is given up, as a failed exchange.
                    return StepOutcome(committed=False, failure=exc, given_up=True)
                finally:
                    self.close_step()
                return StepOutcome(committed=True)
            return StepOutcome(committed=False)
        if scaler is not None:
            scaled = scaler.scale(scaled)
        last = self.micro_left == 1
        if last:
            self._stage_control()
            scaled.backward()
        else:
            with parts.optimizer.no_sync():
                scaled.backward()
            if self.monitored and parts.world.size == 1:
                self.monitor.pass_done(self._micro_share)
        self.micro_left -= 1
        return self._finish_step(clip_grad_norm, scaler) if last else \
            StepOutcome(committed=False)

    def _finish_step(self, clip_grad_norm: Optional[float] = None,
                     scaler: Optional[Any] = None) -> StepOutcome:
        """The step's exchange and update."""
        parts = self.parts
        st, world = parts.state, parts.world
        t1 = time.perf_counter()
        try:
            faults.point("gradient", st.step)
            stats = parts.optimizer.synchronize()
        except world_mod.FAILURES as exc:
            # In the user's code no exception may go: Job.step recovers, and the loop's
            # scope restarts the step when the loop asks for the next batch.
            return StepOutcome(committed=False, failure=exc, given_up=True)
        self._slow_down(parts.options.steps.slow_comm, time.perf_counter() - t1)  # --slow-comm
        t2 = time.perf_counter()
        self.read_control(stats.extras, self.part.global_count)
        # The global loss arrived with the gradients: every rank sees the same value, so all
        # skip a non-finite step together, with no extra collective. (With a scaler,
        # overflowing gradients are the scaler's business: it skips and lowers the scale.)
        grads_finite = not (self.monitored and world.size > 1
                            and not math.isfinite(stats.global_sqnorm))
        finite = math.isfinite(self.last_loss) and (grads_finite or scaler is not None)
        inner = parts.optimizer.optimizer
        self._record_settings()
        if finite:
            self.nonfinite_run = 0
            if self.monitored and world.size == 1:
                stats = self.monitor.split_stats(stats, self._micro_share)
            if scaler is not None:
                scale = float(scaler.get_scale())
                scaler.unscale_(inner)  # the averaged gradients, identical on every rank
                stats = GradientStats(stats.local_sqnorm_mean / scale ** 2,
                                      stats.global_sqnorm / scale ** 2, stats.extras)
            if self.monitored and world.size == 1:
                grads_finite = math.isfinite(stats.global_sqnorm)
            if self.monitored and grads_finite:
                self.monitor.update(stats, self.part.global_count, self.last_times)
            if clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(parts.model.parameters(), clip_grad_norm)
            with settings_applied(inner, st.rate_factor(), st.hyper.momentum):
                if scaler is None:
                    inner.step()
                else:
                    scaler.step(inner)
            if scaler is not None:
                scaler.update()
        else:
            self.nonfinite_run += 1
            if world.rank == 0:
                log.warning("step %d: the loss or gradient is not finite (loss %s); the update "
                            "is skipped (%d in a row)", st.step, self.last_loss,
                            self.nonfinite_run)
        self._commit(self.part.global_count, 1)  # a failure from here on redoes nothing
        if st.strategy.averages_after(st.step - 1) and world.size > 1:
            try:
                parts.optimizer.average_models()  # local SGD: the replicas become one
            except world_mod.FAILURES as exc:
                # The step is done on every survivor; training goes on. Its times (the
                # wait for the dead peer among them) are not the step's: left out.
                return StepOutcome(committed=True, failure=exc)
        t3 = time.perf_counter()
        self._prev_local = (t3 - self._t_start, t1 - self._t_start, t2 - t1)
        self._own_compute = max(0.0, t1 - self._t_start - self._slept)
        self.step_time = t3 - self._t_start
        world.watch.note_step(self.step_time)
        self.last_count = self.part.global_count
        self.open = False
        return StepOutcome(committed=True)

    def commit_round(self, count: int, steps: int, control: np.ndarray) -> None:
        """A bounded-delay round's commit on every rank: ``count`` samples as ``steps``
        steps (equal shares), and the round's control values (loss, times, stop votes)."""
        parts = self.parts
        self._record_settings()
        self._commit(count, steps)
        nonfinite_updates = self.read_control(control, count)
        # Only finite updates were applied; the guard counts updates, not rounds: a round
        # that applied none adds its non-finite updates to the run, one that applied any
        # ends it.
        self.nonfinite_run = 0 if math.isfinite(self.last_loss) else \
            self.nonfinite_run + max(1, nonfinite_updates)
        self.step_time = time.perf_counter() - self._t_start
        parts.world.watch.note_step(self.step_time / max(steps, 1))
        self.last_count = count

    def report(self) -> StepReport:
        """The last committed step (round), for its metrics line and the policies."""
        return StepReport(loss=self.last_loss, count=self.last_count,
                          step_time=self.step_time, times=self.last_times,
                          monitored=self.monitored, used_settings=dict(self.used_settings),
                          rate=self.last_rate())

    def last_rate(self) -> float:
        """The optimizer's rate at its last update (its rate now before the first)."""
        used = self.used_settings or optimizer_settings(self.parts.optimizer.optimizer)
        return used["lr"]

    def _record_settings(self) -> None:
        """The optimizer's settings as the update applies them (the policies' factor on the
        user's rates, a policy's momentum), for the step's metrics line and the summary."""
        inner, st = self.parts.optimizer.optimizer, self.parts.state
        with settings_applied(inner, st.rate_factor(), st.hyper.momentum):
            self.used_settings = optimizer_settings(inner)

    def _commit(self, count: int, steps: int) -> None:
        """``count`` samples committed as ``steps`` steps (a round's hold equal shares):
        the cursor, the step counter and the scale-invariant progress move; nothing is in
        flight any more."""
        self.parts.state.commit(count, steps, self.engine.lr_rule.rule == "adascale")
        self.in_flight = None

    def _slow_down(self, factor: float, seconds: float) -> float:
        """--slow-rank R with --slow-compute/--slow-comm F: rank R takes F times as long for
        its compute (a sleep before forward, as long as (F - 1) x the last step's compute)
        or its communication (after the step's exchange), so that strategies can be
        compared against a straggler or a slow link on one machine (tests, benchmarks)."""
        parts = self.parts
        o = parts.options
        if o.steps.slow_until is not None and parts.state.step >= o.steps.slow_until:
            return 0.0
        if factor > 1.0 and o.steps.slow_rank == parts.world.rank and seconds > 0:
            time.sleep((factor - 1.0) * seconds)
            return (factor - 1.0) * seconds
        return 0.0

    # -- the control values that travel with each step's gradients -----------------------
    def control_layout(self) -> ControlLayout:
        return ControlLayout(self.slot_ranks())

    def stop_signal_received(self) -> bool:
        signals = self.signals
        return signals is not None and signals.received is not None

    def _stage_control(self) -> None:
        """This rank's control values, sent with the step's gradients."""
        parts = self.parts
        layout, rank = self.control_layout(), parts.world.rank
        values = layout.zeros()
        values[layout.LOSS] = self.loss_sum
        step_t, compute_t, wait_t = self._prev_local
        layout.put_rank(values, rank, step_s=step_t, compute_s=compute_t, wait_s=wait_t,
                        samples=len(self.part.indices))
        stop_file = parts.options.stops.stop_file
        values[layout.STOP_FILE] = 1.0 if rank == 0 and stop_file and os.path.exists(stop_file) \
            else 0.0
        values[layout.STOP_SIGNAL] = 1.0 if self.stop_signal_received() else 0.0
        parts.optimizer.stage_extras(values)

    def read_control(self, values: np.ndarray, global_count: int) -> int:
        """The step's (round's) agreed control values; returns the round's non-finite
        updates (bounded delay)."""
        reading = self.control_layout().read(values, self.parts.world.size, global_count)
        self.last_loss = reading.loss
        self.last_times = reading.times
        self.stop_requested = reading.stop_signal
        self.finish_requested = reading.stop_file
        return reading.nonfinite_updates
