"""The policies at scale, by simulation (issue 30, item 3): replay a gradient-noise trajectory
through the policies with a throughput model of up to 1,024 workers.

The policies and the goodput model are pure, so no cluster is needed to see what they decide
at a scale this machine cannot run: this module plays the training job. Every simulated step
it takes the step time from a ``ThroughputModel``, draws the noisy |G|^2 and tr(Sigma) the
data-parallel estimator would measure from the true values of a ``NoiseTrajectory``,
smooths them as the job's monitor does, and, at the steps the engine would, builds a
``MetricsSnapshot``, calls the policies' hooks in the engine's order and applies their
decisions at the next step (batch size, workers, learning rate with the rule's ramp).

What it shows: the decisions the policies take (do they stay inside their limits, settle
rather than oscillate, follow a rising noise scale) and how long the policies themselves
take per call. What it does not: how fast a real cluster trains. The step time is a model
(compute per sample plus a ring allreduce), and the noise statistics come from an isotropic
Gaussian model of the gradient noise, not from a network.

Pure: numpy and this package only (no torch, no MPI, no ``hpcadapt.loop``, which sits above
the policies); the engine's rules (``hpcadapt/adapt/engine.py``) are mirrored in ``_decide``
and ``_apply``. One difference on purpose: a policy that raises or returns a value that
cannot be applied stops the simulation (the engine logs it and goes on), since a
simulation is a test."""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hpcadapt.base.noise_scale import GradientNoiseScale, NoiseEstimate

from . import add_policy_arguments, build_lr_rule, build_policies
from .base import Decision, MetricsSnapshot, Policy, merge_decisions
from .lr_rules import LRRule, Ramp

__all__ = ["ThroughputModel", "NoiseTrajectory", "draw_estimate", "exact_estimate",
           "Estimator",
           "SimDecision", "SimResult", "simulate", "policies_from_flags", "fixed_time",
           "best_fixed", "reversals", "run_scenario", "SCENARIOS"]


# -- the machine -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ThroughputModel:
    """Seconds per step of ``workers`` data-parallel workers at global batch ``batch``.

    step = compute + allreduce, with no overlap of the two (the worst case, so the
    communication is not understated; the goodput policy fits its own overlap exponent):

    * compute = k * overhead + per_sample * m for the largest local batch m = ceil(B / W),
      put through k = ceil(m / max_local_batch) passes (gradient accumulation above the
      memory cap; ``overhead`` is paid per pass: kernel launches, optimizer, input);
    * allreduce of P parameters (``params`` x ``bytes_per_param`` bytes) over W workers as a
      ring (reduce-scatter + all-gather): 2 (W - 1) / W * bytes / bandwidth for the data and
      2 (W - 1) * latency for its 2 (W - 1) rounds; 0 on one worker.

    The latency term is the ring's own, linear in W, because the bandwidth term is the
    ring's: both describe one algorithm. It is also the term that stops extra workers from
    paying at small local batches (10 ms at 1,024 workers and 5 us per round), the regime
    in which a scheduler must decide. A tree (2 log2 W rounds) would make the latency
    negligible at any W here and leave the per-step overhead as the only brake.

    Defaults: about a ResNet-50 on one GPU per worker (25.6M parameters in fp32, 0.8 ms per
    sample, 10 ms per pass, 256 samples per pass) over 100 Gb/s links; 1 s per resize
    (hpcadapt measured 0.2 s for a 200 MB state on one host)."""

    per_sample: float = 0.8e-3
    overhead: float = 0.01
    params: int = 25_600_000
    bytes_per_param: int = 4
    bandwidth: float = 12.5e9
    latency: float = 5e-6
    max_local_batch: Optional[int] = 256
    resize_pause: float = 1.0

    def __post_init__(self) -> None:
        for name in ("per_sample", "bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ThroughputModel.{name} must be positive")
        for name in ("overhead", "latency", "resize_pause", "params", "bytes_per_param"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"ThroughputModel.{name} must be >= 0")
        if self.max_local_batch is not None and self.max_local_batch < 1:
            raise ValueError("ThroughputModel.max_local_batch must be >= 1 or None")

    def passes(self, batch: int, workers: int) -> int:
        local = -(-int(batch) // int(workers))
        cap = self.max_local_batch
        return 1 if cap is None else max(1, -(-local // cap))

    def compute_time(self, batch: int, workers: int) -> float:
        local = -(-int(batch) // int(workers))
        return self.passes(batch, workers) * self.overhead + self.per_sample * local

    def allreduce_time(self, workers: int) -> float:
        w = int(workers)
        if w <= 1:
            return 0.0
        size = float(self.params) * self.bytes_per_param
        return 2.0 * (w - 1) / w * size / self.bandwidth + 2.0 * (w - 1) * self.latency

    def step_time(self, batch: int, workers: int) -> float:
        return self.compute_time(batch, workers) + self.allreduce_time(workers)


# -- the training it stands for ----------------------------------------------------------------
@dataclass(frozen=True)
class NoiseTrajectory:
    """The true |G|^2 and tr(Sigma) as functions of training progress, from a table
    interpolated log-linearly (clamped at both ends).

    Progress is counted in samples at a small batch (McCandlish et al.'s E_min): a step at
    batch B moves it by B / (1 + B / B_noise), since reaching a loss at batch B takes
    E_min (1 + B / B_noise) samples. The statistics depend on where training is, not on
    how many samples it spent getting there. ``dims``: the effective dimension of the
    gradient noise (an isotropic Gaussian in that many dimensions), which sets the spread
    of one step's estimates; real networks' noise is far from isotropic, so a small value
    stands for its few dominant directions."""

    progress: Tuple[float, ...]
    grad_sq: Tuple[float, ...]
    trace_sigma: Tuple[float, ...]
    dims: float = 16.0

    def __post_init__(self) -> None:
        p = np.asarray(self.progress, dtype=float)
        if not (len(p) == len(self.grad_sq) == len(self.trace_sigma) >= 2):
            raise ValueError("NoiseTrajectory needs equal-length tables of at least 2 rows")
        if not (np.all(np.diff(p) > 0) and p[0] >= 0):
            raise ValueError("NoiseTrajectory.progress must start at >= 0 and increase")
        if not (np.all(np.asarray(self.grad_sq) > 0) and np.all(np.asarray(self.trace_sigma) > 0)):
            raise ValueError("NoiseTrajectory's |G|^2 and tr(Sigma) must be positive")
        if not self.dims > 1:
            raise ValueError("NoiseTrajectory.dims must exceed 1")

    @classmethod
    def rising(cls, total: float, *, start: float = 100.0, end: float = 10_000.0,
               trace_sigma: float = 1.0, points: int = 33, dims: float = 16.0
               ) -> "NoiseTrajectory":
        """B_noise rising geometrically from ``start`` to ``end`` over ``total`` progress
        (McCandlish et al. saw the noise scale grow by one to two orders of magnitude over
        training as the loss falls), tr(Sigma) constant and |G|^2 = tr(Sigma) / B_noise."""
        p = np.linspace(0.0, float(total), points)
        b = start * (end / start) ** (p / total)
        return cls(tuple(p), tuple(trace_sigma / b), (float(trace_sigma),) * points, dims)

    @property
    def total(self) -> float:
        return float(self.progress[-1])

    @cached_property
    def _logs(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.asarray(self.progress, dtype=float), np.log(self.grad_sq),
                np.log(self.trace_sigma))

    def at(self, progress: float) -> Tuple[float, float]:
        """(|G|^2, tr(Sigma)) at this progress."""
        p, lg, ls = self._logs
        return math.exp(float(np.interp(progress, p, lg))), math.exp(float(np.interp(progress, p, ls)))

    def noise_scale(self, progress) -> np.ndarray:
        """The true B_noise at one or many progress values."""
        p, lg, ls = self._logs
        x = np.asarray(progress, dtype=float)
        return np.exp(np.interp(x, p, ls) - np.interp(x, p, lg))


def draw_estimate(rng: np.random.Generator, grad_sq: float, trace_sigma: float, batch: int,
                  replicas: int, dims: float) -> Tuple[float, float]:
    """One step's unbiased (|G|^2, tr(Sigma)) as the data-parallel estimator of
    ``hpcadapt.adapt.monitors`` computes them, for gradients g_i = G + xi_i with isotropic
    Gaussian noise xi_i ~ N(0, Sigma / b) in ``dims`` dimensions, n replicas of local batch
    b = B / n. Drawn exactly, in three variates rather than n gradients:
    (n |g|^2 - mean |g_i|^2) / (n - 1) = (|G| + z)^2 + s2/B chi2(D - 1) - T/B and
    B (mean |g_i|^2 - |g|^2) / (n - 1) = T = s2 chi2(D (n - 1)) / (n - 1), with s2 the
    per-dimension variance tr(Sigma)/D and z ~ N(0, s2/B) the noise along G. One worker:
    the monitor's two consecutive steps stand in for 2 replicas of batch B."""
    n = max(2, int(replicas))
    total = float(batch) * (n if replicas < 2 else 1)
    s2 = trace_sigma / dims
    z = rng.standard_normal() * math.sqrt(s2 / total)
    across = s2 / total * rng.chisquare(dims - 1)
    trace = s2 * rng.chisquare(dims * (n - 1)) / (n - 1)
    return (math.sqrt(grad_sq) + z) ** 2 + across - trace / total, trace


def exact_estimate(rng: np.random.Generator, grad_sq: float, trace_sigma: float, batch: int,
                   replicas: int, dims: float) -> Tuple[float, float]:
    """The true values, no sampling noise: the control that tells estimate noise apart from
    a policy's own behaviour."""
    return grad_sq, trace_sigma


# (rng, |G|^2, tr(Sigma), global batch, replicas, dims) -> one step's (|G|^2, tr(Sigma))
Estimator = Callable[[np.random.Generator, float, float, int, int, float], Tuple[float, float]]


# -- deciding as the engine does ---------------------------------------------------------------
def _decide(policies: Sequence[Policy], rule: LRRule, hook: str, snap: MetricsSnapshot,
            **extra: Any) -> List[Decision]:
    """``PolicyEngine.decide``: policies in order, each seeing the earlier ones' changes;
    skipped where a field it reads is not finite; then the rate rule on a batch change."""
    kept: List[Decision] = []
    pending: Dict[str, Any] = {}
    for policy in policies:
        if hook == "after_step" and snap.step % max(1, int(policy.interval)) != 0:
            continue
        if getattr(type(policy), hook) is getattr(Policy, hook):
            continue
        view = snap.with_changes(pending)
        if any(isinstance(getattr(view, n), float) and not math.isfinite(getattr(view, n))
               for n in policy.reads):
            continue
        d = getattr(policy, hook)(view, **extra)
        if d is None:
            continue
        d.validate()
        if not d.policy:
            d = replace(d, policy=policy.name)
        if d.changes():
            kept.append(d)
            pending.update(d.changes())
    new_batch = pending.get("batch_size")
    if new_batch is not None and new_batch != snap.batch_size and "lr" not in pending:
        d = rule.on_change(snap.with_changes(
            {k: v for k, v in pending.items() if k != "batch_size"}), new_batch)
        if d is not None:
            kept.append(d)
    elif hook == "after_step" and not pending:
        d = rule.on_monitor(snap)
        if d is not None:
            kept.append(d)
    return kept


@dataclass
class _Job:
    """The simulated job's configuration (mutable: the simulator's own state)."""

    batch: int
    workers: int
    lr: float
    base_lr: float
    base_batch: int
    ramp: Optional[Ramp] = None

    def lr_at(self, step: int) -> float:
        return self.ramp.lr_at(step) if self.ramp is not None else self.lr


def _apply(job: _Job, decisions: List[Decision], snap: MetricsSnapshot, ramp_steps: int) -> None:
    """The job applying ``PolicyEngine.plan``'s fields (the engine's own merge). Values are
    applied as asked (not clipped), so a policy that leaves its limits shows."""
    fields, _ = merge_decisions(decisions, snap, ramp_steps)
    new_batch = int(fields.get("batch_size", job.batch))
    if "lr" in fields:
        job.lr = job.base_lr = fields["lr"]
        job.base_batch, job.ramp = new_batch, None
    elif "ramp" in fields:
        job.ramp = Ramp(*fields["ramp"])
        job.lr = job.ramp.end_lr
    job.batch = new_batch
    job.workers = int(fields.get("world_size", job.workers))


# -- results -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimDecision:
    """One decision as applied: the step it came at, its policy, changes and reason."""

    step: int
    policy: str
    changes: Dict[str, Any]
    reason: str


@dataclass(frozen=True, eq=False)
class SimResult:
    """Per-step arrays (index i: step i + 1, the configuration that step ran with), the
    decisions, and the wall time spent in the policies (hooks, rule and ``on_decision``)
    at every boundary where they ran."""

    step: np.ndarray
    batch: np.ndarray
    workers: np.ndarray
    lr: np.ndarray
    samples: np.ndarray          # samples seen after the step
    progress: np.ndarray         # small-batch-equivalent samples after the step
    time_s: np.ndarray           # simulated seconds after the step
    noise_scale: np.ndarray      # the true B_noise during the step
    noise_scale_est: np.ndarray  # the smoothed estimate after the step (NaN before one)
    decisions: Tuple[SimDecision, ...]
    decide_step: np.ndarray
    decide_s: np.ndarray
    resizes: int
    limits: Dict[str, int] = field(default_factory=dict)

    @property
    def sim_time(self) -> float:
        return float(self.time_s[-1]) if len(self.time_s) else 0.0

    def summary(self) -> Dict[str, Any]:
        """The figures one run is judged by (JSON-ready)."""
        us = self.decide_s * 1e6
        return {"steps": int(len(self.step)), "final_batch": int(self.batch[-1]),
                "final_workers": int(self.workers[-1]), "final_lr": float(self.lr[-1]),
                "true_noise_scale_end": float(self.noise_scale[-1]),
                "decisions": len(self.decisions), "resizes": self.resizes,
                "batch_reversals": reversals(self.batch),
                "worker_reversals": reversals(self.workers),
                "samples": int(self.samples[-1]), "sim_time_s": self.sim_time,
                "decide_calls": int(len(us)),
                "decide_median_us": float(np.median(us)) if len(us) else float("nan"),
                "decide_max_us": float(np.max(us)) if len(us) else float("nan"),
                "decide_per_step_us": float(us.sum() / max(1, len(self.step)))}


def reversals(values: Sequence[float]) -> int:
    """Changes of direction of a series (up then down or down then up), plateaus ignored."""
    d = np.diff(np.asarray(values, dtype=float))
    s = np.sign(d[d != 0])
    return int(np.count_nonzero(s[1:] != s[:-1]))


# -- the simulation ----------------------------------------------------------------------------
def policies_from_flags(argv: Sequence[str]) -> Tuple[List[Policy], LRRule]:
    """The policies and the rate rule as the command line builds them (``--policy NAME``,
    ``--NAME-PARAM``, ``--lr-rule``, through the registry)."""
    parser = argparse.ArgumentParser(prog="simulate", add_help=False)
    add_policy_arguments(parser)
    args = parser.parse_args(list(argv))
    return build_policies(args), build_lr_rule(args)


def simulate(policies: Sequence[Policy], trajectory: NoiseTrajectory,
             throughput: ThroughputModel, *, workers_max: int, budget_samples: float,
             seed: int, start_batch: int, start_workers: int, workers_min: int = 1,
             lr_rule: Optional[LRRule] = None, base_lr: float = 0.1, can_resize: bool = True,
             ema: float = 0.1, window: float = 0.0, jitter: float = 0.02,
             estimator: Estimator = draw_estimate,
             max_steps: int = 1_000_000) -> SimResult:
    """Train until ``budget_samples`` of progress (small-batch-equivalent samples, see
    ``NoiseTrajectory``) are reached, deciding as the engine does.

    The monitor runs every g steps, g the gcd of the intervals of the policies that need it
    (as the job does); ``after_step`` runs where a policy's interval divides the step; a
    resize's ``on_resize`` runs at the next boundary, before ``after_step``; decisions apply
    from the next step. Step times carry a seeded log-normal jitter of ``jitter``;
    ``estimator`` draws each monitored step's statistics (``exact_estimate``: none of the
    sampling noise); ``ema`` and ``window`` are the monitor's (``--monitor-ema``,
    ``--monitor-window``). Same seed and fresh policies: the same run."""
    rng = np.random.default_rng(seed)
    rule = lr_rule or LRRule("none", 0)
    job = _Job(int(start_batch), int(start_workers), base_lr, base_lr, int(start_batch))
    smoother = GradientNoiseScale(ema, window)
    need = [max(1, int(p.interval)) for p in policies if p.requires]
    if rule.rule == "adascale":
        need.append(1)
    every = int(np.gcd.reduce(need)) if need else 0
    intervals = [max(1, int(p.interval)) for p in policies]
    log_rows: List[Tuple[float, ...]] = []
    decisions: List[SimDecision] = []
    decide_step: List[int] = []
    decide_s: List[float] = []
    queued: List[Dict[str, int]] = []
    samples = progress = clock = 0.0
    resizes = 0
    step = 0
    while progress < budget_samples:
        step += 1
        if step > max_steps:
            raise RuntimeError(f"simulate: {max_steps} steps without reaching the budget")
        batch, workers = job.batch, job.workers
        lr = job.lr_at(step)
        grad_sq, trace_sigma = trajectory.at(progress)
        b_noise = trace_sigma / grad_sq
        noise = math.exp(jitter * rng.standard_normal()) if jitter else 1.0
        compute = throughput.compute_time(batch, workers) * noise
        wait = throughput.allreduce_time(workers) * noise
        clock += compute + wait
        samples += batch
        progress += batch / (1.0 + batch / b_noise)
        monitored = bool(every) and step % every == 0
        if monitored:
            g, t = estimator(rng, grad_sq, trace_sigma, batch, workers, trajectory.dims)
            smoother.update(NoiseEstimate(g, t, t / batch), batch)
        due = any(step % i == 0 for i in intervals) or (rule.rule == "adascale" and monitored)
        if queued or due:
            lo, hi = smoother.interval()
            total = compute + wait
            snap = MetricsSnapshot(
                step=step, epoch=0, world_size=workers, batch_size=batch, lr=lr, momentum=0.9,
                base_lr=job.base_lr, base_batch_size=job.base_batch,
                samples_per_s=batch / total, monitored=monitored,
                noise_scale=smoother.noise_scale, grad_sq=smoother.grad_sq,
                trace_sigma=smoother.trace_sigma,
                grad_variance=smoother.trace_sigma / batch,
                grad_snr=smoother.grad_sq * batch / smoother.trace_sigma
                if smoother.trace_sigma > 0 else float("nan"),
                noise_scale_lo=lo, noise_scale_hi=hi, samples_seen=int(samples),
                step_time=(total,) * workers, compute_time=(compute,) * workers,
                wait_time=(wait,) * workers,
                rank_samples=(float(-(-batch // workers)),) * workers,
                max_workers=workers_max if can_resize else workers,
                min_workers=workers_min, can_resize=can_resize,
                max_local_batch=throughput.max_local_batch, cluster_version=resizes)
            started = time.perf_counter()
            made: List[Decision] = []
            hooks = [("on_resize", extra) for extra in queued] + ([("after_step", {})] if due
                                                                  else [])
            queued = []
            for hook, extra in hooks:
                out = _decide(policies, rule, hook, snap, **extra)
                if out:
                    _apply(job, out, snap, rule.ramp_steps)
                    for d in out:
                        for p in policies:
                            p.on_decision(d, snap)
                    made.extend(out)
                    snap = snap.with_changes({"batch_size": job.batch, "lr": job.lr})
            decide_s.append(time.perf_counter() - started)
            decide_step.append(step)
            decisions.extend(SimDecision(step, d.policy, d.changes(), d.reason) for d in made)
            if job.workers != workers:
                resizes += 1
                clock += throughput.resize_pause
                queued.append({"old_size": workers, "new_size": job.workers})
        log_rows.append((step, batch, workers, lr, samples, progress, clock, b_noise,
                         smoother.noise_scale))
    cols = np.asarray(log_rows, dtype=float).T if log_rows else np.zeros((9, 0))
    return SimResult(
        step=cols[0].astype(int), batch=cols[1].astype(int), workers=cols[2].astype(int),
        lr=cols[3], samples=cols[4], progress=cols[5], time_s=cols[6], noise_scale=cols[7],
        noise_scale_est=cols[8], decisions=tuple(decisions),
        decide_step=np.asarray(decide_step, dtype=int), decide_s=np.asarray(decide_s),
        resizes=resizes, limits={"workers_min": workers_min, "workers_max": workers_max})


# -- fixed configurations, for comparison ------------------------------------------------------
def fixed_time(trajectory: NoiseTrajectory, throughput: ThroughputModel, batch: int,
               workers: int, budget_samples: float, points: int = 4097) -> float:
    """Simulated seconds a fixed batch on fixed workers needs for the same progress: its
    steps, integral of (1 + B / B_noise(p)) / B dp, times its step time (no jitter)."""
    p = np.linspace(0.0, float(budget_samples), points)
    f = (1.0 + batch / trajectory.noise_scale(p)) / batch
    steps = float(np.sum((f[1:] + f[:-1]) * np.diff(p)) / 2)
    return steps * throughput.step_time(batch, workers)


def best_fixed(trajectory: NoiseTrajectory, throughput: ThroughputModel, *, batch_min: int,
               batch_max: int, workers_max: int, budget_samples: float, workers_min: int = 1
               ) -> Tuple[float, int, int]:
    """(seconds, batch, workers) of the fastest fixed configuration: batches and workers on
    powers of 2 (and the ends), at least one sample per worker. Hindsight no run has."""
    batches = sorted({batch_min, batch_max} | {2 ** i for i in range(40)
                                               if batch_min < 2 ** i < batch_max})
    workers = sorted({workers_min, workers_max} | {2 ** i for i in range(40)
                                                   if workers_min < 2 ** i < workers_max})
    best = (float("inf"), 0, 0)
    for b in batches:
        for w in workers:
            if w <= b:
                best = min(best, (fixed_time(trajectory, throughput, b, w, budget_samples), b, w))
    return best


# -- the runs the test and the benchmark share -------------------------------------------------
SCENARIOS = ("gns-batch", "goodput")


def run_scenario(policy: str, workers_max: int, *, budget_samples: float, seed: int = 0,
                 batch_max: int = 65_536, trajectory: Optional[NoiseTrajectory] = None,
                 throughput: Optional[ThroughputModel] = None,
                 estimator: Estimator = draw_estimate, ema: float = 0.1, window: float = 0.0
                 ) -> Tuple[SimResult, Dict[str, Any]]:
    """One policy at one scale, with its settings (returned beside the result).

    ``gns-batch`` adapts the batch only: it runs on ``workers_max`` workers from batch
    max(128, workers_max), between one sample per worker and ``batch_max``. ``goodput``
    picks workers and batch: it starts on workers_max / 8 workers (at least 1) at batch 128
    and may use 1 to ``workers_max`` workers and batches of 64 to ``batch_max``. Both
    follow the batch with the square-root rate rule over 8 steps."""
    if policy not in SCENARIOS:
        raise ValueError(f"run_scenario: policy {policy!r}; choose from {', '.join(SCENARIOS)}")
    trajectory = trajectory or NoiseTrajectory.rising(budget_samples)
    throughput = throughput or ThroughputModel()
    rate = ["--lr-rule", "sqrt", "--lr-ramp-steps", "8"]
    if policy == "gns-batch":
        start_workers = workers_max
        start_batch = max(128, workers_max)
        flags = ["--policy", "gns-batch", "--gns-batch-min", str(workers_max),
                 "--gns-batch-max", str(batch_max)] + rate
        can_resize, batch_min = False, workers_max
    else:
        start_workers = max(1, workers_max // 8)
        start_batch, batch_min = 128, 64
        flags = ["--policy", "goodput", "--goodput-min", str(batch_min), "--goodput-max",
                 str(batch_max), "--goodput-min-workers", "1"] + rate
        can_resize = True
    policies, rule = policies_from_flags(flags)
    result = simulate(policies, trajectory, throughput, workers_max=workers_max,
                      budget_samples=budget_samples, seed=seed, start_batch=start_batch,
                      start_workers=start_workers, lr_rule=rule, can_resize=can_resize,
                      estimator=estimator, ema=ema, window=window)
    settings = {"flags": flags, "start_batch": start_batch, "start_workers": start_workers,
                "batch_min": batch_min, "batch_max": batch_max,
                "workers_min": workers_max if policy == "gns-batch" else 1,
                "workers_max": workers_max}
    return result, settings
