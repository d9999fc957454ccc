"""Typed metrics records and the JSON Lines sink that rank 0 writes them to."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Dict, List, Optional

__all__ = ["StepRecord", "EpochRecord", "DecisionRecord", "ResizeRecord", "MetricsSink"]


@dataclass(frozen=True)
class StepRecord:
    """One step as the optimizer took it: ``lr`` and ``momentum``/``betas`` are the first
    param group's values at its update (None where the optimizer has no such setting),
    ``lr_groups`` every group's rate when they differ."""
    step: int
    epoch: int
    world_size: int
    batch_size: int
    lr: float
    momentum: Optional[float]
    loss: float
    samples_per_s: float
    step_time_s: float
    cluster_version: int
    monitors: Dict[str, float] = field(default_factory=dict)
    betas: Optional[List[float]] = None
    lr_groups: Optional[List[float]] = None
    event: str = "step"


@dataclass(frozen=True)
class EpochRecord:
    step: int
    epoch: int
    world_size: int
    batch_size: int
    lr: float
    loss: float
    samples_per_s: float
    test_accuracy: float
    epoch_time_s: float
    cluster_version: int
    event: str = "epoch"


@dataclass(frozen=True)
class DecisionRecord:
    step: int
    epoch: int
    policy: str
    changes: Dict[str, Any]
    reason: str
    metrics: Dict[str, float]
    world_size: int
    batch_size: int
    lr: float
    event: str = "decision"


@dataclass(frozen=True)
class ResizeRecord:
    step: int
    epoch: int
    old_size: int
    new_size: int
    reason: str
    pause_s: float
    ok: bool
    cluster_version: int
    world_size: int
    batch_size: int
    lr: float
    decision_to_first_step_s: float = float("nan")
    replicas_identical: Optional[bool] = None
    pids: Optional[List[int]] = None   # of the new world's ranks, in rank order
    event: str = "resize"


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


log = logging.getLogger(__name__)


class MetricsSink:
    """Appends one JSON object per record to a file; a sink with no path drops records."""

    def __init__(self, path: Optional[str], *, enabled: bool = True):
        self._file: Optional[IO[str]] = None
        self._t0 = time.perf_counter()
        if path and enabled:
            self._file = open(path, "a", encoding="utf-8", buffering=1)

    def write(self, record: Any) -> None:
        if self._file is None:
            return
        obj = asdict(record) if hasattr(record, "__dataclass_fields__") else dict(record)
        obj["time_s"] = round(time.perf_counter() - self._t0, 6)
        obj["unix_time"] = round(time.time(), 3)  # to line up with scheduler events
        self._file.write(json.dumps(_clean(obj), sort_keys=True) + "\n")

    @classmethod
    def take_over(cls, path: Optional[str]) -> "MetricsSink":
        """The sink of a new coordinator, appending to the file the dead one wrote: a last
        line it left half written is cut off, and ``time_s`` goes on from the file's
        first record (so the run's time axis stays one)."""
        sink = cls(None)
        if not path:
            return sink
        first = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "rb+") as f:
                data = f.read()
                keep = data.rfind(b"\n") + 1
                if keep < len(data):
                    f.truncate(keep)
                head = data.split(b"\n", 1)[0]
                sink._file = open(os.dup(f.fileno()), "a", encoding="utf-8", buffering=1)
            first = json.loads(head) if head else None
        except OSError as exc:
            log.error("the metrics file %s cannot be taken over (%s): no more records", path,
                      exc)
            return sink
        except ValueError:
            first = None
        if isinstance(first, dict) and isinstance(first.get("unix_time"), (int, float)) \
                and isinstance(first.get("time_s"), (int, float)):
            started = first["unix_time"] - first["time_s"]
            sink._t0 = time.perf_counter() - (time.time() - started)
        return sink

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
