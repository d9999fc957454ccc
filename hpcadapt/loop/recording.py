"""The metrics file's writer and the epoch's running totals, with one owner: ``Recorder``.

The job hands it each record (steps, decisions, switches, resizes, failures, stops) and
tells it where an epoch starts and what each step trained; it writes the epoch line from
those totals and keeps the user's last metrics for the summary. A recovery that makes this
rank the new rank 0 takes the file over (``take_over``). Only rank 0's recorder writes the
metrics; with ``--sample-log`` every process writes the samples each of its steps trained
on, to a file of its own."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from hpcadapt.base.metrics import EpochRecord, MetricsSink

__all__ = ["Recorder"]


class Recorder:
    """Writes the metrics file (rank 0) and totals the epoch in progress."""

    def __init__(self, metrics_file: Optional[str] = None, *, enabled: bool = False,
                 resuming: bool = False):
        self._sink = MetricsSink(metrics_file, enabled=enabled, append=resuming)
        #: the last value of each metric the user logged (log_epoch), for the summary
        self.user_metrics: Dict[str, float] = {}
        self.epoch_logged = False
        self._samples = 0
        self._losses: List[float] = []
        self._started = time.perf_counter()
        self._sample_file = None

    def open(self, metrics_file: Optional[str], *, enabled: bool, resuming: bool) -> None:
        """Where the records go, once this process knows its rank (rank 0 writes): the Job
        hands this recorder to its collaborators before MPI starts."""
        self._sink.close()
        self._sink = MetricsSink(metrics_file, enabled=enabled, append=resuming)

    def open_sample_log(self, folder: str) -> None:
        """``--sample-log``: this process's own file of the samples each step trained on."""
        os.makedirs(folder, exist_ok=True)
        # Line-buffered: a worker killed at any moment has written every step it committed
        # (the failure tests count samples from these files).
        self._sample_file = open(os.path.join(folder, f"samples-{os.getpid()}.jsonl"), "a",
                                 encoding="utf-8", buffering=1)

    @property
    def logs_samples(self) -> bool:
        return self._sample_file is not None

    def log_samples(self, *, epoch: int, step: int, rank: int, size: int, version: int,
                    indices) -> None:
        """One step's samples of one rank (``indices``: an integer array), when
        ``--sample-log`` is on."""
        if self._sample_file is not None:
            self._sample_file.write(json.dumps({
                "epoch": epoch, "step": step, "rank": rank, "size": size, "version": version,
                "indices": indices.tolist()}) + "\n")

    def write(self, record: Any) -> None:
        self._sink.write(record)

    def close(self) -> None:
        """The metrics file and the sample log closed."""
        self._sink.close()
        if self._sample_file is not None:
            self._sample_file.close()
            self._sample_file = None

    def take_over(self, metrics_file: Optional[str]) -> None:
        """This rank became rank 0 in a recovery: append to the file the old one wrote."""
        self._sink.close()
        self._sink = MetricsSink.take_over(metrics_file)

    def start_epoch(self) -> None:
        self._samples, self._losses = 0, []
        self._started = time.perf_counter()
        self.epoch_logged = False

    def count_step(self, samples: int, loss: float) -> None:
        self._samples += samples
        self._losses.append(loss)

    def write_epoch(self, *, step: int, epoch: int, world_size: int, batch_size: int,
                    lr: float, test_accuracy: Optional[float], cluster_version: int,
                    user: Mapping[str, float]) -> EpochRecord:
        """The epoch line from this epoch's totals and the user's metrics (``user``)."""
        elapsed = time.perf_counter() - self._started
        losses = [x for x in self._losses if x == x]  # not NaN
        rec = EpochRecord(step=step, epoch=epoch, world_size=world_size,
                          batch_size=batch_size, lr=lr,
                          loss=float(np.mean(losses)) if losses else float("nan"),
                          samples_per_s=self._samples / elapsed if elapsed else 0.0,
                          test_accuracy=float("nan") if test_accuracy is None
                          else float(test_accuracy),
                          epoch_time_s=elapsed, cluster_version=cluster_version)
        self._sink.write({**asdict(rec), **user})
        self.user_metrics.update(user)
        self.epoch_logged = True
        return rec
