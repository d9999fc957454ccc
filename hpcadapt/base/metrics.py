"""Typed metrics records and the JSON Lines sink that rank 0 writes them to."""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import time
from dataclasses import asdict, dataclass, field, fields
from typing import IO, Any, Dict, List, Mapping, Optional

from hpcadapt.base.errors import ConfigurationError

__all__ = ["StepRecord", "EpochRecord", "EvalRecord", "DecisionRecord", "ResizeRecord",
           "MetricsSink",
           "TopologyRecord", "StrategyRecord", "StopRecord", "ResumeRecord", "FailureRecord",
           "RecoveryRecord", "BoundedDelayRecord", "user_metrics", "RESERVED_EPOCH_KEYS",
           "RESERVED_EVAL_KEYS", "json_safe"]


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
class EvalRecord:
    """An evaluation during training (``job.log_eval``): where training stood (committed
    ``step``s, ``samples`` seen over all epochs, ``epoch_progress`` in epochs, the global
    ``batch_size`` of the next step, the ``lr`` the last step used); the user's metrics
    are kept flat beside these fields."""
    step: int
    epoch: int
    samples: int
    epoch_progress: float
    batch_size: int
    lr: float
    world_size: int
    cluster_version: int
    event: str = "eval"


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
    lr: float          # the rate the next update uses (the user's times lr_factor)
    lr_factor: float = 1.0  # the policies' factor on the user's rates
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
    lr: float          # the rate the next update uses (the user's times lr_factor)
    decision_to_first_step_s: float = float("nan")
    replicas_identical: Optional[bool] = None
    pids: Optional[List[int]] = None   # of the new world's ranks, in rank order
    event: str = "resize"


def _record_dict(record: Any) -> Dict[str, Any]:
    """A record's fields as the file's keys: a trailing underscore names a key that is a
    Python keyword (``from_`` is written ``from``)."""
    return {k[:-1] if k.endswith("_") else k: v for k, v in asdict(record).items()}


@dataclass(frozen=True)
class TopologyRecord:
    """The allreduce topology switched (a policy's plan or ``job.switch_topology``)."""
    step: int
    epoch: int
    from_: str
    to: str
    reason: str
    previous_cluster_version: int
    cluster_version: int
    event: str = "topology"


@dataclass(frozen=True)
class StrategyRecord:
    """The synchronisation strategy switched; ``replicas_identical`` when it was checked."""
    step: int
    epoch: int
    from_: Dict[str, Any]
    to: Dict[str, Any]
    reason: str
    previous_cluster_version: int
    cluster_version: int
    switch_s: float
    replicas_identical: Optional[bool]
    event: str = "strategy"


@dataclass(frozen=True)
class StopRecord:
    """Training stopped (a signal, divergence, a peer's failure) and whether it saved."""
    step: int
    epoch: int
    world_size: int
    signal: str
    saved: bool
    checkpoint: Optional[str]
    requeue: bool
    cluster_version: int
    event: str = "stop"


@dataclass(frozen=True)
class ResumeRecord:
    """A job resumed from a checkpoint written at ``saved_world_size`` workers."""
    step: int
    epoch: int
    world_size: int
    saved_world_size: int
    checkpoint: str
    cluster_version: int
    event: str = "resume"


@dataclass(frozen=True)
class FailureRecord:
    """A peer's failure that ends the job (state saved, exit 75)."""
    rank: int
    cause: str
    detail: str
    step: int
    epoch: int
    world_size: int
    detected_unix: float
    waited_s: float
    cluster_version: int
    event: str = "failure"


@dataclass(frozen=True)
class RecoveryRecord:
    """A peer's failure recovered from in place: who died, the step given up and the one
    training goes on from, and how long each phase of the recovery took."""
    dead: List[int]
    dead_pids: List[int]
    rank: int
    cause: str
    detail: str
    step: int
    step_in_flight: int
    epoch: int
    old_size: int
    world_size: int
    detected_unix: float
    recovered_unix: float
    waited_s: float
    recovery_s: float
    cluster_version: int
    previous_cluster_version: int
    agree_s: float
    form_world_s: float
    survey_s: float
    state_broadcast_s: Optional[float]
    recovered: bool = True
    event: str = "failure"


@dataclass(frozen=True)
class BoundedDelayRecord:
    """One bounded-delay round: the updates applied and dropped, and their delays."""
    step: int
    epoch: int
    first_step: int
    steps: int
    max_delay: int
    world_size: int
    samples: int
    applied_updates: int
    dropped_updates: int
    nonfinite_updates: int
    applications: int
    delays_applied: Dict[str, int]
    delays_dropped: Dict[str, int]
    updates_per_worker: Dict[str, int]
    pulls: int
    round_s: float
    event: str = "bounded-delay"


# Names a user metric cannot take: the epoch record's own fields and what the sink adds.
RESERVED_EPOCH_KEYS = frozenset(f.name for f in fields(EpochRecord)) | {"time_s", "unix_time"}
# The same for the eval record (``job.log_eval``).
RESERVED_EVAL_KEYS = frozenset(f.name for f in fields(EvalRecord)) | {"time_s", "unix_time"}


def user_metrics(values: Mapping[str, Any], *, caller: str = "log_epoch",
                 record: str = "epoch", reserved: frozenset = RESERVED_EPOCH_KEYS
                 ) -> Dict[str, float]:
    """The user's epoch metrics as floats, for the epoch record (kept flat beside the
    built-in fields, so ``jq .ema_accuracy`` reads them). A number (int, float, numpy
    scalar, 0-d tensor or array) is kept; NaN and infinity too (the file writes them as
    null, like every non-finite number). Raises ConfigurationError for a value that is not a
    number (a string, a list, None, a bool, a tensor of more than one value) and for a name
    that is a built-in field of the epoch record (it would overwrite it)."""
    out: Dict[str, float] = {}
    for name, value in values.items():
        if name in reserved:
            raise ConfigurationError(
                f"{caller}: the metric name {name!r} is a built-in field of the {record} "
                f"record; rename it (reserved: {', '.join(sorted(reserved))})")
        out[name] = _as_number(name, value, caller)
    return out


def _as_number(name: str, value: Any, caller: str = "log_epoch") -> float:
    """``value`` as a float, or ConfigurationError naming the metric and its type."""
    scalar = value
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        scalar = value.item()   # a 0-d tensor or numpy array
    if isinstance(scalar, numbers.Real) and not isinstance(scalar, bool):
        return float(scalar)
    kind = type(value).__module__ + "." + type(value).__qualname__ \
        if type(value).__module__ != "builtins" else type(value).__name__
    raise ConfigurationError(f"{caller}: the metric {name!r} is a {kind} ({_short(value)}), "
                             f"not a number; pass an int, a float or a 0-d tensor")


def _short(value: Any) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 40 else text[:37] + "..."


def json_safe(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


log = logging.getLogger(__name__)


def _time_origin(data: bytes) -> Optional[float]:
    """The unix time at which the sink that wrote the last timed record of ``data`` started
    (``unix_time - time_s``), or None when no record has both."""
    for line in reversed(data.splitlines()):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("unix_time"), (int, float)) \
                and isinstance(row.get("time_s"), (int, float)):
            return row["unix_time"] - row["time_s"]
    return None


class MetricsSink:
    """Writes one JSON object per record to a file; a sink with no path drops records.

    ``append``: a resumed run goes on in the file its earlier part wrote; a new run starts
    the file anew (appending would make one story of two runs: the plot would draw a stop
    and a resume that never happened). Never through a symlink."""

    def __init__(self, path: Optional[str], *, enabled: bool = True, append: bool = True):
        self._file: Optional[IO[str]] = None
        self._t0 = time.perf_counter()
        # Opened at the first record, which comes after job.setup: a job refused at setup
        # (its checkpoint held by another job) never empties the file that job writes.
        self._path = path if path and enabled else None
        self._append = append

    def _open(self) -> None:
        path, self._path = self._path, None
        mode = os.O_APPEND if self._append else os.O_TRUNC
        if not self._append and os.path.isfile(path) and os.path.getsize(path) > 0:
            log.info("--metrics-file %s held the records of an earlier run and there is no "
                     "checkpoint to resume from: this run starts it anew", path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | mode,
                     0o644)
        self._file = open(fd, "a", encoding="utf-8", buffering=1)

    def write(self, record: Any) -> None:
        if self._path is not None:
            self._open()
        if self._file is None:
            return
        obj = _record_dict(record) if hasattr(record, "__dataclass_fields__") else dict(record)
        obj["time_s"] = round(time.perf_counter() - self._t0, 6)
        obj["unix_time"] = round(time.time(), 3)  # to line up with scheduler events
        self._file.write(json.dumps(json_safe(obj), sort_keys=True) + "\n")

    @classmethod
    def take_over(cls, path: Optional[str]) -> "MetricsSink":
        """The sink of a new coordinator, appending to the file the dead one wrote: a last
        line it left half written is cut off, and ``time_s`` goes on from the file's last
        record (so the run's time axis stays one; the last, not the first: a file that a
        resumed job appends to starts its time over where the resumed job started)."""
        sink = cls(None)
        if not path:
            return sink
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            with os.fdopen(fd, "rb+") as f:
                data = f.read()
                keep = data.rfind(b"\n") + 1
                if keep < len(data):
                    f.truncate(keep)
                sink._file = open(os.dup(f.fileno()), "a", encoding="utf-8", buffering=1)
        except OSError as exc:
            log.error("the metrics file %s cannot be taken over (%s): no more records", path,
                      exc)
            return sink
        started = _time_origin(data[:keep])
        if started is not None:
            sink._t0 = time.perf_counter() - (time.time() - started)
        return sink

    def close(self) -> None:
        self._path = None
        if self._file is not None:
            self._file.close()
            self._file = None
