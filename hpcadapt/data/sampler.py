"""A distributed sampler whose progress is one global cursor, so batch size and world size
may change in the middle of an epoch without skipping or repeating a sample."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import numpy as np

from hpcadapt.base.errors import ConfigurationError

__all__ = ["ElasticSampler", "StepSlice"]


@dataclass(frozen=True)
class StepSlice:
    """One rank's share of one global batch."""

    indices: np.ndarray   # dataset indices this rank trains on
    global_count: int     # samples in the global batch (the last one of an epoch may be short)
    weight: float         # len(indices) / global_count: this rank's share of the gradient


class ElasticSampler:
    """Every epoch is a seeded permutation of the dataset; the next global batch is the
    ``global_batch`` samples after the cursor, cut into ``size`` contiguous near-equal
    parts, one per rank. All ranks compute the same thing from the same (epoch, cursor),
    so the sampler needs no communication; after a resize the cursor travels with the
    training state and the new world continues exactly where the old one stopped."""

    def __init__(self, num_samples: int, *, seed: int = 0, shuffle: bool = True):
        if num_samples <= 0:
            raise ConfigurationError(f"the dataset is empty (num_samples={num_samples})")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self._perm = self._permutation(0)
        self.job_driven = False  # job.setup sets it: set_epoch is then the job's

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def set_epoch(self, epoch: int) -> None:
        """torch's ``DistributedSampler.set_epoch`` convention. On its own: start ``epoch``
        from its first sample. Once a job drives it (``job.setup``), the job moves the
        epochs: the current epoch is a no-op (a resumed epoch goes on at its cursor) and any
        other is refused, since it would repeat or skip samples."""
        if self.job_driven:
            if epoch == self.epoch:
                return
            raise ConfigurationError(
                f"sampler.set_epoch({epoch}) in epoch {self.epoch}: the job moves the epochs "
                f"(job.epochs()); call it with the epoch job.epochs() yields, or not at all")
        self.start_epoch(epoch)

    def start_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its first sample."""
        self.epoch = epoch
        self.cursor = 0
        self._perm = self._permutation(epoch)

    @property
    def remaining(self) -> int:
        return self.num_samples - self.cursor

    @property
    def epoch_done(self) -> bool:
        return self.cursor >= self.num_samples

    def peek(self, global_batch: int, rank: int, size: int) -> StepSlice:
        """This rank's part of the next global batch (does not move the cursor)."""
        return self.slice_at(self.cursor, global_batch, rank, size)

    def slice_at(self, cursor: int, global_batch: int, rank: int, size: int) -> StepSlice:
        """This rank's part of the global batch that starts at ``cursor``."""
        if global_batch <= 0:
            raise ConfigurationError(f"global batch must be positive, got {global_batch}")
        if not 0 <= rank < size:
            raise ConfigurationError(f"rank {rank} is outside a world of size {size}")
        count = min(global_batch, self.num_samples - cursor)
        base, extra = divmod(count, size)
        start = cursor + rank * base + min(rank, extra)
        n = base + (1 if rank < extra else 0)
        indices = self._perm[start:start + n]
        return StepSlice(indices, count, (n / count) if count else 0.0)

    def advance(self, count: int) -> None:
        """Mark ``count`` samples as consumed (call on every rank after the step)."""
        if count < 0 or count > self.remaining:
            raise ConfigurationError(
                f"cannot advance by {count}: {self.remaining} samples remain in epoch {self.epoch}")
        self.cursor += count

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "num_samples": self.num_samples, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if int(state["num_samples"]) != self.num_samples:
            raise ConfigurationError(
                f"sampler state is for {state['num_samples']} samples, dataset has "
                f"{self.num_samples}")
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.start_epoch(int(state["epoch"]))
        self.cursor = int(state["cursor"])
