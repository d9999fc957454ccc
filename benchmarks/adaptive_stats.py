"""Statistics of the ``adaptive`` benchmark (pure; numpy only, no scipy).

* ``crossing``: where a validation-loss curve first reaches a target, by linear
  interpolation between the two evaluations around it, on any axis (steps, samples,
  modelled seconds, wall seconds); None when it never does (censored).
* ``paired_ratio``: per-seed log-ratios of two methods' values, their geometric mean and
  95% t-interval, and the win flag (upper bound below 1), with censored pairs handled as
  written there (pairs where neither run reached the target are left out and counted).
* ``paired_delta``: mean difference with a 95% t-interval (final losses).
* ``loss_at`` / ``final_loss_at_equal_samples``: the loss at a sample count, interpolated.
* ``fit_cost_model`` / ``cumulative_cost``: per-step cost c0 + c1 * batch, fitted by least
  squares to the median measured step time at each batch size (weighted by its steps);
  modelled time is the sum of that cost over a run's steps."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["T975", "t_quantile_975", "crossing_index", "crossing", "crossings",
           "paired_ratio", "paired_delta", "mean_ci", "loss_at",
           "final_loss_at_equal_samples", "fit_cost_model", "cumulative_cost",
           "geomean_score", "TooFewSeeds"]

# Two-sided 95% quantiles of Student's t (t_{0.975, df}) for df = 1..30; above 30 the
# Cornish-Fisher expansion below agrees with the tables to 1e-4.
T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
        2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
        2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)
_Z975 = 1.959963984540054


class TooFewSeeds(ValueError):
    """A paired comparison needs at least 2 seeds (an interval needs a spread)."""


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}: the half-width factor of a two-sided 95% interval."""
    if df < 1:
        raise TooFewSeeds(f"a t-interval needs at least 2 values (df >= 1), got df={df}")
    if df <= len(T975):
        return T975[df - 1]
    z = _Z975
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def crossing_index(losses: Sequence[float], target: float) -> Optional[Tuple[int, float]]:
    """(i, frac): the curve first reaches ``target`` between evaluation i-1 and i, a fraction
    ``frac`` of the way (frac 1.0 at i itself; (0, 1.0) when the first evaluation is at or
    below the target: nothing is known before it). None: never (a NaN never reaches)."""
    for i, loss in enumerate(losses):
        if loss <= target:   # False for NaN
            if i == 0:
                return 0, 1.0
            prev = losses[i - 1]
            return i, (prev - target) / (prev - loss)
    return None


def _at(xs: Sequence[float], where: Tuple[int, float]) -> float:
    i, frac = where
    if i == 0:
        return float(xs[0])
    return float(xs[i - 1] + frac * (xs[i] - xs[i - 1]))


def crossing(xs: Sequence[float], losses: Sequence[float], target: float) -> Optional[float]:
    """The x (step, sample count, seconds) at which ``losses`` (evaluated at ``xs``, in
    order) first reach ``target``, interpolated linearly; None when never (censored)."""
    if len(xs) != len(losses):
        raise ValueError(f"{len(xs)} x values for {len(losses)} losses")
    where = crossing_index(losses, target)
    return None if where is None else _at(xs, where)


def crossings(axes: Dict[str, Sequence[float]], losses: Sequence[float],
              target: float) -> Dict[str, Optional[float]]:
    """``crossing`` on several axes at once (the same interpolation fraction on each)."""
    where = crossing_index(losses, target)
    return {k: (None if where is None else _at(xs, where)) for k, xs in axes.items()}


def mean_ci(values: Sequence[float]) -> Tuple[float, float, float]:
    """(mean, lower, upper): the 95% t-interval of the mean; refuses fewer than 2 values."""
    v = np.asarray(values, dtype=float)
    if v.size < 2:
        raise TooFewSeeds(f"a 95% interval needs at least 2 seeds, got {v.size}")
    mean = float(v.mean())
    half = t_quantile_975(v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return mean, mean - half, mean + half


Value = Tuple[Optional[float], float]   # (crossing or None when censored, the run's own end)


def paired_ratio(adaptive: Sequence[Value], baseline: Sequence[Value]) -> dict:
    """Per-seed ratios adaptive / baseline (lists in seed order, each ``(value, end)``:
    value None when the run never reached the target, ``end`` the run's last value on that
    axis, its total steps, samples or seconds). Geometric mean and its 95% t-interval over
    the per-seed log-ratios of the informative pairs.

    Censored pairs (the target not reached within the budget), handled explicitly and
    conservatively for the adaptive method:

    * baseline censored, adaptive reached: the baseline's value is replaced by its end, a
      lower bound on its true crossing, so the pair's ratio is an upper bound (the adaptive
      method's advantage is understated);
    * adaptive censored, baseline reached: the adaptive value is replaced by its end, so
      the ratio is a lower bound, and NO win can be claimed (``win`` False whatever the
      interval says);
    * both censored: the pair says nothing about which is faster, so it is left out: not in
      ``n``, its log-ratio None, counted in ``both_censored``; no win is claimed while there
      is one (the adaptive method missed the target on that seed too).

    ``bound`` says how the reported ratio relates to the true one: "exact" (no censoring in
    the pairs used), "upper" (only baselines censored: the truth is at most this), "lower"
    (only the adaptive censored: the truth is at least this), "mixed". Raises TooFewSeeds
    below 2 pairs; returns ratio None when no pair is informative, and no interval (ci None,
    no win) when only one is."""
    if len(adaptive) != len(baseline):
        raise ValueError(f"{len(adaptive)} adaptive values for {len(baseline)} baseline values")
    if len(adaptive) < 2:
        raise TooFewSeeds(f"a paired comparison needs at least 2 seeds, got {len(adaptive)}")
    logs: List[Optional[float]] = []
    cens = {"adaptive": 0, "baseline": 0}
    for (a, a_end), (b, b_end) in zip(adaptive, baseline):
        if a is None and b is None:
            logs.append(None)
            continue
        if a is None:
            cens["adaptive"] += 1
            a = a_end
        elif b is None:
            cens["baseline"] += 1
            b = b_end
        logs.append(math.log(max(a, 1e-12) / max(b, 1e-12)))
    used = [x for x in logs if x is not None]
    both = len(logs) - len(used)
    out = {"n": len(used), "log_ratios": logs, "censored": cens, "both_censored": both}
    if cens["adaptive"] and cens["baseline"]:
        bound = "mixed"
    elif cens["adaptive"]:
        bound = "lower"
    elif cens["baseline"]:
        bound = "upper"
    else:
        bound = "exact"
    if not used:
        return dict(out, ratio=None, ci_lo=None, ci_hi=None, win=False, bound="none",
                    note="no run reached the target: nothing to compare")
    if len(used) == 1:
        return dict(out, ratio=math.exp(used[0]), ci_lo=None, ci_hi=None, win=False,
                    bound=bound, note="one informative pair: no interval")
    mean, lo, hi = mean_ci(used)
    return dict(out, ratio=math.exp(mean), ci_lo=math.exp(lo), ci_hi=math.exp(hi),
                win=bool(math.exp(hi) < 1.0 and cens["adaptive"] == 0 and both == 0),
                bound=bound)


def paired_delta(adaptive: Sequence[float], baseline: Sequence[float]) -> dict:
    """Mean of adaptive - baseline over seeds with its 95% t-interval (finite pairs only;
    a NaN loss, a diverged run, is counted in ``nonfinite`` and makes ``delta`` None)."""
    if len(adaptive) != len(baseline):
        raise ValueError(f"{len(adaptive)} adaptive values for {len(baseline)} baseline values")
    if len(adaptive) < 2:
        raise TooFewSeeds(f"a paired comparison needs at least 2 seeds, got {len(adaptive)}")
    diffs = [a - b for a, b in zip(adaptive, baseline)]
    bad = sum(1 for d in diffs if not math.isfinite(d))
    if bad:
        return {"n": len(diffs), "diffs": diffs, "nonfinite": bad, "delta": None,
                "ci_lo": None, "ci_hi": None}
    mean, lo, hi = mean_ci(diffs)
    return {"n": len(diffs), "diffs": diffs, "nonfinite": 0, "delta": mean, "ci_lo": lo,
            "ci_hi": hi}


def loss_at(samples: Sequence[float], losses: Sequence[float], at: float) -> float:
    """The loss at sample count ``at``, linear between evaluations (the first evaluation's
    loss before it, the last one's after it)."""
    if not len(samples):
        return float("nan")
    return float(np.interp(at, np.asarray(samples, float), np.asarray(losses, float)))


def final_loss_at_equal_samples(a: Tuple[Sequence[float], Sequence[float]],
                                b: Tuple[Sequence[float], Sequence[float]]
                                ) -> Tuple[float, float, float]:
    """(loss of a, loss of b, S): both runs' losses at S, the smaller of their last
    evaluations' sample counts (runs with other batch schedules end a few samples apart)."""
    s = min(float(a[0][-1]), float(b[0][-1]))
    return loss_at(a[0], a[1], s), loss_at(b[0], b[1], s), s


def fit_cost_model(batches: Sequence[int], times: Sequence[float]) -> Dict[str, float]:
    """Per-step cost c0 + c1 * batch (seconds), least squares over the MEDIAN measured step
    time at each distinct batch size, each weighted by its number of steps (medians: one
    load spike does not move the fit; weights: a batch an adaptive run held for 6 steps
    counts less than one a fixed run held for 3,000). One batch size only: c0 = 0. A
    negative coefficient is clipped to 0 and the other refitted."""
    b = np.asarray(batches, dtype=float)
    t = np.asarray(times, dtype=float)
    ok = np.isfinite(t) & (t > 0) & (b > 0)
    b, t = b[ok], t[ok]
    if b.size == 0:
        raise ValueError("no measured steps to fit the cost model to")
    sizes = np.unique(b)
    med = np.array([np.median(t[b == s]) for s in sizes])
    count = np.array([np.sum(b == s) for s in sizes], dtype=float)
    if sizes.size == 1:
        c0, c1 = 0.0, float(med[0] / sizes[0])
    else:
        # each median's squared residual weighs as many steps as it summarises
        c1, c0 = (float(x) for x in np.polyfit(sizes, med, 1, w=np.sqrt(count)))
        if c1 < 0:
            c0, c1 = float(np.average(med, weights=count)), 0.0
        elif c0 < 0:
            c0, c1 = 0.0, float((count * sizes * med).sum() / (count * sizes * sizes).sum())
    return {"c0_s": c0, "c1_s_per_sample": c1, "batch_sizes": [int(s) for s in sizes],
            "median_step_s": [float(m) for m in med]}


def cumulative_cost(step_batches: Sequence[int], model: Dict[str, float]) -> np.ndarray:
    """Modelled seconds after each step: element k is the cost of steps 1..k (element 0 is
    0), so a run's modelled time at step s is ``cumulative_cost(...)[s]``."""
    cost = model["c0_s"] + model["c1_s_per_sample"] * np.asarray(step_batches, dtype=float)
    return np.concatenate([[0.0], np.cumsum(cost)])


def geomean_score(values: Sequence[Optional[float]]) -> float:
    """A configuration's score over tuning seeds: the geometric mean; inf when any seed never
    reached the target (such a configuration ranks behind every one that always did)."""
    if not values or any(v is None for v in values):
        return math.inf
    return float(math.exp(np.mean([math.log(max(v, 1e-12)) for v in values])))
