"""What the job measures and records: the gradient noise scale, per-rank timings, the snapshot
the policies decide on, the step and epoch lines of the metrics file.

A part of ``hpcadapt.job.Job`` (a mixin): its methods work on the job's state, which
``Job.__init__`` and ``Job.setup`` create; this module holds one concern of it."""

from __future__ import annotations

import logging

import hashlib
import math
import sys
from dataclasses import asdict
from typing import Any, Dict, Optional

import numpy as np
import torch

from hpcadapt.base.metrics import StepRecord
from hpcadapt.comm.collectives import ReduceOp, communicator
from hpcadapt.adapt.monitors import estimate_from_replicas

__all__ = ["Monitoring"]

log = logging.getLogger("hpcadapt.job")


class Monitoring:
    """What the job measures and records: the gradient noise scale, per-rank timings,
    the snapshot the policies decide on, the step and epoch lines of the metrics file."""

    def _monitor_interval(self) -> int:
        import functools

        o = self.options
        intervals = [o.monitor_interval] if o.monitors else []
        intervals += [max(1, int(p.interval)) for p in self.engine.policies if p.requires]
        if self.engine.lr_rule.rule == "adascale":
            intervals.append(o.monitor_interval)
        return functools.reduce(math.gcd, intervals) if intervals else o.monitor_interval

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

    def _update_monitors(self, stats, global_count: int) -> None:
        if self.world.size >= 2:
            # Ranks whose share was empty (a short last batch) carry no gradient sample.
            replicas = int(np.count_nonzero(self.steps.last_times.samples)) \
                if self.steps.last_times \
                is not None else self.world.size
            if replicas < 2:
                return
            est = estimate_from_replicas(stats.local_sqnorm_mean, stats.global_sqnorm,
                                         replicas, global_count)
        else:
            est = self.previous_gradient.estimate(self.optimizer.flat_gradients(), global_count)
            if est is None:
                return  # the step before was not kept (a resize, a skipped step)
        if not self.state.gns.update(est, global_count):
            log.warning("step %d: non-finite gradient statistics skipped (|G|^2=%s, trS=%s)",
                        self.state.step, est.grad_sq, est.trace_sigma)

    def _keep_previous_gradients(self, global_count: int) -> None:
        """At world size 1 the next monitored step needs this step's gradient."""
        st = self.state
        if self.world.size == 1 and self.monitor_cfg.enabled and \
                (st.step + 2) % self.monitor_cfg.interval == 0:
            self.previous_gradient.keep(self.optimizer.flat_gradients(), global_count)
        elif self.world.size > 1:
            self.previous_gradient.forget()

    def _step_monitors(self) -> Dict[str, Any]:
        gns = self.state.gns
        out: Dict[str, Any] = {}
        if self.steps.monitored and gns.last is not None:
            lo, hi = gns.interval()
            out.update(noise_scale=gns.noise_scale, grad_sq=gns.grad_sq,
                       trace_sigma=gns.trace_sigma, noise_scale_lo=lo, noise_scale_hi=hi,
                       grad_variance=gns.trace_sigma / self.state.hyper.batch_size,
                       grad_snr=gns.snr(self.state.hyper.batch_size))
        times = self.steps.last_times
        if times is not None:
            out.update(rank_step_time=times.step_time.round(6).tolist(),
                       rank_compute_time=times.compute_time.round(6).tolist(),
                       rank_wait_time=times.wait_time.round(6).tolist())
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

        steps = self.steps
        st, t, h = self.state, steps.last_times, self.state.hyper
        lo, hi = st.gns.interval()
        return MetricsSnapshot(
            step=st.step, epoch=st.epoch, world_size=self.world.size,
            batch_size=h.batch_size, lr=h.lr, momentum=h.momentum,
            base_lr=h.base_lr, base_batch_size=h.base_batch_size, loss=steps.last_loss,
            samples_per_s=(steps.last_count / steps.step_time) if steps.step_time
            else float("nan"),
            epoch_progress=st.sampler.cursor / st.sampler.num_samples,
            test_accuracy=st.last_accuracy, monitored=steps.monitored,
            noise_scale=st.gns.noise_scale, grad_sq=st.gns.grad_sq,
            trace_sigma=st.gns.trace_sigma,
            grad_variance=st.gns.trace_sigma / h.batch_size,
            grad_snr=st.gns.snr(h.batch_size), noise_scale_lo=lo, noise_scale_hi=hi,
            samples_seen=self.samples_seen,
            step_time=tuple(t.step_time.tolist()) if t else (),
            compute_time=tuple(t.compute_time.tolist()) if t else (),
            wait_time=tuple(t.wait_time.tolist()) if t else (),
            rank_samples=tuple(t.samples.tolist()) if t else (),
            max_workers=steps.slot_ranks() if self.elastic is not None else self.world.size,
            min_workers=self.options.min_workers, can_resize=self.elastic is not None,
            max_local_batch=self.options.max_local_batch,
            cluster_version=self.world.cluster_version,
            resizing=bool(self.elastic is not None and self.elastic.growing),
            strategy=st.strategy.name, topology=st.topology, nodes=self._node_count())

    def _log_step(self, count: int) -> None:
        st = self.state
        steps = self.steps
        used = steps.used_settings
        self.recorder.write(StepRecord(step=st.step, epoch=st.epoch, world_size=self.world.size,
                                   batch_size=st.hyper.batch_size, lr=used["lr"],
                                   momentum=used["momentum"], loss=steps.last_loss,
                                   samples_per_s=count / steps.step_time if steps.step_time else 0.0,
                                   step_time_s=steps.step_time,
                                   cluster_version=self.world.cluster_version,
                                   monitors=self._step_monitors(), betas=used["betas"],
                                   lr_groups=used["lr_groups"]))
        if self.options.progress and self.world.rank == 0 and st.step % 20 == 0:
            sys.stderr.write(f"\repoch {st.epoch} step {st.step} loss {steps.last_loss:.4f} "
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
        rec = self.recorder.write_epoch(
            step=st.step, epoch=st.epoch, world_size=self.world.size,
            batch_size=st.hyper.batch_size, lr=self._last_lr(),
            test_accuracy=st.last_accuracy if test_accuracy is not None else None,
            cluster_version=self.world.cluster_version, user=mine)
        if self.world.rank == 0:
            # Only what was measured or logged: no "test accuracy nan" for a script that
            # reports its own metrics instead.
            accuracy = f", test accuracy {rec.test_accuracy:.4f}" \
                if test_accuracy is not None else ""
            log.info("epoch %d: loss %.4f%s, %.0f samples/s, batch %d on %d %s%s", st.epoch,
                     rec.loss, accuracy, rec.samples_per_s, st.hyper.batch_size,
                     self.world.size, "worker" if self.world.size == 1 else "workers",
                     "".join(f", {k} {v:.4g}" for k, v in mine.items()))

    def log_eval(self, **metrics: Any) -> None:
        """Record an evaluation made during training (call on every rank, after a step;
        rank 0 writes): one ``"event": "eval"`` line of the metrics file with the committed
        ``step``, ``samples`` (``job.samples_seen``), ``epoch_progress``, the global
        ``batch_size``, the ``lr`` of the last step, and ``metrics`` as floats
        (``job.log_eval(val_loss=1.9, val_accuracy=0.42)``). Nothing is printed (it may run
        often); the summary is not changed. Raises ConfigurationError for a value that is
        not a number or a name that is a built-in field of the eval line."""
        from hpcadapt.base.metrics import EvalRecord, RESERVED_EVAL_KEYS, user_metrics

        st = self._require_setup()
        mine = user_metrics(metrics, caller="log_eval", record="eval",
                            reserved=RESERVED_EVAL_KEYS)
        rec = EvalRecord(step=st.step, epoch=st.epoch, samples=int(self.samples_seen),
                         epoch_progress=float(self.epoch_progress),
                         batch_size=st.hyper.batch_size, lr=self._last_lr(),
                         world_size=self.world.size, cluster_version=self.world.cluster_version)
        self.recorder.write({**asdict(rec), **mine})
