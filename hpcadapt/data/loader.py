"""A data loader for elastic training: the user's own ``Dataset`` and what they rely on in
``torch.utils.data.DataLoader`` (worker processes, ``collate_fn``, ``pin_memory``,
prefetching), fed from the job's single global data cursor, so the global batch size and the
world size may change in the middle of an epoch with every sample used exactly once.

How: each step's global batch is the next ``batch_size`` samples after the cursor, cut into
one contiguous part per rank (``ElasticSampler``); a rank's part is cut again into
micro-batches of at most ``max_local_batch`` samples when it is larger. ``PlannedBatches``
walks that plan from a cursor for a fixed configuration; a ``DataLoader`` with it as
``batch_sampler`` prefetches along the walk. When the configuration changes (batch size,
world size, rank, epoch), the job starts a new walk at the cursor and the prefetched
batches of the old one are dropped (persistent workers stay up). A rank whose share of a
step is empty gets no batch: its collate function never sees an empty list."""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.util
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from hpcadapt.base.errors import ConfigurationError, on_every_rank
from hpcadapt.base.lifecycle import pid_alive
from hpcadapt.data.sampler import ElasticSampler, StepSlice

__all__ = ["ElasticDataLoader", "PlannedBatches", "split_micro", "WalkKey", "WorkerStart",
           "sweep_dead_worker_dirs"]


def split_micro(indices: np.ndarray, cap: Optional[int]) -> List[np.ndarray]:
    """``indices`` cut into near-equal contiguous micro-batches of at most ``cap`` samples."""
    n = len(indices)
    if n == 0:
        return []
    if cap is None or n <= cap:
        return [indices]
    parts = -(-n // cap)
    return [p for p in np.array_split(indices, parts)]


@dataclass(frozen=True)
class WalkKey:
    """What a walk through the epoch depends on; a new key means a new walk."""

    epoch: int
    batch_size: int
    rank: int
    size: int
    cap: Optional[int]


class PlannedBatches:
    """The micro-batches (index lists) this rank trains on, step by step from ``start`` to
    the end of the epoch, for one ``WalkKey``; empty shares are skipped."""

    def __init__(self, sampler: ElasticSampler):
        self.sampler = sampler
        self.key: Optional[WalkKey] = None
        self.start = 0

    def reset(self, key: WalkKey, start: int) -> None:
        self.key, self.start = key, start

    def steps(self) -> Iterator[Tuple[StepSlice, List[np.ndarray]]]:
        k = self.key
        cursor = self.start
        n = self.sampler.num_samples
        while cursor < n:
            part = self.sampler.slice_at(cursor, k.batch_size, k.rank, k.size)
            yield part, split_micro(part.indices, k.cap)
            cursor += part.global_count

    def __iter__(self) -> Iterator[List[int]]:
        for _, micro in self.steps():
            for m in micro:
                yield m.tolist()

    def __len__(self) -> int:
        return sum(len(m) for _, m in self.steps())


_PR_SET_PDEATHSIG = 1  # prctl(2)
_WORKER_DIR_PREFIX = "hpcadapt-worker-"


def _own_temp_dir() -> None:
    """Give this worker's multiprocessing a temporary folder named after its pid (its
    ``pymp-*`` folder otherwise, where torch's file-descriptor sharing listens): removed at a
    normal exit as before, and by ``sweep_dead_worker_dirs`` when the worker was killed."""
    config = multiprocessing.process.current_process()._config
    if config.get("tempdir") is not None:
        return
    path = tempfile.mkdtemp(prefix=f"{_WORKER_DIR_PREFIX}{os.getpid()}-")
    config["tempdir"] = path
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(path,),
                                  kwargs={"ignore_errors": True}, exitpriority=-100)


def sweep_dead_worker_dirs(base: Optional[str] = None) -> int:
    """Remove the temporary folders of this user's loader workers that were killed (their
    pid is gone): a rank killed with its workers leaves them behind. Any process of the job
    calls it at its end; it never follows a link and leaves a live worker's folder alone.
    Returns how many were removed."""
    base = base or tempfile.gettempdir()
    removed = 0
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(_WORKER_DIR_PREFIX):
            continue
        pid_text = name[len(_WORKER_DIR_PREFIX):].split("-", 1)[0]
        path = os.path.join(base, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not pid_text.isdigit() or info.st_uid != os.getuid() or \
                not os.path.isdir(path) or os.path.islink(path):
            continue
        if pid_alive(int(pid_text)):
            continue  # alive (or a reused pid): not ours to remove
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


class WorkerStart:
    """Runs first in every loader worker: the worker is the user's, so it must die with its
    rank. A rank killed by SIGKILL runs no clean-up, and torch's own watch notices the
    parent gone only between batches; a worker left behind holds the launcher's output
    pipe and the launcher never exits. Linux's parent-death signal ends it at once
    (elsewhere torch's watch remains). Then the user's ``worker_init_fn``. Picklable, for
    the ``spawn`` and ``forkserver`` contexts."""

    def __init__(self, rank_pid: int, user_init: Optional[Callable[[int], None]],
                 context=None):
        self.rank_pid = rank_pid
        self.user_init = user_init
        # Under ``forkserver`` the worker's parent is the server, which outlives the rank
        # by design (it watches the rank itself): nothing to tie here.
        if context is None:  # the default, without fixing it (get_start_method() would)
            method = (multiprocessing.get_start_method(allow_none=True)
                      or multiprocessing.get_all_start_methods()[0])
        else:
            method = context if isinstance(context, str) else context.get_start_method()
        self.direct_child = method in ("fork", "spawn")

    def __call__(self, worker_id: int) -> None:
        if self.direct_child and sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            except (OSError, AttributeError):  # pragma: no cover - no prctl: torch's watch
                pass
            if os.getppid() != self.rank_pid:  # the rank died before prctl: follow it now
                os._exit(0)
        _own_temp_dir()
        if self.user_init is not None:
            self.user_init(worker_id)


class ElasticDataLoader:
    """Like ``DataLoader(dataset, batch_size, shuffle=True, ...)``, but ``batch_size`` is the
    global batch (over all ranks) and the job decides it from then on. Pass the loader to
    ``job.setup(...)``, then iterate it inside ``job.epochs()``: it yields this rank's
    (micro-)batches, and the job's step boundaries run between them.

    ``num_workers``, ``collate_fn``, ``pin_memory``, ``prefetch_factor``,
    ``worker_init_fn`` and ``multiprocessing_context`` mean what they mean for
    ``DataLoader``; workers are persistent across epochs and resizes. The order of samples
    is a seeded permutation per epoch (``seed``), identical on every rank."""

    def __init__(self, dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 num_workers: int = 0, collate_fn: Optional[Callable[[List[Any]], Any]] = None,
                 pin_memory: bool = False, prefetch_factor: Optional[int] = None,
                 worker_init_fn: Optional[Callable[[int], None]] = None,
                 multiprocessing_context=None, timeout: float = 0):
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ConfigurationError(f"batch_size must be a positive integer (the global batch "
                                     f"over all ranks), got {batch_size!r}")
        if num_workers < 0:
            raise ConfigurationError(f"num_workers must be 0 or more, got {num_workers}")
        try:
            n = len(dataset)
        except TypeError:
            raise ConfigurationError("the dataset must have a length (a map-style Dataset); "
                                     "iterable datasets cannot be resumed at a cursor") from None
        self.dataset = dataset
        self._start_batch_size = batch_size
        self._job_batch_size: Optional[Callable[[], int]] = None  # Job.setup binds it
        self.sampler = ElasticSampler(n, seed=seed, shuffle=shuffle)
        self.plan = PlannedBatches(self.sampler)
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self._fast = (isinstance(dataset, TensorDataset) and num_workers == 0
                      and collate_fn is None)
        self._loader: Optional[DataLoader] = None
        if num_workers > 0:
            self._loader = DataLoader(
                dataset, batch_sampler=self.plan, num_workers=num_workers,
                collate_fn=collate_fn, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                persistent_workers=True,
                worker_init_fn=WorkerStart(os.getpid(), worker_init_fn,
                                           multiprocessing_context),
                multiprocessing_context=multiprocessing_context, timeout=timeout)
        self._pin_memory = pin_memory
        self._iter: Optional[Iterator[Any]] = None
        self._batches: Optional[Callable[[], Iterator[Any]]] = None  # Job.setup binds it

    def __len__(self) -> int:
        """Steps per epoch at the current global batch, as torch's ``len(DataLoader)``
        (``ceil(len(dataset) / batch_size)``), so ``epochs * len(loader)`` sizes a
        scheduler. A policy that changes the batch changes it: key such schedules on the
        job's progress instead (``hpcadapt.ProgressLR``, ``job.scale_invariant_steps``).
        Under ``--max-local-batch`` a step is several micro-batches; this counts steps."""
        return -(-self.sampler.num_samples // self.batch_size)

    @property
    def num_samples(self) -> int:
        """The samples in one epoch (``len(dataset)``)."""
        return self.sampler.num_samples

    def __iter__(self):
        if self._batches is None:
            raise on_every_rank(ConfigurationError(
                "pass the loader to job.setup(model, optimizer, loader) "
                "before iterating it"))
        return self._batches()

    @property
    def batch_size(self) -> int:
        """The global batch: the one given here until ``job.setup``, then the job's (the
        policies change it; the job's training state holds it, not the loader)."""
        if self._job_batch_size is not None:
            return self._job_batch_size()
        return self._start_batch_size

    def bind(self, batches: Callable[[], Iterator[Any]],
             batch_size: Callable[[], int]) -> None:
        """``job.setup`` binds the loader to the job: iterating it yields ``batches()``,
        this rank's (micro-)batches of the current epoch, with the step boundary between
        steps; ``batch_size()`` is the job's global batch, read from its training state
        (``TrainingState.global_batch_size``: the hyper-parameters hold the one value)."""
        self._batches = batches
        self._job_batch_size = batch_size

    def close(self) -> None:
        """Stop the worker processes now (``job.finish`` calls it): they exit through their
        normal path, removing their temporary folders, instead of being killed at the
        interpreter's exit seconds later. The loader cannot be iterated afterwards."""
        iterator = self._loader._iterator if self._loader is not None else None
        for it in (iterator, self._iter):
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        if self._loader is not None:
            self._loader._iterator = None
        self._iter = None

    # -- used by the job -----------------------------------------------------------------
    def restart(self, key: WalkKey, start: int) -> None:
        """Begin a new walk at ``start`` (dropping what was prefetched for the old one)."""
        self.plan.reset(key, start)
        self._iter = iter(self._loader) if self._loader is not None else None

    def next_batch(self, indices: np.ndarray) -> Any:
        """The batch for ``indices``, the next micro-batch of the current walk."""
        if self._iter is not None:
            return next(self._iter)
        return self.load(indices)

    def load(self, indices: np.ndarray) -> Any:
        """The batch for ``indices`` read here and now (no prefetch: bounded-delay rounds
        hand out batches one at a time)."""
        if self._fast:
            idx = torch.from_numpy(indices)
            return tuple(t[idx] for t in self.dataset.tensors)
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = getitems(indices.tolist()) if getitems is not None else \
            [self.dataset[int(i)] for i in indices]
        collate = self.collate_fn
        if collate is None:
            from torch.utils.data import default_collate as collate
        batch = collate(samples)
        if self._pin_memory and torch.cuda.is_available():
            from torch.utils.data._utils.pin_memory import pin_memory

            batch = pin_memory(batch)
        return batch
