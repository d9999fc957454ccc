"""The training loop behind ``python -m hpcadapt.train``: data-parallel steps over the
world, in-step monitoring, metrics on rank 0, and step boundaries where the policy engine's
decisions are applied on every rank."""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import numpy as np
import torch
from torch import nn

from .collectives import ReduceOp, communicator
from .datasets import Dataset, load_dataset
from .errors import ConfigurationError
from .metrics import EpochRecord, MetricsSink, ResizeRecord, StepRecord
from .models import build_model
from .monitor import (GradientNoiseScale, MonitorConfig, estimate_from_consecutive,
                      estimate_from_replicas)
from .parallel import DistributedOptimizer
from .runtime import World
from .sampler import ElasticSampler

if TYPE_CHECKING:  # pragma: no cover
    from .elastic import ElasticController, ResizeOutcome
    from .preemption import StopSignals
    from .engine import PolicyEngine
    from hpcadapt.policies.base import MetricsSnapshot

__all__ = ["TrainConfig", "Trainer", "StepTimes"]

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    model: str = "mlp"
    dataset: str = "digits"
    epochs: int = 5
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    max_steps: Optional[int] = None
    metrics_file: Optional[str] = None
    progress: bool = True
    bucket_bytes: Optional[int] = None
    hidden: List[int] = field(default_factory=lambda: [256, 256])
    width: int = 32
    synthetic_samples: int = 4096
    threads: int = 0
    monitors: List[str] = field(default_factory=list)
    monitor_interval: int = 1
    monitor_ema: float = 0.1
    sample_log: Optional[str] = None
    check_replicas: bool = False

    def validate(self) -> None:
        for name in ("epochs", "batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"--{name.replace('_', '-')} must be positive, "
                                         f"got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigurationError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigurationError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise ConfigurationError(f"--max-steps must be positive, got {self.max_steps}")


@dataclass(frozen=True)
class StepTimes:
    """Per-rank timings of the previous step, gathered through the gradient buckets' slots."""

    step_time: np.ndarray      # seconds, one entry per rank
    compute_time: np.ndarray   # forward + backward (with communication launched inside)
    wait_time: np.ndarray      # waiting for the gradient allreduce to finish
    samples: np.ndarray        # samples each rank trained on in this step


def monitor_interval(cfg: TrainConfig, engine: Optional["PolicyEngine"]) -> int:
    """Monitor on every step any consumer needs it: the gcd of the requested intervals."""
    intervals = [cfg.monitor_interval] if cfg.monitors else []
    if engine is not None:
        intervals += [max(1, int(p.interval)) for p in engine.policies if p.requires]
        if engine.lr_rule.rule == "adascale":
            intervals.append(cfg.monitor_interval)
    return functools.reduce(math.gcd, intervals) if intervals else cfg.monitor_interval


class _CommView:
    """The little of a World that the broadcast helpers use, for a sub-communicator."""

    def __init__(self, comm):
        self.comm = comm
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()


class Trainer:
    """Owns model, optimizer, sampler and hyper-parameters; ``run()`` trains to the end.

    Hyper-parameters (``batch_size``, ``lr``, ``momentum``) are plain attributes that
    decisions change between steps; ``step`` and ``epoch`` say where training stands."""

    def __init__(self, cfg: TrainConfig, world: World, *, dataset: Optional[Dataset] = None,
                 engine: Optional["PolicyEngine"] = None):
        cfg.validate()
        self.cfg = cfg
        self.world = world
        self.elastic: Optional["ElasticController"] = None
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        self.data = dataset if dataset is not None else load_dataset(
            cfg.dataset, seed=cfg.seed, num_samples=cfg.synthetic_samples)
        self.model: nn.Module = build_model(cfg.model, self.data.input_shape,
                                            self.data.num_classes, seed=cfg.seed,
                                            hidden=cfg.hidden, width=cfg.width)
        base = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                               weight_decay=cfg.weight_decay)
        self.optimizer = DistributedOptimizer(base, self.model.named_parameters(), world=world,
                                              bucket_bytes=cfg.bucket_bytes,
                                              extra_slots=self._extra_slots())
        self.sampler = ElasticSampler(len(self.data.x_train), seed=cfg.seed)
        self.loss_fn = nn.CrossEntropyLoss()
        self.batch_size = cfg.batch_size
        self.lr = cfg.lr
        self.momentum = cfg.momentum
        self.base_lr = cfg.lr
        self.base_batch_size = cfg.batch_size
        self.ramp = None
        self.step = 0
        self.epoch = 0
        self.sink = MetricsSink(cfg.metrics_file, enabled=world.rank == 0)
        self.last_loss = float("nan")
        self.last_accuracy = float("nan")
        self.last_times: Optional[StepTimes] = None
        self.history: List[Dict[str, Any]] = []
        self.engine = engine
        self.left = False
        self.resizes: List[Dict[str, Any]] = []
        monitors = list(dict.fromkeys(list(cfg.monitors) +
                                      (engine.required_monitors if engine else [])))
        self.monitor_cfg = MonitorConfig(tuple(monitors), monitor_interval(cfg, engine),
                                         cfg.monitor_ema)
        self.gns = GradientNoiseScale(cfg.monitor_ema)
        self.monitored = False
        self._prev_grads: Optional[List[torch.Tensor]] = None
        self._prev_local = (0.0, 0.0, 0.0)  # this rank's (step, compute, wait) of last step
        self._step_time = 0.0
        self._bar = None
        # Preemption: signals noted by the handler, agreed on through the extras slot.
        self.stop_signals: Optional["StopSignals"] = None
        self.checkpoint_path: Optional[str] = None
        self.stop_requested = False
        self.stopped: Optional[str] = None
        self._resumed_at: Optional[int] = None  # step this run resumed at, from a checkpoint
        self._sample_file = None
        if cfg.sample_log:
            os.makedirs(cfg.sample_log, exist_ok=True)
            self._sample_file = open(os.path.join(cfg.sample_log, f"samples-{os.getpid()}.jsonl"),
                                     "a", encoding="utf-8")

    # -- metric slots ------------------------------------------------------------------
    def _slot_ranks(self) -> int:
        """Ranks the metric slots have room for: the most this job can grow to, so that
        a resize does not have to rebuild the gradient buckets."""
        return max(self.world.size, self.max_workers())

    def _extra_slots(self) -> int:
        # loss sum, per-rank step, compute and wait times and sample counts, then the
        # number of ranks that received a stop signal.
        return 2 + 4 * self._slot_ranks()

    def _stage_extras(self, loss_sum: float, n_local: int) -> None:
        size, rank = self._slot_ranks(), self.world.rank
        extras = np.zeros(self._extra_slots())
        extras[0] = loss_sum
        step_t, compute_t, wait_t = self._prev_local
        extras[1 + rank] = step_t
        extras[1 + size + rank] = compute_t
        extras[1 + 2 * size + rank] = wait_t
        extras[1 + 3 * size + rank] = n_local
        extras[-1] = 1.0 if self.stop_signals is not None and self.stop_signals.received else 0.0
        self.optimizer.stage_extras(extras)

    def _read_extras(self, extras: np.ndarray, global_count: int) -> None:
        cap, n = self._slot_ranks(), self.world.size
        self.last_loss = extras[0] / global_count if global_count else float("nan")
        self.last_times = StepTimes(*(extras[1 + k * cap:1 + k * cap + n].copy()
                                      for k in range(4)))
        self.stop_requested = bool(extras[-1] > 0.5)

    # -- hyper-parameters --------------------------------------------------------------
    def apply_hyperparameters(self) -> None:
        if self.ramp is not None:
            self.lr = self.ramp.lr_at(self.step)
            if self.ramp.done(self.step):
                self.ramp = None
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
            if "momentum" in group:
                group["momentum"] = self.momentum

    def apply_changes(self, changes: Dict[str, Any]) -> None:
        """Apply a broadcast decision (identical on every rank) before the next step."""
        from hpcadapt.policies.lr_rules import Ramp

        if "batch_size" in changes:
            self.batch_size = int(changes["batch_size"])
        if "momentum" in changes:
            self.momentum = float(changes["momentum"])
        if "lr" in changes:
            self.lr = float(changes["lr"])
        if "base" in changes:
            self.base_lr, self.base_batch_size = float(changes["base"][0]), int(changes["base"][1])
        if "ramp" in changes:
            r = changes["ramp"]
            self.ramp = Ramp(int(r[0]), int(r[1]), float(r[2]), float(r[3])) if r else None
            if self.ramp is not None and self.ramp.steps == 0:
                self.lr, self.ramp = self.ramp.end_lr, None
        if "world_size" in changes and int(changes["world_size"]) != self.world.size:
            exclude = changes.get("remove_rank")
            self.request_resize(int(changes["world_size"]), changes.get("reason", "policy"),
                                remove=[int(exclude)] if exclude is not None else None)

    # -- elastic membership ---------------------------------------------------------------
    def request_resize(self, new_size: int, reason: str = "user request", *,
                       remove: Optional[List[int]] = None) -> None:
        """Change the number of workers. Call on every rank at the same step boundary (a
        policy decision does). A shrink happens now; a grow starts now and completes at a
        later step boundary, when the new workers are ready. Requests that cannot be met
        are clipped or refused with a logged reason; training goes on either way."""
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
        from .elastic import ResizeOutcome, split_leavers

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
        """At a step boundary: complete or abandon a pending grow."""
        from .elastic import ABANDON, JOIN, ResizeOutcome

        if self.elastic is None or not self.elastic.growing:
            return
        status, joiners, detail = self.elastic.poll_grow()
        if status == ABANDON:
            self._record_resize(self.elastic.abandon(detail))
        elif status == JOIN:
            t0 = time.perf_counter()
            decided = self.elastic.decided_at()
            reason = self.elastic.pending.reason if self.elastic.pending else ""
            old = self.world.size
            new = self.elastic.join(joiners)
            self.world.replace(new)
            self.sync_state(receiving=False)
            self._after_resize(ResizeOutcome(old, self.world.size, reason, 0.0, True), t0,
                               decided)

    def after_join(self) -> None:
        """In a joining worker, right after ``join_running_job``: the same collective steps
        the running ranks take after accepting it."""
        from .elastic import ResizeOutcome

        self.sync_state()
        self._after_resize(ResizeOutcome(-1, self.world.size, "joined", 0.0, True))

    def sync_state(self, *, receiving: bool = True) -> None:
        """Broadcast the whole training state from rank 0 (parameters, optimizer, data
        cursor, hyper-parameters, monitor and RNG state) so every replica is identical.

        Every rank of the world calls it; those with ``receiving=False`` (ranks that already
        hold the state: the running job's, after a grow) split off and take no part in the
        broadcast, which then reaches only the joiners."""
        from mpi4py import MPI

        part = self.world.comm.Split(0 if (receiving or self.world.rank == 0) else MPI.UNDEFINED,
                                     self.world.rank)
        if part == MPI.COMM_NULL:
            return
        try:
            self._broadcast_state(_CommView(part))
        finally:
            part.Free()

    def _broadcast_state(self, view: "_CommView") -> None:
        from .parallel import broadcast_object_state, broadcast_optimizer_state, broadcast_parameters

        mine = self.training_state() if self.world.rank == 0 else None
        state = broadcast_object_state(mine, world=view)
        if self.world.rank != 0:
            self.load_training_state(state)
            if int(state["version"]) != self.world.cluster_version:
                self.world._version = int(state["version"])
        broadcast_parameters(list(self.model.parameters()), world=view)
        broadcast_optimizer_state(self.optimizer.optimizer, world=view)

    def training_state(self) -> Dict[str, Any]:
        """Where training stands, apart from model and optimizer: step, epoch,
        hyper-parameters, data cursor, monitor and RNG state (torch.save-able)."""
        return {"step": self.step, "epoch": self.epoch, "batch_size": self.batch_size,
                "lr": self.lr, "momentum": self.momentum, "base_lr": self.base_lr,
                "base_batch_size": self.base_batch_size,
                "ramp": list(self.ramp.__dict__.values()) if self.ramp else None,
                "sampler": self.sampler.state_dict(), "gns": self.gns.state_dict(),
                "rng": torch.get_rng_state(), "version": self.world.cluster_version,
                "accuracy": self.last_accuracy,
                # Policies decide on rank 0 only; their state matters for a checkpoint.
                "policies": self.engine.state_dict() if self.engine is not None else {}}

    def load_training_state(self, state: Dict[str, Any]) -> None:
        from hpcadapt.policies.lr_rules import Ramp

        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.batch_size, self.lr = int(state["batch_size"]), float(state["lr"])
        self.momentum = float(state["momentum"])
        self.base_lr, self.base_batch_size = float(state["base_lr"]), int(state["base_batch_size"])
        self.ramp = Ramp(*state["ramp"]) if state["ramp"] else None
        self.sampler.load_state_dict(state["sampler"])
        self.gns.load_state_dict(state["gns"])
        torch.set_rng_state(state["rng"])
        self.last_accuracy = float(state["accuracy"])
        if self.engine is not None and state.get("policies"):
            self.engine.load_state_dict(state["policies"])

    # -- checkpoints (preemption) -----------------------------------------------------------
    def save_checkpoint(self, path: str) -> None:
        """Rank 0: write the whole training state to ``path`` atomically (tmp + rename)."""
        blob = {"format": 1, "model_name": self.cfg.model, "dataset": self.cfg.dataset,
                "trainer": self.training_state(), "model": self.model.state_dict(),
                "optimizer": self.optimizer.optimizer.state_dict()}
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save(blob, tmp)
        os.replace(tmp, path)

    def resume_from_checkpoint(self, path: str) -> bool:
        """Every rank: when ``path`` exists (rank 0 decides), rank 0 reads it (tensors and
        plain data only: weights_only) and the state is broadcast so every replica starts
        identical. Returns whether training resumed."""
        error, found = "", False
        if self.world.rank == 0 and os.path.exists(path):
            found = True
            try:
                blob = torch.load(path, map_location="cpu", weights_only=True)
                if blob.get("model_name") != self.cfg.model or blob.get("dataset") != self.cfg.dataset:
                    raise ValueError(f"it holds a {blob.get('model_name')} on "
                                     f"{blob.get('dataset')}, this run trains a {self.cfg.model} "
                                     f"on {self.cfg.dataset}")
                self.model.load_state_dict(blob["model"])
                self.optimizer.optimizer.load_state_dict(blob["optimizer"])
                self.load_training_state(blob["trainer"])
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                error = f"cannot resume from {path}: {exc}; remove it or pass another --checkpoint"
        from .parallel import broadcast_object_state

        verdict = broadcast_object_state({"error": error, "found": found}
                                         if self.world.rank == 0 else None, world=self.world)
        if verdict["error"]:
            raise ConfigurationError(verdict["error"])
        if not verdict["found"]:
            return False
        self.sync_state()
        self._resumed_at = self.step
        if self.world.rank == 0:
            log.info("resumed from %s at epoch %d, step %d", path, self.epoch, self.step)
        return True

    def _stop_for_signal(self) -> None:
        """Every rank, at the step boundary where a stop signal became known: rank 0 saves
        the state; everyone stops training."""
        name = (self.stop_signals.received if self.stop_signals and self.stop_signals.received
                else "a stop signal on another rank")
        self.stopped = name
        saved = np.ones(1, dtype=np.int64)
        if self.world.rank == 0:
            saved[0] = self._save_for_stop(name)
        communicator(self.world).broadcast(saved, root=0)
        if not saved[0]:
            self.stopped = f"{name}; state NOT saved"

    def _save_for_stop(self, name: str) -> bool:
        """Rank 0: save the state for the requeued job; False when it could not."""
        resumed_at = self._resumed_at
        if resumed_at is not None and self.step - resumed_at < 20:
            log.warning("stopped again %d step(s) after resuming: the job gets its stop "
                        "signal right after it starts. Slurm sends --signal=SIG@T up to "
                        "60 s before T; make the time limit (--time) well longer than "
                        "T + 60 s", self.step - resumed_at)
        if not self.checkpoint_path:
            log.warning("stopped on %s at step %d; no --checkpoint given, state not saved",
                        name, self.step)
            return False
        try:
            self.save_checkpoint(self.checkpoint_path)
        except (OSError, RuntimeError) as exc:
            log.error("stopped on %s at step %d, but the state could not be saved to %s: %s; "
                      "the job must not be requeued from it (free space, or pass another "
                      "--checkpoint)", name, self.step, self.checkpoint_path, exc)
            return False
        log.warning("stopped on %s at epoch %d, step %d; state saved to %s",
                    name, self.epoch, self.step, self.checkpoint_path)
        return True

    def replicas_identical(self) -> bool:
        """Whether every rank holds bit-identical parameters (one small allreduce)."""
        import hashlib

        h = hashlib.blake2b(digest_size=7)
        for p in self.model.parameters():
            h.update(p.detach().contiguous().numpy())
        digest = int.from_bytes(h.digest(), "little")
        pair = np.array([digest, -digest], dtype=np.int64)
        communicator(self.world).allreduce(pair, ReduceOp.MAX)
        return bool(pair[0] == -pair[1])

    def _after_resize(self, outcome: "ResizeOutcome", paused_at: float = float("nan"),
                      decided_at: float = float("nan")) -> None:
        """Every rank of the new world: rebuild what depends on the size, record the resize
        (the pause runs from ``paused_at`` until the next step can start), tell policies."""
        from dataclasses import replace as _replace

        self.optimizer.set_extra_slots(self._extra_slots())
        self.optimizer._ensure_current()
        if self.cfg.check_replicas and outcome.ok:
            identical = self.replicas_identical()
            if not identical and self.world.rank == 0:
                log.error("replicas differ after the resize to %d workers", self.world.size)
            self._identical_after_resize = identical
        self._prev_local = (0.0, 0.0, 0.0)
        self._prev_grads = None
        self.last_times = None
        now = time.perf_counter()
        outcome = _replace(outcome, pause_s=now - paused_at if paused_at == paused_at else 0.0,
                           decision_to_first_step_s=now - decided_at)
        self._record_resize(outcome)
        if self.engine is not None and self.engine.active:
            self.engine.run("on_resize", self, old_size=outcome.old_size,
                            new_size=outcome.new_size)

    def _record_resize(self, outcome: "ResizeOutcome") -> None:
        row = {"old_size": outcome.old_size, "new_size": outcome.new_size, "ok": outcome.ok,
               "pause_s": outcome.pause_s, "reason": outcome.reason,
               "decision_to_first_step_s": outcome.decision_to_first_step_s, "step": self.step}
        self.resizes.append(row)
        if outcome.old_size < 0:
            return  # a joiner's view; rank 0 of the running job records the resize
        self.sink.write(ResizeRecord(step=self.step, epoch=self.epoch, old_size=outcome.old_size,
                                     new_size=outcome.new_size, reason=outcome.reason,
                                     pause_s=outcome.pause_s, ok=outcome.ok,
                                     cluster_version=self.world.cluster_version,
                                     world_size=self.world.size, batch_size=self.batch_size,
                                     lr=self.lr,
                                     decision_to_first_step_s=outcome.decision_to_first_step_s,
                                     replicas_identical=getattr(self, "_identical_after_resize",
                                                                None) if outcome.ok else None))
        if self.world.rank == 0:
            level = logging.INFO if outcome.ok else logging.WARNING
            log.log(level, "resize %d -> %d %s in %.3f s (%s)", outcome.old_size,
                    outcome.new_size, "done" if outcome.ok else "not done", outcome.pause_s,
                    outcome.reason)

    def max_workers(self) -> int:
        return self.elastic.allocator.capacity() if self.elastic is not None else self.world.size

    # -- monitoring --------------------------------------------------------------------
    def _monitoring_step(self, step: int) -> bool:
        return self.monitor_cfg.enabled and step % self.monitor_cfg.interval == 0

    def _update_monitors(self, stats, global_count: int) -> None:
        n = self.world.size
        if n >= 2:
            est = estimate_from_replicas(stats.local_sqnorm_mean, stats.global_sqnorm, n,
                                         global_count)
        else:
            grads = self.optimizer.flat_gradients()
            if self._prev_grads is None:
                self._prev_grads = [g.clone() for g in grads]
                return
            est = estimate_from_consecutive(grads, self._prev_grads, global_count)
        if not self.gns.update(est):
            log.warning("step %d: non-finite gradient statistics skipped (|G|^2=%s, trS=%s)",
                        self.step, est.grad_sq, est.trace_sigma)

    def _keep_previous_gradients(self) -> None:
        """At world size 1 the next monitored step needs this step's gradient."""
        if self.world.size == 1 and self._monitoring_step(self.step + 1):
            grads = self.optimizer.flat_gradients()
            if self._prev_grads is None or len(self._prev_grads) != len(grads):
                self._prev_grads = [g.clone() for g in grads]
            else:
                for dst, src in zip(self._prev_grads, grads):
                    dst.copy_(src)
        elif self.world.size > 1:
            self._prev_grads = None

    def step_monitors(self) -> Dict[str, Any]:
        """Monitor values for this step's metrics line."""
        out: Dict[str, Any] = {}
        if self.monitored and self.gns.last is not None:
            out.update(noise_scale=self.gns.noise_scale, grad_sq=self.gns.grad_sq,
                       trace_sigma=self.gns.trace_sigma, grad_variance=self.gns.last.variance,
                       grad_snr=self.gns.snr(self.batch_size))
        if self.last_times is not None:
            out.update(rank_step_time=self.last_times.step_time.round(6).tolist(),
                       rank_compute_time=self.last_times.compute_time.round(6).tolist(),
                       rank_wait_time=self.last_times.wait_time.round(6).tolist())
        return out

    def snapshot(self) -> "MetricsSnapshot":
        from hpcadapt.policies.base import MetricsSnapshot

        t = self.last_times
        last = self.gns.last
        return MetricsSnapshot(
            step=self.step, epoch=self.epoch, world_size=self.world.size,
            batch_size=self.batch_size, lr=self.lr, momentum=self.momentum,
            base_lr=self.base_lr, base_batch_size=self.base_batch_size, loss=self.last_loss,
            samples_per_s=(self._last_count / self._step_time) if self._step_time else float("nan"),
            epoch_progress=self.sampler.cursor / self.sampler.num_samples,
            test_accuracy=self.last_accuracy, monitored=self.monitored,
            noise_scale=self.gns.noise_scale, grad_sq=self.gns.grad_sq,
            trace_sigma=self.gns.trace_sigma,
            grad_variance=last.variance if last else float("nan"),
            grad_snr=self.gns.snr(self.batch_size),
            step_time=tuple(t.step_time.tolist()) if t else (),
            compute_time=tuple(t.compute_time.tolist()) if t else (),
            wait_time=tuple(t.wait_time.tolist()) if t else (),
            rank_samples=tuple(t.samples.tolist()) if t else (),
            max_workers=self.max_workers(), cluster_version=self.world.cluster_version,
            resizing=bool(self.elastic is not None and self.elastic.growing))

    # -- one step ----------------------------------------------------------------------
    def train_step(self) -> int:
        """Train on the next global batch; returns the number of samples it held."""
        t0 = time.perf_counter()
        self.apply_hyperparameters()
        part = self.sampler.peek(self.batch_size, self.world.rank, self.world.size)
        opt = self.optimizer
        self.monitored = self._monitoring_step(self.step + 1)
        opt.track_grad_norms = self.monitored and self.world.size > 1
        opt.set_local_weight(part.weight)
        opt.set_extra_slots(self._extra_slots())
        opt.zero_grad()
        n_local = len(part.indices)
        if self._sample_file is not None:
            self._sample_file.write(json.dumps({"epoch": self.epoch, "step": self.step,
                                                "rank": self.world.rank,
                                                "size": self.world.size,
                                                "indices": part.indices.tolist()}) + "\n")
        if n_local:
            idx = torch.from_numpy(part.indices)
            x, y = self.data.x_train[idx], self.data.y_train[idx]
            loss = self.loss_fn(self.model(x), y)
            self._stage_extras(float(loss.detach()) * n_local, n_local)
            loss.backward()
        else:
            self._stage_extras(0.0, 0)
        t1 = time.perf_counter()
        stats = opt.synchronize()
        t2 = time.perf_counter()
        if self.monitored:
            self._update_monitors(stats, part.global_count)
        self._keep_previous_gradients()
        opt.optimizer.step()
        self.sampler.advance(part.global_count)
        self.step += 1
        t3 = time.perf_counter()
        self._prev_local = (t3 - t0, t1 - t0, t2 - t1)
        self._read_extras(stats.extras, part.global_count)
        self._step_time = t3 - t0
        self._last_count = part.global_count
        return part.global_count

    # -- evaluation --------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Test accuracy of the (identical) replicas, each rank scoring a share of the set."""
        self.model.eval()
        x, y = self.data.x_test, self.data.y_test
        rank, size = self.world.rank, self.world.size
        xs, ys = x[rank::size], y[rank::size]
        correct = 0
        for i in range(0, len(xs), 512):
            correct += int((self.model(xs[i:i + 512]).argmax(1) == ys[i:i + 512]).sum())
        counts = np.array([correct, len(xs)], dtype=np.int64)
        communicator(self.world).allreduce(counts, ReduceOp.SUM)
        self.model.train()
        return float(counts[0]) / float(counts[1])

    # -- the loop ----------------------------------------------------------------------
    def _log_step(self, count: int) -> None:
        rec = StepRecord(step=self.step, epoch=self.epoch, world_size=self.world.size,
                         batch_size=self.batch_size, lr=self.lr, momentum=self.momentum,
                         loss=self.last_loss,
                         samples_per_s=count / self._step_time if self._step_time else 0.0,
                         step_time_s=self._step_time,
                         cluster_version=self.world.cluster_version,
                         monitors=self.step_monitors())
        self.sink.write(rec)

    def _done(self) -> bool:
        return self.cfg.max_steps is not None and self.step >= self.cfg.max_steps

    def _hook(self, name: str) -> None:
        if self.engine is not None and self.engine.active:
            self.engine.run(name, self)

    def run(self, *, resume: bool = False) -> Dict[str, Any]:
        """Train until the epoch budget (or ``max_steps``) is spent; returns the summary.

        ``resume``: a joining worker enters at the step boundary where the running job is
        (its state came by ``sync_state``), skipping the hooks that already ran there."""
        self._last_count = 0
        if not resume:
            self._hook("before_train")
        accuracy = self.last_accuracy
        first = True
        while self.epoch < self.cfg.epochs and not self._done() and not self.left \
                and not self.stopped:
            if self.sampler.epoch != self.epoch:
                self.sampler.set_epoch(self.epoch)
            if not (resume and first):
                self._hook("before_epoch")
            first = False
            t_epoch = time.perf_counter()
            samples = 0
            losses = []
            self._open_bar()
            while not self.sampler.epoch_done and not self._done() and not self.left:
                count = self.train_step()
                samples += count
                losses.append(self.last_loss)
                self._log_step(count)
                if self._bar is not None:
                    self._bar.update(count)
                    self._bar.set_postfix(loss=f"{self.last_loss:.3f}", bs=self.batch_size,
                                          n=self.world.size, refresh=False)
                if self.stop_requested:
                    self._stop_for_signal()
                    break
                if self.engine is not None and self.engine.active and \
                        self.engine.due(self.step, self.monitored):
                    self.engine.run("after_step", self)
                if not self.left:
                    self._poll_elastic()
            self._close_bar()
            if self.left or self.stopped:
                break
            elapsed = time.perf_counter() - t_epoch
            accuracy = self.evaluate()
            self.last_accuracy = accuracy
            rec = EpochRecord(step=self.step, epoch=self.epoch, world_size=self.world.size,
                              batch_size=self.batch_size, lr=self.lr,
                              loss=float(np.mean(losses)) if losses else float("nan"),
                              samples_per_s=samples / elapsed if elapsed else 0.0,
                              test_accuracy=accuracy, epoch_time_s=elapsed,
                              cluster_version=self.world.cluster_version)
            self.sink.write(rec)
            self.history.append({"epoch": self.epoch, "test_accuracy": accuracy,
                                 "loss": rec.loss})
            if self.world.rank == 0:
                log.info("epoch %d: loss %.4f, test accuracy %.4f, %.0f samples/s, "
                         "batch %d on %d workers", self.epoch, rec.loss, accuracy,
                         rec.samples_per_s, self.batch_size, self.world.size)
            finished_epoch = self.sampler.epoch_done
            self._hook("after_epoch")
            if finished_epoch and not self.left:
                self.epoch += 1
                self.sampler.set_epoch(self.epoch)
        if not self.left:
            if not self.stopped:
                self._hook("after_train")
            self._finish_elastic()
        self.sink.close()
        if self._sample_file is not None:
            self._sample_file.close()
        return {"final_test_accuracy": accuracy, "steps": self.step, "epochs": self.epoch,
                "world_size": self.world.size if not self.left else 0,
                "batch_size": self.batch_size, "lr": self.lr, "left": self.left,
                "cluster_version": self.world.cluster_version, "resizes": self.resizes,
                "stopped": self.stopped}

    def _finish_elastic(self) -> None:
        """A grow still pending when training ends is abandoned on every rank."""
        if self.elastic is not None and self.elastic.growing:
            self._record_resize(self.elastic.abandon("training ended first"))

    def _open_bar(self) -> None:
        if self.cfg.progress and self.world.rank == 0:
            from tqdm import tqdm

            self._bar = tqdm(total=self.sampler.num_samples, initial=self.sampler.cursor,
                             desc=f"epoch {self.epoch}", unit="sample", leave=False,
                             dynamic_ncols=True)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
