"""The noise-scale estimators against linear regression, where the answer is known.

Model y = w*.x + e, x ~ N(0, I_d), e ~ N(0, s^2), loss 0.5 (w.x - y)^2, evaluated at
w = w* + delta. The true gradient is G = delta, and the per-sample gradient
(delta.x - e) x has tr(Sigma) = (d + 1)|delta|^2 + s^2 d, so
B_noise = ((d + 1)|delta|^2 + s^2 d) / |delta|^2."""

import math

import numpy as np
import pytest
import torch

from hpcadapt import ConfigurationError
from hpcadapt.loop.monitor import (GradientNoiseScale, MonitorConfig, NoiseEstimate,
                              estimate_from_consecutive, estimate_from_replicas)

D, SIGMA = 20, 2.0


def closed_form(delta):
    d2 = float(delta @ delta)
    return ((D + 1) * d2 + SIGMA ** 2 * D) / d2, d2, (D + 1) * d2 + SIGMA ** 2 * D


def batch_gradient(rng, delta, b):
    x = rng.standard_normal((b, D))
    e = rng.normal(0, SIGMA, b)
    r = x @ delta - e
    return (r[:, None] * x).mean(axis=0)


@pytest.mark.parametrize("n,b", [(2, 16), (4, 8), (8, 32)])
def test_replica_estimator_recovers_the_closed_form(n, b):
    rng = np.random.default_rng(0)
    delta = rng.standard_normal(D) * 0.5
    want, want_g, want_s = closed_form(delta)
    gns = GradientNoiseScale(ema=0.01)
    for _ in range(3000):
        gs = [batch_gradient(rng, delta, b) for _ in range(n)]
        mean_local = float(np.mean([g @ g for g in gs]))
        avg = np.mean(gs, axis=0)
        gns.update(estimate_from_replicas(mean_local, float(avg @ avg), n, n * b))
    assert gns.grad_sq == pytest.approx(want_g, rel=0.15)
    assert gns.trace_sigma == pytest.approx(want_s, rel=0.1)
    assert gns.noise_scale == pytest.approx(want, rel=0.15)


def test_consecutive_estimator_for_one_replica():
    rng = np.random.default_rng(1)
    delta = rng.standard_normal(D) * 0.5
    want, _, _ = closed_form(delta)
    gns = GradientNoiseScale(ema=0.01)
    prev = torch.from_numpy(batch_gradient(rng, delta, 32))
    for _ in range(3000):
        now = torch.from_numpy(batch_gradient(rng, delta, 32))
        gns.update(estimate_from_consecutive([now], [prev], 32, 32))
        prev = now
    assert gns.noise_scale == pytest.approx(want, rel=0.15)


def test_variance_is_the_batch_gradients_noise_at_every_world_size():
    """grad_variance means tr(Sigma)/B (per global batch) whatever the world size."""
    rng = np.random.default_rng(3)
    delta = rng.standard_normal(D) * 0.5
    _, _, want_s = closed_form(delta)
    for n in (2, 4):
        b = 64 // n
        vs = []
        for _ in range(4000):
            gs = [batch_gradient(rng, delta, b) for _ in range(n)]
            avg = np.mean(gs, axis=0)
            est = estimate_from_replicas(float(np.mean([g @ g for g in gs])), float(avg @ avg),
                                         n, 64)
            vs.append(est.variance)
        assert np.mean(vs) == pytest.approx(want_s / 64, rel=0.05), n


def _weighted_step(rng, delta, shares):
    """What the optimizer computes from one step: sum_i w_i |g_i|^2 and |sum_i w_i g_i|^2,
    with w_i = b_i / B; a rank with an empty share contributes nothing."""
    total = sum(shares)
    gs = [batch_gradient(rng, delta, b) if b else np.zeros(D) for b in shares]
    ws = [b / total for b in shares]
    avg = sum(w * g for w, g in zip(ws, gs))
    return sum(w * float(g @ g) for w, g in zip(ws, gs)), float(avg @ avg), total


@pytest.mark.parametrize("shares", [(16, 16), (9, 8, 8, 7), (20, 12, 0, 0), (40, 24), (3, 1)])
def test_replica_estimator_is_unbiased_with_unequal_and_empty_shares(shares):
    """Unequal shares (a batch not divisible by the world size) and empty ones (the short
    last batch of an epoch): within 4% of the closed form, averaged over 20,000 steps."""
    rng = np.random.default_rng(4)
    delta = rng.standard_normal(D) * 0.5
    _, want_g, want_s = closed_form(delta)
    replicas = sum(1 for b in shares if b)
    gs_, ss_ = [], []
    for _ in range(20000):
        m, g, total = _weighted_step(rng, delta, shares)
        est = estimate_from_replicas(m, g, replicas, total)
        gs_.append(est.grad_sq)
        ss_.append(est.trace_sigma)
    assert np.mean(ss_) == pytest.approx(want_s, rel=0.04)
    # |G|^2 is estimated beside a noise of tr(S)/B per step: its tolerance scales with that.
    assert abs(np.mean(gs_) - want_g) < 0.04 * want_g + 0.04 * want_s / sum(shares)


def test_consecutive_estimator_is_unbiased_when_the_batch_changes():
    """B alternates 64, 30, 64, 30 (a short last batch, a policy's change): the two-step
    tr(Sigma) divides |g_t - g_t-1|^2 by (1/B_t + 1/B_t-1), within 3% of the closed form."""
    rng = np.random.default_rng(5)
    delta = rng.standard_normal(D) * 0.5
    _, want_g, want_s = closed_form(delta)
    batches = [64, 30] * 10000
    prev = torch.from_numpy(batch_gradient(rng, delta, batches[0]))
    traces, sqs = [], []
    for b_prev, b in zip(batches, batches[1:]):
        now = torch.from_numpy(batch_gradient(rng, delta, b))
        est = estimate_from_consecutive([now], [prev], b, b_prev)
        traces.append(est.trace_sigma)
        sqs.append(est.grad_sq)
        prev = now
    assert np.mean(traces) == pytest.approx(want_s, rel=0.03)
    assert np.mean(sqs) == pytest.approx(want_g, rel=0.1)


def test_smoothing_scales_with_the_batch():
    """A step of twice the first batch counts as two steps of it."""
    a, b = GradientNoiseScale(ema=0.1), GradientNoiseScale(ema=0.1)
    a.update(NoiseEstimate(1.0, 10.0, 0.0), 32)
    b.update(NoiseEstimate(1.0, 10.0, 0.0), 32)
    a.update(NoiseEstimate(3.0, 30.0, 0.0), 64)
    b.update(NoiseEstimate(3.0, 30.0, 0.0), 32)
    b.update(NoiseEstimate(3.0, 30.0, 0.0), 32)
    assert a.grad_sq == pytest.approx(b.grad_sq) and a.trace_sigma == pytest.approx(b.trace_sigma)


def test_non_finite_estimates_are_skipped():
    gns = GradientNoiseScale()
    assert gns.update(NoiseEstimate(1.0, 10.0, 0.0))
    assert not gns.update(NoiseEstimate(float("nan"), 1.0, 0.0))
    assert not gns.update(NoiseEstimate(1.0, float("inf"), 0.0))
    assert gns.skipped == 2 and gns.noise_scale == pytest.approx(10.0)


def test_noise_scale_undefined_until_signal_is_positive():
    gns = GradientNoiseScale()
    assert math.isnan(gns.noise_scale)
    gns.update(NoiseEstimate(-1.0, 5.0, 0.0))
    assert math.isnan(gns.noise_scale)


def test_state_round_trip():
    a = GradientNoiseScale(0.2)
    a.update(NoiseEstimate(2.0, 30.0, 1.0))
    b = GradientNoiseScale()
    b.load_state_dict(a.state_dict())
    assert b.noise_scale == a.noise_scale


@pytest.mark.parametrize("kwargs,match", [
    (dict(monitors=("gnss",)), "unknown monitor"),
    (dict(interval=0), "monitor-interval"),
    (dict(ema=0.0), "monitor-ema"),
])
def test_bad_monitor_config(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        MonitorConfig(**kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("ranks,batch", [(1, 32), (2, 32), (4, 30)])
def test_the_job_measures_the_closed_form_through_its_data_path(tmp_path, ranks, batch):
    """The whole path (gradient hooks, buckets, the control reduction, the pairing of g_t
    with g_t-1 at one rank) at 1, 2 and 4 ranks, unequal shares at 4 (30 = 8+8+7+7), a
    monitoring interval of 5 and a short last batch each epoch: the smoothed estimates end
    within 20% of the closed form (about 200 estimates, --monitor-ema 0.02)."""
    import json

    from conftest import ROOT, run_mpi

    metrics = tmp_path / "m.jsonl"
    proc = run_mpi(ranks, [str(ROOT / "tests" / "scripts" / "linreg_gns.py"), "--batch-size",
                           str(batch), "--monitor", "gns", "--monitor-interval", "5",
                           "--monitor-ema", "0.02", "--no-progress", "--metrics-file",
                           str(metrics)], timeout=600)
    want = next(json.loads(l) for l in proc.stdout.splitlines()
                if l.startswith('{"closed_form"'))["closed_form"]
    rows = [json.loads(l) for l in metrics.read_text().splitlines()]
    monitored = [r for r in rows if r["event"] == "step" and "noise_scale" in r["monitors"]]
    assert len(monitored) >= 150
    last = monitored[-1]["monitors"]
    for key in ("grad_sq", "trace_sigma", "noise_scale"):
        assert last[key] == pytest.approx(want[key], rel=0.2), (key, last[key], want[key])
    assert last["grad_variance"] == pytest.approx(last["trace_sigma"] / batch, rel=1e-6)
