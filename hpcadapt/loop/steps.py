"""The synchronous step: a step's (micro-)batches, ``job.step``, the gradient exchange with the
control values, the update and its commit.

A part of ``hpcadapt.job.Job`` (a mixin): its methods work on the job's state, which
``Job.__init__`` and ``Job.setup`` create; this module holds one concern of it."""

from __future__ import annotations

import logging

import json
import math
import os
import time
from typing import Any, Iterator, Optional

import numpy as np
import torch

from hpcadapt.base import faults
from hpcadapt.base.errors import ConfigurationError
from hpcadapt.comm import world as world_mod
from hpcadapt.data.loader import WalkKey, split_micro
from hpcadapt.adapt.control import ControlLayout
from hpcadapt.parallel.optimizer import GradientStats
from hpcadapt.state.rollback import StepCommit
from hpcadapt.state.training import optimizer_settings, rates_scaled

__all__ = ["StepLoop"]

log = logging.getLogger("hpcadapt.job")


class StepLoop:
    """The synchronous step: a step's (micro-)batches, ``job.step``, the gradient
    exchange with the control values, the update and its commit."""

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
        """The reference rate of this step (a batch change's ramp moves it); the update
        applies it on top of the user's rates (``rates_scaled``)."""
        h = self.state.hyper
        if h.ramp is not None:
            h.lr = h.lr_at(self.state.step)
            if self.state.step - h.ramp[0] >= h.ramp[1]:
                h.ramp = None

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
            # In the user's code no exception may go: the recovery runs here, and the loop's
            # scope restarts the step when the loop asks for the next batch.
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
        inner = self.optimizer.optimizer
        with rates_scaled(inner, st.rate_factor()):
            self._used_settings = optimizer_settings(inner)
        if finite:
            self._nonfinite_run = 0
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
            with rates_scaled(inner, st.rate_factor()):
                if scaler is None:
                    inner.step()
                else:
                    scaler.step(inner)
            if scaler is not None:
                scaler.update()
                if float(scaler.get_scale()) < scale:
                    self.previous_gradient.forget()  # an overflow: nothing to compare with
        else:
            self._nonfinite_run += 1
            self.previous_gradient.forget()
            if self.world.rank == 0:
                log.warning("step %d: the loss or gradient is not finite (loss %s); the update "
                            "is skipped (%d in a row)", st.step, self.last_loss,
                            self._nonfinite_run)
        st.sampler.advance(self._part.global_count)
        st.step += 1
        st.count_gain(self._part.global_count, self.engine.lr_rule.rule == "adascale")
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
