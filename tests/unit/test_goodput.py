"""The goodput model (pure functions on synthetic data), the goodput policy on synthetic
snapshots, and one real run on 2 MPI ranks."""

import json
import logging
import math

import numpy as np
import pytest

from hpcadapt import ConfigurationError
from hpcadapt.adapt.engine import PolicyEngine
from hpcadapt.policies import Goodput, LRRule, MetricsSnapshot, build_policies
from hpcadapt.policies import goodput_model as gm
from hpcadapt.train import build_parser

from conftest import run_mpi

TRUE = gm.StepTimeParams(alpha_c=0.002, beta_c=1e-4, alpha_n=0.003, beta_n=0.001, gamma=2.0)


def measured(p, workers, local, passes):
    """(compute, step) as the runtime reports them for configurations under model ``p``."""
    workers, local, passes = (np.asarray(x, dtype=float) for x in (workers, local, passes))
    compute = passes * (p.alpha_c + p.beta_c * local / passes)
    return compute, gm.predict_step_time(p, workers, local, passes)


# -- efficiency ------------------------------------------------------------------------------
def test_efficiency_is_one_at_the_base_batch_and_matches_the_noise_scale_form():
    b0, g2, tr = 32, 0.5, 200.0      # noise scale 400
    e = gm.efficiency([32, 64, 128, 1024], b0, g2, tr)
    assert e[0] == pytest.approx(1.0)
    noise = tr / g2
    assert e == pytest.approx((noise + b0) / (noise + np.array([32, 64, 128, 1024])))
    assert np.all(np.diff(e) < 0)
    # AdaScale's gain over the scale, from lr_rules' form.
    s = np.array([1, 2, 4, 32])
    s2 = tr / b0
    assert e == pytest.approx((s2 + g2) / (s2 / s + g2) / s)


def test_efficiency_without_signal_counts_every_sample_and_nan_without_statistics():
    assert gm.efficiency([16, 256], 16, -0.1, 5.0) == pytest.approx([1.0, 1.0])   # |G|^2 clipped
    assert np.all(np.isnan(gm.efficiency([16, 32], 16, float("nan"), 5.0)))
    assert np.all(np.isnan(gm.efficiency([16, 32], 16, 1.0, float("inf"))))
    assert np.all(np.isnan(gm.efficiency([16, 32], 16, 0.0, 0.0)))


# -- step-time model and its fit -----------------------------------------------------------
def test_fit_recovers_known_parameters():
    n = np.array([1, 1, 2, 2, 2, 4, 4, 4, 3])
    m = np.array([16, 64, 16, 64, 256, 32, 128, 512, 100])
    k = np.array([1, 1, 1, 1, 2, 1, 1, 4, 1])
    compute, step = measured(TRUE, n, m, k)
    fit = gm.fit_step_time(n, m, k, compute, step)
    assert fit.compute_fitted and fit.network_fitted
    for name in ("alpha_c", "beta_c", "alpha_n", "beta_n", "gamma"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name


def test_fit_tolerates_measurement_noise():
    rng = np.random.default_rng(0)
    n = np.repeat([1, 2, 4], 4)
    m = np.tile([16, 32, 64, 128], 3)
    k = np.ones_like(n)
    compute, step = measured(TRUE, n, m, k)
    noisy = rng.normal(1.0, 0.02, size=(2, n.size))
    fit = gm.fit_step_time(n, m, k, compute * noisy[0], step * noisy[1])
    pred = gm.predict_step_time(fit, [2, 4], [512, 512])
    true = gm.predict_step_time(TRUE, [2, 4], [512, 512])
    assert pred == pytest.approx(true, rel=0.1)


def test_fit_with_one_configuration_uses_the_optimistic_priors():
    compute, step = measured(TRUE, [2], [32], [1])
    fit = gm.fit_step_time([2], [32], [1], compute, step)
    assert not fit.compute_fitted and fit.network_fitted
    per_pass = TRUE.alpha_c + TRUE.beta_c * 32
    assert fit.alpha_c == pytest.approx(per_pass / 2)
    assert fit.beta_c * 32 == pytest.approx(per_pass / 2)
    assert fit.beta_n == 0.0 and fit.gamma == 1.0
    # The fitted model reproduces the one measurement.
    assert gm.predict_step_time(fit, 2, 32) == pytest.approx(step[0])
    single = gm.fit_step_time([1, 1], [16, 64], [1, 1], *measured(TRUE, [1, 1], [16, 64], [1, 1]))
    assert single.compute_fitted and not single.network_fitted and single.alpha_n == 0.0


@pytest.mark.parametrize("bad", [
    dict(workers=[], local_batch=[], n_passes=[], compute_time=[], step_time=[]),
    dict(workers=[1, 2], local_batch=[8], n_passes=[1], compute_time=[1.0], step_time=[1.0]),
    dict(workers=[1], local_batch=[8], n_passes=[1], compute_time=[0.0], step_time=[1.0]),
    dict(workers=[1], local_batch=[8], n_passes=[1], compute_time=[float("nan")],
         step_time=[1.0]),
])
def test_fit_refuses_bad_input(bad):
    with pytest.raises(ValueError, match="fit_step_time"):
        gm.fit_step_time(**bad)


def test_accumulation_charges_extra_passes():
    assert list(gm.passes([32, 64, 65, 256], 64)) == [1, 1, 2, 4]
    assert list(gm.passes([32, 1000], None)) == [1, 1]
    capped = gm.evaluate(TRUE, 2, 512, cap=64, base_batch=32, grad_sq=1.0, trace_sigma=1.0)
    free = gm.evaluate(TRUE, 2, 512, cap=None, base_batch=32, grad_sq=1.0, trace_sigma=1.0)
    assert capped["passes"] == 4 and free["passes"] == 1
    assert capped["step_time"] > free["step_time"]   # alpha_c paid four times


def test_batch_grid():
    assert list(gm.batch_grid(16, 1024)) == [16, 32, 64, 128, 256, 512, 1024]
    assert list(gm.batch_grid(20, 100)) == [20, 32, 64, 100]
    assert list(gm.batch_grid(64, 64)) == [64]
    with pytest.raises(ValueError):
        gm.batch_grid(64, 32)


def test_argmax_moves_to_larger_batches_as_the_noise_scale_grows():
    batches = gm.batch_grid(16, 4096)
    best = []
    for noise in (10.0, 100.0, 1000.0, 10000.0):
        r = gm.evaluate(TRUE, 2, batches, cap=None, base_batch=16, grad_sq=1.0,
                        trace_sigma=noise)
        best.append(int(batches[np.argmax(r["goodput"])]))
    assert best == sorted(best) and best[0] < best[-1]


def test_fewer_samples_than_workers_have_no_goodput():
    r = gm.evaluate(TRUE, [4, 4], [2, 16], cap=None, base_batch=16, grad_sq=1.0, trace_sigma=1.0)
    assert r["goodput"][0] == 0.0 and r["goodput"][1] > 0


# -- the policy on synthetic snapshots ---------------------------------------------------------
def snapshot(step, batch=32, world=2, *, grad_sq=1.0, trace_sigma=2000.0, max_workers=None,
             params=TRUE, cap=None, **kw):
    local = -(-batch // world)
    k = int(gm.passes(local, cap))
    compute, total = (float(x) for x in measured(params, world, local, k))
    base = dict(step=step, epoch=0, world_size=world, batch_size=batch, lr=0.1, momentum=0.9,
                base_lr=0.1, base_batch_size=32, grad_sq=grad_sq, trace_sigma=trace_sigma,
                noise_scale=trace_sigma / grad_sq if grad_sq else float("nan"), monitored=True,
                compute_time=(compute - 1e-4,) * world, wait_time=(total - compute,) * world,
                step_time=(total,) * world, rank_samples=(float(local),) * world,
                max_workers=max_workers or world)
    base.update(kw)
    return MetricsSnapshot(**base)


def drive(policy, steps, **kw):
    """Call the policy as the engine does (every ``interval`` steps) and apply what it
    decides to the synthetic job; returns the decisions with the step they came at."""
    out = []
    batch, world = kw.pop("batch", 32), kw.pop("world", 2)
    for step in range(policy.interval, steps + 1, policy.interval):
        s = snapshot(step, batch, world, cap=policy.cap, **kw)
        d = policy.after_step(s)
        if d is not None:
            out.append((step, d))
            policy.on_decision(d, s)
            batch = d.batch_size or batch
            world = d.world_size or world
    return out


def test_policy_keeps_the_configuration_until_it_has_measurements(caplog):
    p = Goodput(interval=1, warmup=0, cooldown=0)
    with caplog.at_level(logging.INFO, logger="hpcadapt.policies.goodput"):
        assert p.after_step(snapshot(2)) is None
        assert p.after_step(snapshot(3)) is None
    assert sum("fewer than" in r.getMessage() for r in caplog.records) == 1
    assert p.after_step(snapshot(4)) is not None


def test_policy_grows_the_batch_with_a_large_noise_scale_and_logs_predicted_goodputs():
    p = Goodput(min=16, max=1024, interval=5, warmup=20, cooldown=20, threshold=0.05)
    decisions = drive(p, 200, trace_sigma=5000.0)
    assert decisions, "expected a decision"
    step, d = decisions[0]
    assert step >= 20 and d.batch_size > 32 and d.world_size is None and d.policy == "goodput"
    m = d.metrics
    assert m["goodput_predicted"] > (1 + 0.05) * m["goodput_current"] > 0
    assert m["efficiency_current"] == pytest.approx(1.0)
    json.dumps(m)   # goes into the metrics file as it is
    # Cooldown between decisions.
    assert all(b - a >= 20 for (a, _), (b, _) in zip(decisions, decisions[1:]))


def test_policy_stays_small_with_a_small_noise_scale():
    p = Goodput(min=16, max=1024, interval=5, warmup=0, cooldown=0)
    assert drive(p, 100, batch=16, trace_sigma=2.0) == []


def test_policy_with_memory_cap_counts_passes():
    p = Goodput(min=16, max=4096, interval=5, warmup=0, cooldown=0, max_local_batch=64)
    decisions = drive(p, 200, trace_sigma=1e6)
    assert decisions
    last = decisions[-1][1]
    assert last.metrics["passes"] == math.ceil(last.batch_size / 2 / 64)


def test_policy_without_allocator_adapts_only_the_batch(caplog):
    p = Goodput(interval=5, warmup=0, cooldown=0)
    with caplog.at_level(logging.INFO, logger="hpcadapt.policies.goodput"):
        decisions = drive(p, 200, trace_sigma=5000.0)
    assert decisions and all(d.world_size is None for _, d in decisions)
    assert sum("batch size only" in r.getMessage() for r in caplog.records) == 1


def test_policy_with_an_allocator_adds_workers_when_they_pay():
    # Cheap network, compute-bound: more workers pay.
    cheap = gm.StepTimeParams(alpha_c=0.001, beta_c=1e-3, alpha_n=1e-4, beta_n=0.0, gamma=1.0)
    p = Goodput(min=64, max=64, interval=5, warmup=0, cooldown=0)
    decisions = drive(p, 100, batch=64, world=2, max_workers=4, params=cheap)
    assert decisions and decisions[0][1].world_size in (3, 4)
    assert decisions[0][1].batch_size is None
    # At most twice the largest world measured (Pollux's bound on exploring).
    p = Goodput(min=64, max=64, interval=5, warmup=0, cooldown=0)
    decisions = drive(p, 100, batch=64, world=1, max_workers=8, params=cheap)
    assert decisions[0][1].world_size == 2


def test_policy_skips_non_finite_statistics_and_says_so_once(caplog):
    p = Goodput(interval=1, warmup=0, cooldown=0)
    with caplog.at_level(logging.INFO, logger="hpcadapt.policies.goodput"):
        for step in range(2, 20):
            assert p.after_step(snapshot(step, grad_sq=float("nan"))) is None
    warned = [r for r in caplog.records if "no finite noise-scale" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    # The timings were still recorded: with statistics it decides at once.
    assert p.after_step(snapshot(20, trace_sigma=5000.0)) is not None


def test_policy_ignores_the_steps_right_after_a_change():
    p = Goodput(interval=1, warmup=0, cooldown=0)
    p.last_change = 10
    assert not p.record(snapshot(11))       # its times are those of the step before the change
    assert p.record(snapshot(12))


def test_policy_state_round_trips_and_bad_settings():
    p = Goodput(interval=5, warmup=0, cooldown=0)
    drive(p, 60, trace_sigma=5000.0)
    q = Goodput(interval=5)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.samples == p.samples and q.last_change == p.last_change
    with pytest.raises(ConfigurationError, match="--goodput-min .* must not exceed --goodput-max"):
        Goodput(min=64, max=32)


def test_flags_and_engine_apply_the_lr_rule():
    args = build_parser().parse_args(["--policy", "goodput", "--goodput-max-local-batch", "64",
                                      "--goodput-threshold", "0.1", "--lr-rule", "sqrt"])
    (p,) = build_policies(args)
    assert isinstance(p, Goodput) and p.cap == 64 and p.threshold == 0.1
    assert p.requires == ("gns",)
    p.warmup = p.cooldown = 0
    engine = PolicyEngine([p], LRRule("sqrt", 8))
    out = []
    for step in range(10, 100, 10):
        out = engine.decide("after_step", snapshot(step, trace_sigma=5000.0))
        if out:
            break
    assert [d.policy for d in out] == ["goodput", "lr-rule:sqrt"]
    assert out[1].lr == pytest.approx(0.1 * math.sqrt(out[0].batch_size / 32))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--policy", "goodput", "--goodput-threshold", "2"])


# -- a real run --------------------------------------------------------------------------------
def test_goodput_run_on_two_ranks(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run_mpi(2, ["-m", "hpcadapt.train", "--dataset", "mnist1d", "--samples", "2000",
                "--model", "cnn", "--epochs", "2", "--batch-size", "8", "--lr", "0.05",
                "--seed", "0", "--no-progress", "--threads", "1",
                "--policy", "goodput", "--goodput-min", "16", "--goodput-max", "256",
                "--goodput-interval", "2", "--goodput-warmup", "10", "--goodput-cooldown", "10",
                "--goodput-threshold", "0.0", "--goodput-max-local-batch", "32",
                "--max-local-batch", "32", "--lr-rule", "sqrt",
                "--metrics-file", str(metrics)], timeout=300)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    decisions = [r for r in rows if r["event"] == "decision" and r["policy"] == "goodput"]
    assert decisions, "no goodput decision"
    for d in decisions:
        m = d["metrics"]
        assert m["goodput_predicted"] > 0 and m["goodput_current"] > 0
        if "outside" not in d["reason"]:
            assert m["goodput_predicted"] > m["goodput_current"]
    epochs = [r for r in rows if r["event"] == "epoch"]
    assert len(epochs) == 2 and all(math.isfinite(r["test_accuracy"]) for r in epochs)


def test_policy_moves_a_batch_outside_its_range_at_once():
    p = Goodput(min=64, max=256, interval=1, warmup=0, cooldown=0, threshold=0.99)
    for step in range(2, 5):
        d = p.after_step(snapshot(step, batch=16, trace_sigma=1.0))
    assert d is not None and 64 <= d.batch_size <= 256 and "outside [64, 256]" in d.reason


def test_policy_reads_the_jobs_memory_cap_and_resizability_from_the_snapshot():
    """Without its own flags the policy uses the job's --max-local-batch and knows it may
    change the number of workers (can_resize) even with no room above the current size."""
    p = Goodput(min=16, max=4096, interval=5, warmup=0, cooldown=0)
    s = snapshot(5, 256, 2, max_local_batch=64, can_resize=True, min_workers=2)
    assert p.config(s) == (2, 128, 2)
    assert list(p.worker_range(s)) == [2] and p.elastic


def test_one_decision_moves_the_batch_by_at_most_max_step():
    # a huge noise scale makes 1024 the best batch; from 64 one decision may reach 256
    p = Goodput(min=16, max=1024, interval=1, warmup=0, cooldown=0, max_step=4.0)
    d = None
    for step in range(2, 6):
        d = p.after_step(snapshot(step, batch=64, trace_sigma=1e6))
        if d is not None:
            break
    assert d is not None and d.batch_size == 256, d
    wide = Goodput(min=16, max=1024, interval=1, warmup=0, cooldown=0, max_step=64.0)
    for step in range(2, 6):
        d = wide.after_step(snapshot(step, batch=64, trace_sigma=1e6))
        if d is not None:
            break
    assert d is not None and d.batch_size > 256, d
