"""The goodput model of Pollux (Qiao et al., OSDI'21) as AdaptDL's ``goodput.py`` keeps it: pure,
vectorised numpy functions, apart from the runtime and from the policy that uses them.

goodput(N, B) = throughput(N, B) x efficiency(B)

* Statistical efficiency of a global batch B against the base batch B0 is AdaScale's gain
  over the scale, E = r(S)/S with S = B/B0 and r = (s2 + m2)/(s2/S + m2), s2 = tr(Sigma)/B0,
  m2 = max(|G|^2, 0). Equivalently E = (B_noise + B0)/(B_noise + B) with the noise scale
  B_noise = tr(Sigma)/|G|^2: E(B0) = 1, and larger batches lose less as B_noise grows.
* Step time of N workers, each with a local batch m = ceil(B/N) put through k passes of
  forward/backward (gradient accumulation when m exceeds the memory cap, k = ceil(m/cap)):
  T_grad = alpha_c + beta_c * m/k (one pass), T_net = alpha_n + beta_n * max(N - 2, 0) for
  N >= 2 (0 for one worker), T = (k - 1) T_grad + (T_grad^g + T_net^g)^(1/g): the last pass
  overlaps the gradient exchange, g in [1, 10] from no overlap to nearly perfect.
  Throughput = B / T.

``fit_step_time`` fits the step-time parameters to measured configurations; a parameter the
measurements cannot determine gets AdaptDL's optimistic choice (see its docstring)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, Optional

import numpy as np

__all__ = ["StepTimeParams", "efficiency", "passes", "predict_step_time", "fit_step_time",
           "batch_grid", "evaluate", "GAMMAS"]

# Overlap exponents tried by the fit (a grid keeps the fit closed-form and vectorised).
GAMMAS = np.round(np.linspace(1.0, 10.0, 91), 6)
_GAMMA_PENALTY = 1e-3   # AdaptDL: prefer less overlap when the data cannot tell


@dataclass(frozen=True)
class StepTimeParams:
    """Fitted step-time model (seconds). ``compute_fitted``: two or more local batch sizes
    were measured (else alpha_c is the prior); ``network_fitted``: some measurement had
    two or more workers (else T_net = 0, an optimistic guess)."""

    alpha_c: float
    beta_c: float
    alpha_n: float
    beta_n: float
    gamma: float
    compute_fitted: bool = True
    network_fitted: bool = True

    def as_dict(self) -> Dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


def efficiency(batch, base_batch: float, grad_sq: float, trace_sigma: float) -> np.ndarray:
    """E = r(S)/S for global batch(es) ``batch``; NaN where the statistics say nothing
    (non-finite, or tr(Sigma) and |G|^2 both at or below zero)."""
    b = np.asarray(batch, dtype=float)
    if not (np.isfinite(grad_sq) and np.isfinite(trace_sigma)) or base_batch <= 0:
        return np.full(b.shape, np.nan)
    s2 = max(float(trace_sigma), 0.0) / base_batch
    m2 = max(float(grad_sq), 0.0)
    scale = b / base_batch
    if s2 + m2 <= 0:
        return np.full(b.shape, np.nan)
    return (s2 + m2) / (s2 + scale * m2)


def passes(local_batch, cap: Optional[int]) -> np.ndarray:
    """Forward/backward passes for a local batch under the memory cap (None: no cap)."""
    m = np.asarray(local_batch, dtype=float)
    if cap is None:
        return np.ones(m.shape)
    return np.maximum(1.0, np.ceil(m / cap))


def predict_step_time(p: StepTimeParams, workers, local_batch, n_passes=1) -> np.ndarray:
    """T for arrays (broadcast together) of workers, local batches and passes."""
    n = np.asarray(workers, dtype=float)
    k = np.asarray(n_passes, dtype=float)
    t_grad = p.alpha_c + p.beta_c * np.asarray(local_batch, dtype=float) / k
    t_net = np.where(n > 1, p.alpha_n + p.beta_n * np.maximum(n - 2, 0), 0.0)
    g = p.gamma
    return (k - 1) * t_grad + (t_grad ** g + t_net ** g) ** (1.0 / g)


def _line(x: np.ndarray, y: np.ndarray, w: np.ndarray):
    """Weighted least squares y = a + b x with a, b >= 0, over the last axis (x is shared,
    y and w may carry leading axes). One distinct x: b = 0."""
    s0, s1, s2 = w.sum(-1), (w * x).sum(-1), (w * x * x).sum(-1)
    t0, t1 = (w * y).sum(-1), (w * x * y).sum(-1)
    det = s0 * s2 - s1 * s1
    flat = np.abs(det) <= 1e-12 * np.maximum(s0 * s2, 1e-300)
    safe = np.where(flat, 1.0, det)
    b = np.where(flat, 0.0, (s0 * t1 - s1 * t0) / safe)
    a = np.where(flat, t0 / s0, (t0 - b * s1) / s0)
    # Clip to the non-negative quadrant, refitting the other parameter alone.
    neg_a = a < 0
    a, b = np.where(neg_a, 0.0, a), np.where(neg_a, t1 / np.maximum(s2, 1e-300), b)
    neg_b = b < 0
    a, b = np.where(neg_b, t0 / s0, a), np.where(neg_b, 0.0, b)
    return np.maximum(a, 0.0), np.maximum(b, 0.0)


def fit_step_time(workers, local_batch, n_passes, compute_time, step_time) -> StepTimeParams:
    """Fit the step-time model to one row per measured configuration.

    ``compute_time``: the local part of a step (all passes; step time less the wait for the
    gradient exchange); ``step_time``: the whole step. Compute is fitted per pass, with
    relative weights, so small and large configurations count alike. Then, for every overlap
    exponent g in ``GAMMAS``, the network time each multi-worker row implies is fitted by a
    line in max(N - 2, 0) and the g with the smallest log error of the predicted step times
    (plus a small pull towards g = 1) is kept.

    Too few measurements to determine a parameter (AdaptDL's choices, optimistic about
    what has not been tried): one local batch size fixes alpha_c at half the per-pass time,
    so the rest scales with the batch; no multi-worker row gives T_net = 0; one worker
    count gives beta_n = 0. Raises ValueError on empty, mismatched or non-positive input."""
    n = np.asarray(workers, dtype=float)
    m = np.asarray(local_batch, dtype=float)
    k = np.asarray(n_passes, dtype=float)
    tc = np.asarray(compute_time, dtype=float)
    ts = np.asarray(step_time, dtype=float)
    if not (n.shape == m.shape == k.shape == tc.shape == ts.shape) or n.ndim != 1 or not n.size:
        raise ValueError(f"fit_step_time needs equal-length 1-D arrays with at least one row, "
                         f"got shapes {[a.shape for a in (n, m, k, tc, ts)]}")
    if not (np.all(np.isfinite([n, m, k, tc, ts])) and np.all(n >= 1) and np.all(m >= 1)
            and np.all(k >= 1) and np.all(tc > 0) and np.all(ts > 0)):
        raise ValueError("fit_step_time needs finite inputs, workers/local batch/passes >= 1 "
                         "and positive times")
    micro = m / k
    per_pass = tc / k
    compute_fitted = np.unique(micro).size >= 2
    if compute_fitted:
        alpha_c, beta_c = _line(micro, per_pass, 1.0 / per_pass ** 2)
        alpha_c, beta_c = float(alpha_c), float(beta_c)
    else:
        alpha_c = float(per_pass.mean() / 2)
        beta_c = float(alpha_c / micro[0])
    t_grad = alpha_c + beta_c * micro
    multi = n > 1
    if not multi.any():
        return StepTimeParams(alpha_c, beta_c, 0.0, 0.0, 1.0, compute_fitted, False)
    # The exchange overlaps the last pass: its phase lasts the step less the earlier passes.
    phase = np.maximum(ts - (k - 1) * per_pass, per_pass)
    g = GAMMAS[:, None]
    implied = np.maximum(phase ** g - per_pass ** g, 0.0) ** (1.0 / g)      # (gammas, rows)
    x = np.maximum(n - 2, 0)[multi]
    y = implied[:, multi]
    alpha_n, beta_n = _line(x, y, 1.0 / np.maximum(phase[multi], 1e-12) ** 2)
    t_net = np.where(multi, alpha_n[:, None] + beta_n[:, None] * np.maximum(n - 2, 0), 0.0)
    pred = (k - 1) * t_grad + (t_grad ** g + t_net ** g) ** (1.0 / g)
    err = np.sqrt(np.mean(np.log(pred / ts) ** 2, axis=1))
    err = err + _GAMMA_PENALTY * (GAMMAS - 1.0) ** 2
    i = int(np.argmin(err))
    return StepTimeParams(alpha_c, beta_c, float(alpha_n[i]), float(beta_n[i]),
                          float(GAMMAS[i]), compute_fitted, True)


def batch_grid(low: int, high: int) -> np.ndarray:
    """Candidate global batches: the powers of 2 strictly between ``low`` and ``high``,
    and both ends."""
    if low < 1 or high < low:
        raise ValueError(f"batch_grid needs 1 <= low <= high, got {low}, {high}")
    powers = 2 ** np.arange(int(np.ceil(np.log2(low))), int(np.floor(np.log2(high))) + 1)
    return np.unique(np.concatenate([[low], powers[(powers > low) & (powers < high)], [high]])
                     ).astype(int)


def evaluate(p: StepTimeParams, workers, batch, *, cap: Optional[int], base_batch: float,
             grad_sq: float, trace_sigma: float) -> Dict[str, np.ndarray]:
    """Goodput of every (workers, batch) pair (arrays broadcast together): a dict of arrays
    ``goodput``, ``throughput`` (samples/s), ``efficiency``, ``step_time``, ``local_batch``
    and ``passes``. A pair with fewer samples than workers gets goodput 0."""
    n = np.asarray(workers, dtype=float)
    b = np.asarray(batch, dtype=float)
    n, b = np.broadcast_arrays(n, b)
    local = np.ceil(b / n)
    k = passes(local, cap)
    t = predict_step_time(p, n, local, k)
    throughput = b / t
    eff = efficiency(b, base_batch, grad_sq, trace_sigma)
    good = np.where(b >= n, throughput * eff, 0.0)
    return {"goodput": good, "throughput": throughput, "efficiency": eff, "step_time": t,
            "local_batch": local, "passes": k}
