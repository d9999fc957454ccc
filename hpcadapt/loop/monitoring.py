"""What the job measures and records: the gradient noise scale, per-rank timings, the snapshot
the policies decide on, the step, epoch and eval lines of the metrics file.

``Monitoring`` is the Job's collaborator for it: it owns the monitors' configuration and one
replica's previous gradient (the noise scale at world size 1); it reads the job's parts
(``loop.parts``: options, world, state, model, optimizer), is given the recorder and the
policy engine, and assigns none of the Job's attributes."""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import asdict
from typing import Any, Dict, Optional

import numpy as np
import torch

from hpcadapt.base.metrics import StepRecord
from hpcadapt.comm.collectives import ReduceOp, communicator
from hpcadapt.adapt.control import StepReport, StepTimes
from hpcadapt.adapt.monitors import MonitorConfig, SplitStep, estimate_from_replicas
from hpcadapt.loop.parts import JobParts
from hpcadapt.loop.progress_line import ProgressLine
from hpcadapt.parallel.optimizer import GradientStats
from hpcadapt.loop.recording import Recorder
from hpcadapt.adapt.engine import PolicyEngine
from hpcadapt.state.training import TrainingState, momentum_of

__all__ = ["Monitoring"]

log = logging.getLogger("hpcadapt.job")


class Monitoring:
    """What the job measures and records: the gradient noise scale, per-rank timings,
    the snapshot the policies decide on, the step, epoch and eval lines."""

    def __init__(self, parts: JobParts, recorder: Recorder, engine: PolicyEngine):
        self.parts = parts
        self.recorder = recorder
        self.engine = engine   # what the policies need measured
        self.split = SplitStep()  # one replica's noise-scale estimate, from inside the step
        self.config: Optional[MonitorConfig] = None   # set by configure (job.setup)
        o = parts.options.recording
        self.progress = ProgressLine(o.progress, o.progress_every)  # rank 0 updates it

    def configure(self) -> None:
        """The monitors the flags and the policies ask for, measured every ``interval``
        steps (the gcd of what each needs)."""
        import functools

        parts = self.parts
        o, engine = parts.options.monitoring, self.engine
        monitors = list(dict.fromkeys(list(o.monitors) + engine.required_monitors))
        intervals = [o.monitor_interval] if o.monitors else []
        intervals += [max(1, int(p.interval)) for p in engine.policies if p.requires]
        if engine.lr_rule.rule == "adascale":
            intervals.append(o.monitor_interval)
        interval = functools.reduce(math.gcd, intervals) if intervals else o.monitor_interval
        # --monitor-window 0 (the default): the longest memory a policy asks for, else the
        # one --monitor-ema gives at the first batch
        window = o.monitor_window or max([int(getattr(p, "monitor_window", 0))
                                          for p in engine.policies] + [0])
        self.config = MonitorConfig(tuple(monitors), interval, o.monitor_ema, window)

    def replicas_identical(self) -> bool:
        """Whether every rank holds bit-identical parameters and buffers (one small
        allreduce)."""
        parts = self.parts
        digest = int.from_bytes(bytes.fromhex(self.model_digest())[:7], "little")
        pair = np.array([digest, -digest], dtype=np.int64)
        communicator(parts.world).allreduce(pair, ReduceOp.MAX)
        return bool(pair[0] == -pair[1])

    def check_replicas_if_asked(self) -> Optional[bool]:
        """``replicas_identical()`` under ``--check-replicas``, else None (not checked)."""
        return self.replicas_identical() if self.parts.options.monitoring.check_replicas else None

    def model_digest(self) -> str:
        """A hash of this rank's parameters and buffers (BatchNorm's running statistics;
        hex): equal digests, identical replicas."""
        parts = self.parts
        h = hashlib.blake2b(digest_size=16)
        for t in list(parts.model.parameters()) + list(parts.model.buffers()):
            # bytes, whatever the dtype (bfloat16 has no numpy twin)
            raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            h.update(raw.numpy().tobytes())
        return h.hexdigest()

    def split_is_on(self) -> bool:
        """Whether one replica trains each step as two passes for the noise scale."""
        return self.parts.world.size == 1 and self.config is not None and self.config.enabled

    def pass_done(self, share: float) -> None:
        """A monitored step's pass (not the last) at world size 1 is done."""
        self.split.add(self._gradients(), share)

    def split_stats(self, stats: GradientStats, share: float) -> GradientStats:
        """At world size 1, the monitored step's statistics from its passes."""
        weighted, global_sq, _ = self.split.finish(self._gradients(), share)
        return GradientStats(weighted, global_sq, stats.extras)

    def _gradients(self):
        return [p.grad if p.grad is not None else torch.zeros_like(p)
                for p in self.parts.model.parameters() if p.requires_grad]

    def update(self, stats, global_count: int, times: Optional[StepTimes]) -> None:
        """The step's gradient statistics into the noise-scale monitor (``times``: the
        step's per-rank samples)."""
        parts = self.parts
        if parts.world.size >= 2:
            # Ranks whose share was empty (a short last batch) carry no gradient sample.
            replicas = int(np.count_nonzero(times.samples)) if times is not None \
                else parts.world.size
        else:
            replicas = self.split.parts   # the step's passes (1: too few samples to split)
        if replicas < 2:
            return
        est = estimate_from_replicas(stats.local_sqnorm_mean, stats.global_sqnorm,
                                     replicas, global_count)
        if not parts.state.gns.update(est, global_count):
            log.warning("step %d: non-finite gradient statistics skipped (|G|^2=%s, trS=%s)",
                        parts.state.step, est.grad_sq, est.trace_sigma)

    def _step_monitors(self, report: StepReport) -> Dict[str, Any]:
        parts = self.parts
        gns = parts.state.gns
        out: Dict[str, Any] = {}
        if report.monitored and gns.last is not None:
            lo, hi = gns.interval()
            out.update(noise_scale=gns.noise_scale, grad_sq=gns.grad_sq,
                       trace_sigma=gns.trace_sigma, noise_scale_lo=lo, noise_scale_hi=hi,
                       grad_variance=gns.trace_sigma / parts.state.hyper.batch_size,
                       grad_snr=gns.snr(parts.state.hyper.batch_size))
        times = report.times
        if times is not None:
            out.update(rank_step_time=times.step_time.round(6).tolist(),
                       rank_compute_time=times.compute_time.round(6).tolist(),
                       rank_wait_time=times.wait_time.round(6).tolist())
        return out

    def _node_count(self) -> int:
        """Nodes the world spans: emulated ones (--ranks-per-node) or real ones."""
        from hpcadapt.comm.topology import emulated_layout, layout_from_keys

        parts = self.parts
        k = parts.options.comm.ranks_per_node
        layout = emulated_layout(parts.world.size, k) if k is not None else \
            layout_from_keys([key for _, key, _ in parts.world.peers])
        return len(layout.nodes)

    def snapshot(self, report: StepReport, *, max_workers: int, can_resize: bool,
                 resizing: bool):
        """What rank 0 knows at this step boundary, for the policies: the last step's
        ``report``; the most workers the job can grow to, whether it can resize and whether
        a grow is under way (the membership's)."""
        from hpcadapt.policies.base import MetricsSnapshot

        parts = self.parts
        st, t, h = parts.state, report.times, parts.state.hyper
        momentum = st.applied_momentum(momentum_of(parts.optimizer.optimizer.param_groups[0]))
        lo, hi = st.gns.interval()
        return MetricsSnapshot(
            step=st.step, epoch=st.epoch, world_size=parts.world.size,
            batch_size=h.batch_size, lr=h.lr, momentum=momentum,
            base_lr=h.base_lr, base_batch_size=h.base_batch_size, loss=report.loss,
            samples_per_s=(report.count / report.step_time) if report.step_time
            else float("nan"),
            epoch_progress=st.sampler.cursor / st.sampler.num_samples,
            test_accuracy=st.last_accuracy, monitored=report.monitored,
            noise_scale=st.gns.noise_scale, grad_sq=st.gns.grad_sq,
            trace_sigma=st.gns.trace_sigma,
            grad_variance=st.gns.trace_sigma / h.batch_size,
            grad_snr=st.gns.snr(h.batch_size), noise_scale_lo=lo, noise_scale_hi=hi,
            samples_seen=st.samples_seen,
            schedule_lr=float(parts.optimizer.optimizer.param_groups[0]["lr"]),
            step_time=tuple(t.step_time.tolist()) if t else (),
            compute_time=tuple(t.compute_time.tolist()) if t else (),
            wait_time=tuple(t.wait_time.tolist()) if t else (),
            rank_samples=tuple(t.samples.tolist()) if t else (),
            max_workers=max_workers,
            min_workers=parts.options.membership.min_workers, can_resize=can_resize,
            max_local_batch=parts.options.steps.max_local_batch,
            cluster_version=parts.world.cluster_version,
            resizing=resizing,
            strategy=st.strategy.name, topology=st.topology, nodes=self._node_count())

    def log_step(self, count: int, report: StepReport) -> None:
        """The committed step's line of the metrics file (and the progress line)."""
        parts = self.parts
        st = parts.state
        used = report.used_settings
        self.recorder.write(StepRecord(
            step=st.step, epoch=st.epoch, world_size=parts.world.size,
            batch_size=st.hyper.batch_size, lr=used["lr"], momentum=used["momentum"],
            loss=report.loss,
            samples_per_s=count / report.step_time if report.step_time else 0.0,
            step_time_s=report.step_time, cluster_version=parts.world.cluster_version,
            monitors=self._step_monitors(report), betas=used["betas"], lr_groups=used["lr_groups"]))
        if parts.world.rank == 0:
            self.progress.update(seen=st.samples_seen, epoch=st.epoch, step=st.step,
                                 loss=report.loss, batch=st.hyper.batch_size,
                                 workers=parts.world.size)

    def expect_epochs(self, count: int) -> None:
        """``job.epochs(count)``: the run's length, for the progress line's total."""
        self.progress.expect(count * self.parts.state.sampler.num_samples)

    def end_progress(self) -> None:
        self.progress.close()

    def log_epoch(self, st: TrainingState, rate: float, *,
                  test_accuracy: Optional[float] = None, **extra: Any) -> None:
        """``job.log_epoch`` (its docstring says what is recorded and what is refused)."""
        from hpcadapt.base.metrics import user_metrics

        parts = self.parts
        mine = user_metrics(extra)
        if test_accuracy is not None:
            st.record_accuracy(test_accuracy)
        rec = self.recorder.write_epoch(
            step=st.step, epoch=st.epoch, world_size=parts.world.size,
            batch_size=st.hyper.batch_size, lr=rate,
            test_accuracy=st.last_accuracy if test_accuracy is not None else None,
            cluster_version=parts.world.cluster_version, user=mine)
        if parts.world.rank == 0:
            # Only what was measured or logged: no "test accuracy nan" for a script that
            # reports its own metrics instead.
            accuracy = f", test accuracy {rec.test_accuracy:.4f}" \
                if test_accuracy is not None else ""
            log.info("epoch %d: loss %.4f%s, %.0f samples/s, batch %d on %d %s%s", st.epoch,
                     rec.loss, accuracy, rec.samples_per_s, st.hyper.batch_size,
                     parts.world.size, "worker" if parts.world.size == 1 else "workers",
                     "".join(f", {k} {v:.4g}" for k, v in mine.items()))

    def log_eval(self, st: TrainingState, rate: float, **metrics: Any) -> None:
        """``job.log_eval`` (its docstring says what is recorded and what is refused)."""
        from hpcadapt.base.metrics import EvalRecord, RESERVED_EVAL_KEYS, user_metrics

        parts = self.parts
        mine = user_metrics(metrics, caller="log_eval", record="eval",
                            reserved=RESERVED_EVAL_KEYS)
        rec = EvalRecord(step=st.step, epoch=st.epoch, samples=int(st.samples_seen),
                         epoch_progress=float(st.epoch_progress),
                         batch_size=st.hyper.batch_size, lr=rate,
                         world_size=parts.world.size, cluster_version=parts.world.cluster_version)
        self.recorder.write({**asdict(rec), **mine})
