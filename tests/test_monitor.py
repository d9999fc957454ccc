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
from hpcadapt.monitor import (GradientNoiseScale, MonitorConfig, NoiseEstimate,
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
        gns.update(estimate_from_consecutive([now], [prev], 32))
        prev = now
    assert gns.noise_scale == pytest.approx(want, rel=0.15)


def test_variance_is_the_spread_of_replica_gradients():
    gs = [np.array([1.0, 0.0]), np.array([3.0, 2.0])]
    mean_local = float(np.mean([g @ g for g in gs]))
    avg = np.mean(gs, axis=0)
    est = estimate_from_replicas(mean_local, float(avg @ avg), 2, 8)
    assert est.variance == pytest.approx(np.mean([(g - avg) @ (g - avg) for g in gs]))


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
