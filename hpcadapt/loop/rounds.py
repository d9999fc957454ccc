"""Bounded-delay rounds (``--strategy bounded-delay``): rank 0 aggregates, the other ranks
train on the batches it hands them; a round commits as ``ceil(samples / B)`` steps.

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

from hpcadapt.comm import world as world_mod
from hpcadapt.comm.collectives import ReduceOp
from hpcadapt.data.loader import split_micro
from hpcadapt.state.training import optimizer_settings, rates_scaled

from hpcadapt.base.metrics import BoundedDelayRecord
__all__ = ["BoundedDelayRounds"]

log = logging.getLogger("hpcadapt.job")


class BoundedDelayRounds:
    """Bounded-delay rounds (``--strategy bounded-delay``): rank 0 aggregates, the other
    ranks train on the batches it hands them; a round commits as ``ceil(samples / B)``
    steps."""

    def _async_round(self) -> Iterator[Any]:
        """One round of bounded-delay aggregation: rank 0 aggregates, the other ranks yield
        the batches it hands them. Every rank starts from rank 0's model and ends with it;
        the round's control values (loss, per-rank times, stop votes) then travel in one
        small allreduce, and the round counts as ``ceil(samples / B)`` steps. Returns the
        round's samples; a peer's failure in the round goes to the loop's recovery scope
        (the round is trained again from the agreed state)."""
        from hpcadapt.parallel.bounded import Aggregator, AsyncWorker, FlatModel
        from hpcadapt.comm.collectives import MPICommunicator
        from hpcadapt.parallel.broadcasts import broadcast_parameters

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
        except world_mod.FAILURES:
            self._step_open = False
            raise  # the loop's recovery scope: the round is trained again from the commit
        step0 = st.step
        with rates_scaled(self.optimizer.optimizer, st.rate_factor()):
            self._used_settings = optimizer_settings(self.optimizer.optimizer)
        st.sampler.advance(count)
        st.step += steps
        for _ in range(steps):   # a round's steps hold equal shares of its samples
            st.count_gain(count / steps, self.engine.lr_rule.rule == "adascale")
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
        with rates_scaled(inner, rate / self.state.origin["lr"] * samples / batch):
            inner.step()

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
        self.recorder.write(BoundedDelayRecord(step=st.step, epoch=st.epoch, first_step=step0,
                                           steps=steps, max_delay=st.strategy.max_delay,
                                           world_size=self.world.size, **report.to_dict()))
        if self._sample_file is not None:
            for slot, worker, indices in report.applied:
                self._sample_file.write(json.dumps({
                    "epoch": st.epoch, "step": step0 + slot, "rank": worker,
                    "size": self.world.size, "version": self.world.cluster_version,
                    "indices": indices.tolist()}) + "\n")
