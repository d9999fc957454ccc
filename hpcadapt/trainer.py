"""The training loop behind ``python -m hpcadapt.train``: data-parallel steps over the
world, metrics on rank 0, and a step boundary where policy decisions are applied."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torch import nn

from .collectives import ReduceOp, communicator
from .datasets import Dataset, load_dataset
from .errors import ConfigurationError
from .metrics import EpochRecord, MetricsSink, StepRecord
from .models import build_model
from .parallel import DistributedOptimizer
from .sampler import ElasticSampler
from .runtime import World

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
    """Per-rank timings of one step, gathered through the gradient buckets' metric slots."""

    step_time: np.ndarray      # seconds, one entry per rank
    compute_time: np.ndarray   # forward + backward (with communication launched inside)
    wait_time: np.ndarray      # waiting for the gradient allreduce to finish
    samples: np.ndarray        # samples each rank trained on


class Trainer:
    """Owns model, optimizer, sampler and hyper-parameters; ``run()`` trains to the end.

    Hyper-parameters (``batch_size``, ``lr``, ``momentum``) are plain attributes that
    policies change between steps; ``step`` and ``epoch`` say where training stands."""

    def __init__(self, cfg: TrainConfig, world: World, *, dataset: Optional[Dataset] = None):
        cfg.validate()
        self.cfg = cfg
        self.world = world
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
        self.step = 0
        self.epoch = 0
        self.sink = MetricsSink(cfg.metrics_file, enabled=world.rank == 0)
        self.last_loss = float("nan")
        self.last_times: Optional[StepTimes] = None
        self.history: List[Dict[str, Any]] = []
        self._prev_local = (0.0, 0.0, 0.0)  # this rank's (step, compute, wait) of last step
        self._bar = None

    # -- metric slots ------------------------------------------------------------------
    def _extra_slots(self) -> int:
        # loss sum, then per-rank step, compute and wait times and sample counts.
        return 1 + 4 * self.world.size

    def _stage_extras(self, loss_sum: float, n_local: int) -> None:
        size, rank = self.world.size, self.world.rank
        extras = np.zeros(self._extra_slots())
        extras[0] = loss_sum
        step_t, compute_t, wait_t = self._prev_local
        extras[1 + rank] = step_t
        extras[1 + size + rank] = compute_t
        extras[1 + 2 * size + rank] = wait_t
        extras[1 + 3 * size + rank] = n_local
        self.optimizer.stage_extras(extras)

    def _read_extras(self, extras: np.ndarray, global_count: int) -> None:
        size = self.world.size
        self.last_loss = extras[0] / global_count if global_count else float("nan")
        self.last_times = StepTimes(extras[1:1 + size].copy(),
                                    extras[1 + size:1 + 2 * size].copy(),
                                    extras[1 + 2 * size:1 + 3 * size].copy(),
                                    extras[1 + 3 * size:1 + 4 * size].copy())

    # -- hyper-parameters --------------------------------------------------------------
    def apply_hyperparameters(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
            if "momentum" in group:
                group["momentum"] = self.momentum

    # -- one step ----------------------------------------------------------------------
    def train_step(self) -> int:
        """Train on the next global batch; returns the number of samples it held."""
        t0 = time.perf_counter()
        part = self.sampler.peek(self.batch_size, self.world.rank, self.world.size)
        opt = self.optimizer
        opt.set_local_weight(part.weight)
        opt.zero_grad()
        self.apply_hyperparameters()
        n_local = len(part.indices)
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
        opt.optimizer.step()
        self.sampler.advance(part.global_count)
        self.step += 1
        t3 = time.perf_counter()
        self._prev_local = (t3 - t0, t1 - t0, t2 - t1)
        self._read_extras(stats.extras, part.global_count)
        self._step_time = t3 - t0
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

    def step_monitors(self) -> Dict[str, float]:
        """Extra values for the step line (policies and monitors add theirs)."""
        return {}

    def _done(self) -> bool:
        return self.cfg.max_steps is not None and self.step >= self.cfg.max_steps

    def run(self) -> Dict[str, Any]:
        """Train until the epoch budget (or ``max_steps``) is spent; returns the summary."""
        self.before_train()
        accuracy = float("nan")
        while self.epoch < self.cfg.epochs and not self._done():
            if self.sampler.cursor == 0 or self.sampler.epoch != self.epoch:
                self.sampler.set_epoch(self.epoch)
            self.before_epoch()
            t_epoch = time.perf_counter()
            samples = 0
            losses = []
            self._open_bar()
            while not self.sampler.epoch_done and not self._done():
                count = self.train_step()
                samples += count
                losses.append(self.last_loss)
                self._log_step(count)
                if self._bar is not None:
                    self._bar.update(count)
                    self._bar.set_postfix(loss=f"{self.last_loss:.3f}", bs=self.batch_size,
                                          n=self.world.size, refresh=False)
                self.after_step()
            self._close_bar()
            elapsed = time.perf_counter() - t_epoch
            accuracy = self.evaluate()
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
            if self.sampler.epoch_done:
                self.epoch += 1
                self.sampler.set_epoch(self.epoch)
            self.after_epoch()
        self.after_train()
        self.sink.close()
        return {"final_test_accuracy": accuracy, "steps": self.step, "epochs": self.epoch,
                "world_size": self.world.size}

    # Hooks for the policy engine; the plain trainer does nothing at these points.
    def before_train(self) -> None: ...
    def before_epoch(self) -> None: ...
    def after_step(self) -> None: ...
    def after_epoch(self) -> None: ...
    def after_train(self) -> None: ...

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
