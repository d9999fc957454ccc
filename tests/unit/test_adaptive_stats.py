"""The adaptive benchmark's statistics (benchmarks/adaptive_stats.py), hand-computed cases,
and the driver's pure parts: the ramps' step points and the analysis of metrics files."""

import math
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import adaptive_stats as st  # noqa: E402
import driver_adaptive as drv  # noqa: E402


# ----------------------------------------------------------------- crossing

def test_crossing_interpolates_between_the_evaluations_around_the_target():
    # 1.0 at step 200, 0.5 at 300: 0.8 is 0.2 / 0.5 = 0.4 of the way
    assert st.crossing([100, 200, 300], [2.0, 1.0, 0.5], 0.8) == pytest.approx(240.0)
    # exactly on an evaluation
    assert st.crossing([100, 200, 300], [2.0, 1.0, 0.5], 1.0) == pytest.approx(200.0)
    # below the target at the first evaluation: nothing known before it
    assert st.crossing([100, 200, 300], [2.0, 1.0, 0.5], 3.0) == 100.0


def test_crossing_never_reached_is_censored_and_nan_never_reaches():
    assert st.crossing([100, 200, 300], [2.0, 1.0, 0.5], 0.4) is None
    assert st.crossing([100, 200], [2.0, float("nan")], 1.0) is None
    # the first crossing counts, not a later one after a rise
    assert st.crossing([1, 2, 3, 4], [2.0, 0.9, 1.5, 0.5], 1.0) == pytest.approx(1 + 1.0 / 1.1)


def test_crossings_use_one_fraction_on_every_axis():
    got = st.crossings({"steps": [100, 200, 300], "samples": [3200, 6400, 9600]},
                       [2.0, 1.0, 0.5], 0.8)
    assert got == {"steps": pytest.approx(240.0), "samples": pytest.approx(7680.0)}
    assert st.crossings({"steps": [1, 2]}, [2.0, 1.5], 1.0) == {"steps": None}


# ----------------------------------------------------------------- intervals

def test_t_quantiles_table_and_beyond():
    assert st.t_quantile_975(1) == pytest.approx(12.706, abs=1e-3)
    assert st.t_quantile_975(4) == pytest.approx(2.776, abs=1e-3)
    assert st.t_quantile_975(30) == pytest.approx(2.042, abs=1e-3)
    # published values past the table
    assert st.t_quantile_975(40) == pytest.approx(2.021, abs=1e-3)
    assert st.t_quantile_975(60) == pytest.approx(2.000, abs=1e-3)
    assert st.t_quantile_975(120) == pytest.approx(1.980, abs=1e-3)


def test_mean_ci_against_a_known_t_interval():
    # 1..5: mean 3, sd sqrt(2.5), se sqrt(0.5); t(4) = 2.7764: 3 +- 1.9632
    mean, lo, hi = st.mean_ci([1, 2, 3, 4, 5])
    assert (mean, lo, hi) == (pytest.approx(3.0), pytest.approx(1.0368, abs=1e-4),
                              pytest.approx(4.9632, abs=1e-4))


def test_paired_ratio_geometric_mean_and_interval():
    # log-ratios ln 0.5 and 0: mean -0.34657 (ratio 0.7071), se 0.34657, t(1) 12.7062
    r = st.paired_ratio([(100, 1000), (200, 1000)], [(200, 1000), (200, 1000)])
    assert r["ratio"] == pytest.approx(math.sqrt(0.5))
    assert r["ci_hi"] == pytest.approx(math.exp(-0.34657 + 12.7062 * 0.34657), rel=1e-3)
    assert r["ci_lo"] == pytest.approx(math.exp(-0.34657 - 12.7062 * 0.34657), rel=1e-3)
    assert r["win"] is False and r["bound"] == "exact"


def test_paired_ratio_win_only_when_the_upper_bound_is_below_one():
    base = [(100.0, 1000)] * 4
    r = st.paired_ratio([(50.0, 1000), (55.0, 1000), (60.0, 1000), (52.0, 1000)], base)
    assert r["ci_hi"] < 1 and r["win"] is True
    r = st.paired_ratio([(50.0, 1000), (150.0, 1000), (60.0, 1000), (52.0, 1000)], base)
    assert r["ratio"] < 1 and r["ci_hi"] > 1 and r["win"] is False


def test_censored_pairs_are_kept_and_conservative_for_the_adaptive_method():
    base = [(100.0, 1000)] * 4
    fast = [(50.0, 1000), (55.0, 1000), (60.0, 1000), (52.0, 1000)]
    # the adaptive run misses on one seed: its end (1000) stands in, a lower bound; no win
    missed = fast[:3] + [(None, 1000)]
    r = st.paired_ratio(missed, base)
    assert r["censored"] == {"adaptive": 1, "baseline": 0, "both": 0}
    assert r["log_ratios"][3] == pytest.approx(math.log(10))
    assert r["win"] is False and r["bound"] == "lower"
    # the baseline misses: its end stands in (ratio an upper bound); a win may stand
    r = st.paired_ratio(fast, base[:3] + [(None, 120.0)])
    assert r["censored"]["baseline"] == 1 and r["bound"] == "upper"
    assert r["log_ratios"][3] == pytest.approx(math.log(52 / 120))
    assert r["win"] is True
    # both miss on a seed: log-ratio 0, counted, and no win claimed
    r = st.paired_ratio(fast[:3] + [(None, 1000)], base[:3] + [(None, 1000)])
    assert r["censored"]["both"] == 1 and r["log_ratios"][3] == 0.0 and r["win"] is False
    # nobody ever reaches: nothing to compare, said so
    r = st.paired_ratio([(None, 1)] * 2, [(None, 1)] * 2)
    assert r["ratio"] is None and r["win"] is False and "no run" in r["note"]


def test_fewer_than_two_seeds_refused():
    with pytest.raises(st.TooFewSeeds):
        st.paired_ratio([(1.0, 2.0)], [(1.0, 2.0)])
    with pytest.raises(st.TooFewSeeds):
        st.paired_delta([1.0], [2.0])
    with pytest.raises(st.TooFewSeeds):
        st.mean_ci([1.0])
    with pytest.raises(SystemExit) as stop:   # the driver: one line, before any run
        drv.run("adaptive", ["--seeds", "1"])
    assert "at least 2 seeds" in str(stop.value) and "\n" not in str(stop.value)


def test_paired_delta_and_loss_at_equal_samples():
    d = st.paired_delta([0.5, 0.6, 0.7], [0.6, 0.6, 0.6])
    assert d["delta"] == pytest.approx(0.0)
    assert d["ci_hi"] == pytest.approx(4.3027 * 0.1 / math.sqrt(3), rel=1e-4)
    assert st.paired_delta([float("nan"), 1.0], [1.0, 1.0])["delta"] is None
    a = ([100, 200, 300], [3.0, 2.0, 1.0])
    b = ([100, 200, 250], [3.0, 2.0, 1.5])
    assert st.final_loss_at_equal_samples(a, b) == (pytest.approx(1.5), pytest.approx(1.5), 250.0)
    assert st.loss_at([100, 200], [2.0, 1.0], 150) == pytest.approx(1.5)


def test_cost_model_fits_medians_per_batch():
    # c0 = 0.01 s, c1 = 0.001 s/sample; one load spike at batch 16 does not move the medians
    batches = [16, 16, 16, 64, 64, 64, 256, 256]
    times = [0.026, 0.026, 5.0, 0.074, 0.074, 0.074, 0.266, 0.266]
    m = st.fit_cost_model(batches, times)
    assert m["c0_s"] == pytest.approx(0.01) and m["c1_s_per_sample"] == pytest.approx(0.001)
    cum = st.cumulative_cost([16, 16, 64], m)
    assert list(cum) == [0.0, pytest.approx(0.026), pytest.approx(0.052), pytest.approx(0.126)]
    one = st.fit_cost_model([32, 32], [0.064, 0.064])   # one batch: through the origin
    assert one["c0_s"] == 0.0 and one["c1_s_per_sample"] == pytest.approx(0.002)
    assert st.geomean_score([100, 400]) == pytest.approx(200)
    assert st.geomean_score([100, None]) == math.inf


# ----------------------------------------------------------------- the driver's ramps

def test_doubling_ramp_steps_fall_on_the_budget_fractions():
    # 48,000 samples from batch 16: 1/8 (6,000) at step 375, then batch 32 to 1/4 (+187.5,
    # the first whole step at or past it: 563), then 64 to 1/2 (+187.5: 750)
    assert drv.doubling_points(48000, 16, 512) == [(375, 32), (563, 64), (750, 128)]
    assert drv.doubling_points(48000, 256, 512) == [(24, 512)]   # 23.4 steps: the 24th


def test_seesaw_where_the_cosine_halves_batch_and_scale_never_share_a_step():
    assert drv.cosine_halvings(0.0, 2) == [pytest.approx(0.5), pytest.approx(2 / 3)]
    bpts, spts = drv.seesaw_points(48000, 16, 64)
    assert [b for _, b in bpts] == [32, 64]
    assert {s for s, _ in bpts}.isdisjoint({s for s, _ in spts})
    assert [s for s, _ in spts[:2]] == [s + 1 for s, _ in bpts]
    assert [f for _, f in spts[:2]] == [pytest.approx(1 / math.sqrt(2), abs=1e-6)] * 2
    assert all(f == 0.5 for _, f in spts[2:])   # past the largest batch: the rate halves
    flags = drv.method_flags("seesaw", {"start_batch": 16, "lr": 0.1},
                             dict(drv.TASKS["mnist1d"], batches=[16, 32, 64]), 48000)
    assert flags[flags.index("--lr-schedule") + 1] == "constant"
    adaptive = drv.method_flags("adaptive", {"start_batch": 16, "lr": 0.05},
                                drv.TASKS["mnist1d"], 48000)
    assert adaptive[4:4 + len(drv.ADAPTIVE_FLAGS)] == drv.ADAPTIVE_FLAGS


# ----------------------------------------------------------------- the driver's analysis

def _fake_run(method, family, config, seed, curve, batch, step_s=0.01):
    """Metrics-file rows of a run: steps at ``batch``, an evaluation every 10 steps with the
    losses of ``curve``."""
    rows, t = [], 0.0
    for k, loss in enumerate(curve, start=1):
        for s in range((k - 1) * 10 + 1, k * 10 + 1):
            t += step_s
            rows.append({"event": "step", "step": s, "batch_size": batch, "step_time_s": step_s,
                         "time_s": t, "lr": 0.1})
        rows.append({"event": "eval", "step": k * 10, "samples": k * 10 * batch,
                     "val_loss": loss, "batch_size": batch, "lr": 0.1, "time_s": t})
    rec = drv.parse_run(rows)
    rec.update(task="t", family=family, config=config, method=method, seed=seed)
    return rec


def test_analysis_of_fake_runs_gives_the_keys_and_says_who_missed():
    record = {"families": {
        "fixed": {"winner": {"batch": 64, "lr": 0.1},
                  "winner_by": {"steps": {"batch": 64, "lr": 0.1},
                                "samples": {"batch": 64, "lr": 0.1},
                                "final_loss": {"batch": 64, "lr": 0.1}}},
        "adaptive": {"config": {"start_batch": 16, "lr": 0.1}}}}
    fixed = drv.label("fixed", {"batch": 64, "lr": 0.1})
    adaptive = drv.label("adaptive", {"start_batch": 16, "lr": 0.1})
    runs = []
    for seed in (0, 1):
        runs.append(_fake_run(fixed, "fixed", {"batch": 64, "lr": 0.1}, seed,
                              [2.0, 1.5, 1.0, 0.8, 0.6], 64))
        # the adaptive run halves the steps to 1.0 on seed 0; misses 0.5 on both
        curve = [1.8, 1.0, 0.9, 0.7, 0.55] if seed == 0 else [1.9, 1.1, 0.95, 0.7, 0.6]
        runs.append(_fake_run(adaptive, "adaptive", {"start_batch": 16, "lr": 0.1}, seed,
                              curve, 16))
    detail, flat = drv.analyse("t", runs, record, [0, 1], [1.5, 1.0, 0.5])
    assert set(flat) >= {"adaptive_steps_vs_best_fixed_t", "adaptive_steps_ci_hi_t",
                         "adaptive_samples_vs_best_fixed_t", "adaptive_final_loss_delta_t"}
    steps = detail["vs_best_fixed"]["1"]["steps"]
    # seed 0: 20 / 30 steps; seed 1: 20 + 10 * 0.1 / 0.15 ... see the curves
    assert steps["log_ratios"][0] == pytest.approx(math.log(20 / 30))
    assert flat["adaptive_steps_vs_best_fixed_t"] == pytest.approx(steps["ratio"])
    assert detail["reached"][adaptive]["0.5"] == 0 and detail["reached"][fixed]["0.5"] == 0
    assert detail["vs_best_fixed"]["0.5"]["steps"]["ratio"] is None
    # samples: 20 steps x 16 against 30 x 64
    assert detail["vs_best_fixed"]["1"]["samples"]["log_ratios"][0] == \
        pytest.approx(math.log(320 / 1920))
    # final loss at equal samples: the adaptive run's last evaluation (800 samples)
    assert detail["final_loss_delta"]["at_samples"] == [800.0, 800.0]
    assert np.isfinite(flat["adaptive_final_loss_delta_t"])


def test_tuning_scores_pick_by_steps_then_final_loss_and_never_reached_ranks_last():
    runs = []
    for seed in (1000, 1001):
        # b64: 1.0 at step 20 on both seeds; b16: at step 30 (fewer samples: 480 < 1280);
        # b256: never
        runs.append(_fake_run("fixed b64 lr0.1", "fixed", {"batch": 64, "lr": 0.1}, seed,
                              [2.0, 1.0, 0.8], 64))
        runs.append(_fake_run("fixed b16 lr0.1", "fixed", {"batch": 16, "lr": 0.1}, seed,
                              [2.0, 1.5, 1.0, 0.6], 16))
        runs.append(_fake_run("fixed b256 lr0.1", "fixed", {"batch": 256, "lr": 0.1}, seed,
                              [2.0, 1.8, 1.6], 256))
    model = drv.fit_model(runs)
    drv.add_axes(runs, model)
    scores = drv.score_configs(runs, 1.0)
    assert scores["fixed b64 lr0.1"]["steps"] == pytest.approx(20)
    assert scores["fixed b256 lr0.1"]["steps"] == math.inf
    assert drv._pick(scores, "steps") == "fixed b64 lr0.1"
    assert drv._pick(scores, "samples") == "fixed b16 lr0.1"
    # a tie on steps goes to the lower final loss
    scores["fixed b16 lr0.1"]["steps"] = 20.0
    assert drv._pick(scores, "steps") == "fixed b16 lr0.1"
