"""Bounded-delay rounds (``--strategy bounded-delay``): rank 0 aggregates, the other ranks
train on the batches it hands them; a round commits as ``ceil(samples / B)`` steps.

``BoundedDelayRounds`` owns the rounds' totals; the step in flight, its control values and
its commit are the step runner's (``loop/steps.py``), which it drives through its methods."""

from __future__ import annotations

import logging

import os
import time
from typing import Any, Callable, Dict, Iterator, Optional

import numpy as np
import torch

from hpcadapt.base import faults
from hpcadapt.comm import world as world_mod
from hpcadapt.comm.collectives import ReduceOp
from hpcadapt.data.loader import split_micro
from hpcadapt.base.metrics import BoundedDelayRecord
from hpcadapt.state.training import settings_applied
from hpcadapt.loop.parts import JobParts
from hpcadapt.loop.recording import Recorder

__all__ = ["BoundedDelayRounds"]

log = logging.getLogger("hpcadapt.job")


class BoundedDelayRounds:
    """Bounded-delay rounds (``--strategy bounded-delay``): rank 0 aggregates, the other
    ranks train on the batches it hands them; a round commits as ``ceil(samples / B)``
    steps."""

    def __init__(self, parts: JobParts, steps, recorder: Recorder, *,
                 restart_pending: Callable[[], bool]):
        self.parts = parts
        self.restart_pending = restart_pending  # a recovery in job.step asked for a restart
        self.recorder = recorder
        self.steps = steps
        self.totals: Dict[str, Any] = {}  # rank 0: the rounds so far, for the summary

    def round(self) -> Iterator[Any]:
        """One round of bounded-delay aggregation: rank 0 aggregates, the other ranks yield
        the batches it hands them. Every rank starts from rank 0's model and ends with it;
        the round's control values (loss, per-rank times, stop votes) then travel in one
        small allreduce, and the round counts as ``ceil(samples / B)`` steps. Returns the
        round's samples; a peer's failure in the round goes to the loop's recovery scope
        (the round is trained again from the agreed state)."""
        from hpcadapt.parallel.bounded import Aggregator, AsyncWorker, FlatModel
        from hpcadapt.comm.collectives import MPICommunicator
        from hpcadapt.parallel.broadcasts import broadcast_parameters

        parts, steps = self.parts, self.steps
        st, o, world = parts.state, parts.options, parts.world
        strategy, batch = st.strategy, st.hyper.batch_size
        steps.begin_round()
        count = min(strategy.round_steps * batch, st.sampler.remaining)
        if o.steps.max_steps is not None:  # the round ends where --max-steps does
            count = min(count, max(1, o.steps.max_steps - st.step) * batch)
        n_steps = -(-count // batch)
        flat = FlatModel(parts.model)
        tensors = list(parts.model.parameters()) + list(parts.model.buffers())
        report = None
        try:
            broadcast_parameters(tensors, root=0, world=world)  # version 0 everywhere
            if world.rank == 0:
                indices = st.sampler.slice_at(st.sampler.cursor, count, 0, 1).indices
                step0 = st.step
                report = Aggregator(
                    world, flat, indices, global_batch=batch,
                    max_delay=strategy.max_delay,
                    apply=lambda n, slot: self._apply_update(n, batch, step0 + slot)).run()
            else:
                worker = AsyncWorker(world, flat)
                while True:
                    work = worker.next_batch()
                    if work is None:
                        break
                    yield from self._worker_batch(worker, work)
                    if self.restart_pending():
                        # job.step recovered from a failure of this worker's send: the
                        # loop's scope trains the round again from the agreed state
                        return 0
            control = self._round_control(report)
            MPICommunicator(world).allreduce(control, ReduceOp.SUM)
            broadcast_parameters(tensors, root=0, world=world)  # rank 0's model for all
        except world_mod.FAILURES:
            steps.close_step()
            raise  # the loop's recovery scope: the round is trained again from the commit
        step0 = st.step
        steps.commit_round(count, n_steps, control)
        if report is not None:
            self._record_round(report, step0, n_steps)
        return count

    def _worker_batch(self, worker, work) -> Iterator[Any]:
        """A worker's batch of a round: the (micro-)batches to yield; ``step(loss)`` after
        the last sends the gradient to the aggregator."""
        parts = self.parts
        micro = split_micro(work.indices, parts.options.steps.max_local_batch)
        for p in parts.model.parameters():
            p.grad = None
        t0 = time.perf_counter()

        def send(clip_grad_norm: Optional[float], loss_sum: float) -> None:
            faults.point("gradient", parts.state.step)  # before the update leaves
            if clip_grad_norm is not None:  # each update's gradient, as each step's
                torch.nn.utils.clip_grad_norm_(parts.model.parameters(), clip_grad_norm)
            compute = time.perf_counter() - t0
            self.steps.note_compute(compute)
            worker.send_update(work.batch_id, len(work.indices), loss_sum, compute)

        # --slow-compute: the rank's straggling, as in synchronous steps
        self.steps.open_step(send)
        yield from self.steps.yield_micro(micro, len(work.indices), parts.loader.load)

    def _apply_update(self, samples: int, batch: int, step: int) -> None:
        """The aggregator's application of ``samples`` samples' aggregated gradient (set
        in ``.grad``) as part of global batch ``step``: the job's optimizer at that step's
        rate (a ramp moves it within a round) scaled by samples / batch."""
        parts = self.parts
        inner = parts.optimizer.optimizer
        h = parts.state.hyper
        rate = h.lr_at(step) if h.ramp is not None else h.lr
        with settings_applied(inner, rate / parts.state.origin["lr"] * samples / batch,
                              h.momentum):
            inner.step()

    def _round_control(self, report) -> np.ndarray:
        """The control slots of a round: rank 0 fills the loss and each worker's mean time
        per update (its own compute slot stays 0: it trained nothing), every rank its stop
        signal, rank 0 the stop file."""
        layout = self.steps.control_layout()
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
            stop_file = self.parts.options.stops.stop_file
            values[layout.STOP_FILE] = 1.0 if stop_file and os.path.exists(stop_file) else 0.0
            values[layout.NONFINITE_UPDATES] = report.nonfinite_updates
        values[layout.STOP_SIGNAL] = 1.0 if self.steps.stop_signal_received() else 0.0
        return values

    def _record_round(self, report, step0: int, steps: int) -> None:
        """Rank 0: the round's line in the metrics (updates applied and dropped, delays),
        the job's totals, and the samples each applied update trained on."""
        parts = self.parts
        st, world = parts.state, parts.world
        if report.nonfinite_updates:
            log.warning("steps %d-%d: %d update(s) with a non-finite loss or gradient skipped "
                        "(their samples count as used)", step0, st.step - 1,
                        report.nonfinite_updates)
        totals = self.totals
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
                                               world_size=world.size, **report.to_dict()))
        if self.recorder.logs_samples:
            for slot, worker, indices in report.applied:
                self.recorder.log_samples(epoch=st.epoch, step=step0 + slot, rank=worker,
                                          size=world.size, version=world.cluster_version,
                                          indices=indices)
