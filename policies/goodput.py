"""``goodput``: the configuration that maximises goodput = throughput x statistical efficiency
(Pollux, OSDI'21; AdaptDL).

Every ``interval`` steps the policy records the measured step of the current configuration
(workers, local batch, passes of forward/backward; its per-rank compute and wait times).
After ``warmup`` steps, and ``cooldown`` steps after any change, it fits the step-time model
of ``goodput_model`` to the median of each configuration seen so far, takes the statistical
efficiency from the smoothed noise-scale statistics, evaluates every candidate (global batches
on a powers-of-2 grid in [min, max]; with an allocator, worker counts up to the job's maximum
and at most twice the largest count measured, Pollux's bound on exploring) and moves to the
best one when its predicted goodput beats the current configuration's by more than
``threshold`` (at once when the current batch lies outside [min, max]). Gradient
accumulation follows from the batch and the memory cap (the job's ``--max-local-batch``,
or ``--goodput-max-local-batch`` to override it): a local batch above it costs
ceil(local/cap) passes, and the model charges them. The learning rate follows the batch
through ``--lr-rule`` (adascale or sqrt)."""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from hpcadapt.base.errors import ConfigurationError

from . import goodput_model as gm
from .base import Decision, MetricsSnapshot, Param, Policy
from .params import float_above, fraction, non_negative_int, positive_int

__all__ = ["Goodput"]

log = logging.getLogger(__name__)

Config = Tuple[int, int, int]   # workers, local batch (largest share), passes


class Goodput(Policy):
    """Pollux's goodput: batch size, accumulation and workers from a fitted model."""

    name = "goodput"
    changes_batch = True
    params = (
        Param("min", positive_int, 16, "smallest global batch the policy sets"),
        Param("max", positive_int, 1024, "largest global batch the policy sets"),
        Param("interval", positive_int, 10,
              "record the step time and decide every N steps (the noise scale is monitored "
              "at the same interval)"),
        Param("warmup", non_negative_int, 50, "steps before the first decision"),
        Param("cooldown", non_negative_int, 50, "steps to wait after any batch or size change"),
        Param("threshold", fraction, 0.05,
              "move only when the predicted goodput beats the current one by this fraction"),
        Param("max-local-batch", positive_int, None,
              "memory cap of one forward/backward pass; default: the job's "
              "--max-local-batch (none: no accumulation)"),
        Param("min-workers", positive_int, 1,
              "fewest workers the policy asks for when the job can resize"),
        Param("max-step", float_above(1.0), 4.0,
              "largest factor one decision grows or shrinks the global batch by (the "
              "efficiency far from the measured batch is an extrapolation)"),
    )
    requires = ("gns",)
    reads = ()

    # Measurements kept per configuration (the newest; the machine's load drifts).
    KEEP = 64
    # Measurements a configuration needs before the model is fitted to it.
    MIN_SAMPLES = 3

    def __init__(self, *, min: int = 16, max: int = 1024, interval: int = 10, warmup: int = 50,
                 cooldown: int = 50, threshold: float = 0.05,
                 max_local_batch: Optional[int] = None, min_workers: int = 1,
                 max_step: float = 4.0):
        if min > max:
            raise ConfigurationError(
                f"--goodput-min ({min}) must not exceed --goodput-max ({max})")
        self.min, self.max, self.interval = min, max, interval
        self.warmup, self.cooldown, self.threshold = warmup, cooldown, threshold
        self.cap, self.min_workers = max_local_batch, min_workers
        # Seen on MNIST-1D: a jump 64 -> 512 early in training (the linear rule then set
        # 8x the rate) diverged 2 runs of 7; x4 at most per decision did not.
        self.max_step = max_step
        self.samples: Dict[str, List[List[float]]] = {}   # "N,m,k" -> [[compute, step], ...]
        self.last_change = -10**9
        self.elastic = False   # the job can change its number of workers
        self._said: set = set()

    # -- measurements ------------------------------------------------------------------------
    def config(self, snap: MetricsSnapshot) -> Config:
        local = -(-snap.batch_size // snap.world_size)
        k = int(gm.passes(local, self.memory_cap(snap)))
        return snap.world_size, local, k

    def memory_cap(self, snap: MetricsSnapshot) -> Optional[int]:
        """The per-rank memory cap: this policy's flag, else the job's --max-local-batch."""
        return self.cap if self.cap is not None else snap.max_local_batch

    def record(self, snap: MetricsSnapshot) -> bool:
        """Keep the step time this snapshot carries; False if it has none usable.

        The times in a snapshot are those of the step before it (they travel in the next
        step's reduction), so the two steps after a change are left out."""
        if snap.step - self.last_change < 2 or snap.resizing:
            return False
        n = snap.world_size
        comp, wait, step = (np.asarray(x, dtype=float)[:n] for x in
                            (snap.compute_time, snap.wait_time, snap.step_time))
        if not (len(comp) == len(wait) == len(step) == n) or n == 0:
            return False
        local = step - wait
        if not (np.all(np.isfinite(local)) and np.all(np.isfinite(step)) and np.all(local > 0)):
            return False
        key = ",".join(map(str, self.config(snap)))
        rows = self.samples.setdefault(key, [])
        rows.append([float(local.mean()), float(step.mean())])
        del rows[:-self.KEEP]
        return True

    def table(self) -> Optional[Dict[str, np.ndarray]]:
        """Median compute and step time of every configuration with enough measurements."""
        rows = [(tuple(int(v) for v in key.split(",")), np.median(np.asarray(vals), axis=0))
                for key, vals in self.samples.items() if len(vals) >= self.MIN_SAMPLES]
        if not rows:
            return None
        cfg = np.array([c for c, _ in rows], dtype=float)
        t = np.array([v for _, v in rows])
        return {"workers": cfg[:, 0], "local": cfg[:, 1], "passes": cfg[:, 2],
                "compute": t[:, 0], "step": t[:, 1]}

    # -- deciding ------------------------------------------------------------------------------
    def _once(self, key: str, level: int, message: str, *args: Any) -> None:
        log.log(level if key not in self._said else logging.DEBUG, message, *args)
        self._said.add(key)

    def worker_range(self, snap: MetricsSnapshot) -> np.ndarray:
        """Worker counts to consider: the current one alone without an allocator."""
        self.elastic = self.elastic or snap.can_resize or snap.max_workers > snap.world_size
        if not self.elastic:
            self._once("no-allocator", logging.INFO,
                       "goodput: the job cannot resize (no allocator, or no room above %d "
                       "workers): adapting the batch size only", snap.world_size)
            return np.array([snap.world_size])
        seen = max([int(k.split(",")[0]) for k in self.samples] + [snap.world_size])
        high = int(min(snap.max_workers, 2 * seen))
        low = int(min(max(self.min_workers, snap.min_workers), snap.world_size))
        return np.arange(max(1, low), max(high, low) + 1)

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        self.record(snap)
        if snap.step < self.warmup or snap.step - self.last_change < self.cooldown \
                or snap.resizing:
            return None
        if not (math.isfinite(snap.grad_sq) and math.isfinite(snap.trace_sigma)):
            self._once("stats", logging.WARNING,
                       "goodput: step %d: no finite noise-scale statistics (|G|^2=%s, "
                       "tr(Sigma)=%s): no decision", snap.step, snap.grad_sq, snap.trace_sigma)
            return None
        table = self.table()
        current = self.config(snap)
        have_current = table is not None and any(
            (table["workers"] == current[0]) & (table["local"] == current[1])
            & (table["passes"] == current[2]))
        if not have_current:
            self._once("few", logging.INFO,
                       "goodput: step %d: fewer than %d step-time measurements of the current "
                       "configuration (%d workers, local batch %d, %d passes): keeping it until "
                       "the throughput model can be fitted", snap.step, self.MIN_SAMPLES,
                       *current)
            return None
        params = gm.fit_step_time(table["workers"], table["local"], table["passes"],
                                  table["compute"], table["step"])
        if not params.compute_fitted:
            self._once("prior", logging.INFO,
                       "goodput: one local batch size measured so far: the compute time is "
                       "split half fixed, half per sample until another is measured")
        workers = self.worker_range(snap)
        batches = gm.batch_grid(self.min, self.max)
        if self.min <= snap.batch_size <= self.max:
            near = batches[(batches <= snap.batch_size * self.max_step)
                           & (batches * self.max_step >= snap.batch_size)]
            batches = near if near.size else batches
        grid_n, grid_b = np.meshgrid(workers, batches, indexing="ij")
        stats = dict(cap=self.memory_cap(snap), base_batch=snap.base_batch_size,
                     grad_sq=snap.grad_sq, trace_sigma=snap.trace_sigma)
        cand = gm.evaluate(params, grid_n.ravel(), grid_b.ravel(), **stats)
        now = gm.evaluate(params, snap.world_size, snap.batch_size, **stats)
        g_now = float(now["goodput"])
        if not np.all(np.isfinite(cand["goodput"])) or not (math.isfinite(g_now) and g_now > 0):
            self._once("nan", logging.WARNING,
                       "goodput: step %d: the model gave no finite goodput (|G|^2=%s, "
                       "tr(Sigma)=%s, fit %s): no decision", snap.step, snap.grad_sq,
                       snap.trace_sigma, params.as_dict())
            return None
        i = int(np.argmax(cand["goodput"]))
        g_best = float(cand["goodput"][i])
        n_best, b_best = int(grid_n.ravel()[i]), int(grid_b.ravel()[i])
        gain = g_best / g_now - 1.0
        outside = not self.min <= snap.batch_size <= self.max
        if (n_best, b_best) == (snap.world_size, snap.batch_size) or (
                gain <= self.threshold and not outside):
            return None
        changes: Dict[str, Any] = {}
        if b_best != snap.batch_size:
            changes["batch_size"] = b_best
        if n_best != snap.world_size:
            changes["world_size"] = n_best
        metrics = {"goodput_predicted": g_best, "goodput_current": g_now, "gain": gain,
                   "throughput_predicted": float(cand["throughput"][i]),
                   "throughput_current": float(now["throughput"]),
                   "efficiency_predicted": float(cand["efficiency"][i]),
                   "efficiency_current": float(now["efficiency"]),
                   "passes": float(cand["passes"][i]),
                   "grad_sq": snap.grad_sq, "trace_sigma": snap.trace_sigma,
                   "configurations_measured": float(len(table["workers"])),
                   **{f"fit_{k}": v for k, v in params.as_dict().items()}}
        if snap.grad_sq > 0:   # else no signal measured: no finite noise scale to report
            metrics["noise_scale"] = snap.trace_sigma / snap.grad_sq
        where = f" on {n_best} workers" if n_best != snap.world_size else ""
        why = (f"batch {snap.batch_size} is outside [{self.min}, {self.max}]: " if outside
               else "")
        return Decision(
            reason=f"{why}goodput {g_best:.0f} predicted at batch {b_best}{where} "
                   f"({int(cand['passes'][i])} pass(es) per step) vs {g_now:.0f} at batch "
                   f"{snap.batch_size} on {snap.world_size}: {100 * gain:+.0f}%",
            policy=self.name, metrics=metrics, **changes)

    def on_decision(self, decision: Decision, snap: MetricsSnapshot) -> None:
        if decision.batch_size is not None or decision.world_size is not None:
            self.last_change = snap.step

    def on_resize(self, snap: MetricsSnapshot, *, old_size: int, new_size: int):
        self.last_change = snap.step
        self.elastic = True
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {"samples": {k: [list(r) for r in v] for k, v in self.samples.items()},
                "last_change": self.last_change, "elastic": self.elastic}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.samples = {k: [list(map(float, r)) for r in v] for k, v in state["samples"].items()}
        self.last_change = int(state["last_change"])
        self.elastic = bool(state["elastic"])
