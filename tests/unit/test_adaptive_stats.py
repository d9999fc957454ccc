"""The adaptive benchmark's statistics (benchmarks/adaptive_stats.py), hand-computed cases,
and the driver's pure parts: the grids, the ramps' step points, the records of metrics files
and their analysis, the tuning rules, and the results folder (atomic records, meta.json)."""

import copy
import json
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
    assert r["censored"] == {"adaptive": 1, "baseline": 0} and r["both_censored"] == 0
    assert r["n"] == 4 and r["log_ratios"][3] == pytest.approx(math.log(10))
    assert r["win"] is False and r["bound"] == "lower"
    # the baseline misses: its end stands in (ratio an upper bound); a win may stand
    r = st.paired_ratio(fast, base[:3] + [(None, 120.0)])
    assert r["censored"]["baseline"] == 1 and r["bound"] == "upper"
    assert r["log_ratios"][3] == pytest.approx(math.log(52 / 120))
    assert r["win"] is True


def test_pairs_censored_on_both_sides_are_left_out_and_counted():
    base = [(100.0, 1000)] * 4
    fast = [(50.0, 1000), (55.0, 1000), (60.0, 1000), (52.0, 1000)]
    # both miss on seed 3: out of n and of the mean (no log-ratio 0 pulling it to 1), counted
    r = st.paired_ratio(fast[:3] + [(None, 1000)], base[:3] + [(None, 1000)])
    assert r["both_censored"] == 1 and r["n"] == 3 and r["log_ratios"][3] is None
    assert r["ratio"] == pytest.approx(math.exp(np.mean([math.log(x / 100) for x in (50, 55, 60)])))
    assert r["censored"] == {"adaptive": 0, "baseline": 0} and r["bound"] == "exact"
    assert r["ci_hi"] < 1 and r["win"] is False   # the method missed on that seed too
    # the same three pairs alone: the same ratio and interval
    alone = st.paired_ratio(fast[:3], base[:3])
    assert (alone["ratio"], alone["ci_hi"]) == (pytest.approx(r["ratio"]),
                                                pytest.approx(r["ci_hi"]))
    # one informative pair left: its ratio, no interval, no win
    r = st.paired_ratio([(50.0, 1000), (None, 1000)], [(100.0, 1000), (None, 1000)])
    assert r["n"] == 1 and r["both_censored"] == 1 and r["ratio"] == pytest.approx(0.5)
    assert r["ci_hi"] is None and r["win"] is False
    # nobody ever reaches: nothing to compare, said so
    r = st.paired_ratio([(None, 1)] * 2, [(None, 1)] * 2)
    assert r["ratio"] is None and r["win"] is False and "no run" in r["note"]
    assert r["n"] == 0 and r["both_censored"] == 2


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


# ----------------------------------------------------------------- the driver's grids

def test_rate_grid_scales_with_the_square_root_of_the_batch():
    mnist = drv.TASKS["mnist1d"]
    assert drv.lr_grid(mnist, 16) == [0.025, 0.05, 0.1]
    assert drv.lr_grid(mnist, 64) == [0.05, 0.1, 0.2]
    assert drv.lr_grid(mnist, 24) == [0.0306, 0.0612, 0.122]   # 3 digits: stable names
    assert drv.lr_grid(drv.TASKS["lm"], 16) == [5e-3, 1e-2, 2e-2]
    for task in drv.TASKS.values():   # 3 rates at every batch of the grid
        assert len(drv.fixed_grid(task)) == 3 * len(task["batches"])
    assert drv.TASKS["lm"]["batches"] == [16, 24, 32, 48, 64, 96]
    assert drv.TASKS["mnist1d"]["batches"] == [16, 24, 32, 48, 64, 96, 128, 256, 512]
    assert drv.start_grid(mnist, 64) == [{"start_batch": 64, "lr": lr} for lr in (0.05, 0.1, 0.2)]


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


def test_growth_flags_start_small_and_keep_the_cosine():
    flags = drv.method_flags("growth", {"start_batch": 16, "lr": 0.05}, drv.TASKS["mnist1d"],
                             24000)
    assert flags == ["--batch-size", "16", "--lr", "0.05", "--lr-rule", "linear", "--policy",
                     "decay-growth", "--decay-growth-max", "512"] + drv.GROWTH_FLAGS
    lm = drv.method_flags("growth", {"start_batch": 16, "lr": 0.01}, drv.TASKS["lm"], 64000)
    assert lm[lm.index("--lr-rule") + 1] == "sqrt" and lm[-1] == "96"
    common = drv.common_flags("lm", 64000, 0, 64000)
    assert common[common.index("--lr-schedule") + 1] == "cosine" and "--warmup-fraction" in common
    assert drv.FAMILY_NEEDS["growth"] == ["--decay-growth-max"]
    assert drv.missing_flags(drv.FAMILY_NEEDS["growth"], "--policy --lr") == ["--decay-growth-max"]


# ----------------------------------------------------------------- the driver's analysis

def _fake_run(method, family, config, seed, curve, batch, step_s=0.01, noise=None):
    """A run's record from fake metrics-file rows: steps at ``batch``, an evaluation every 10
    steps with the losses of ``curve``; the noise scale of step s is ``noise(s)`` when given
    (None: the step line has no noise scale)."""
    rows, t = [], 0.0
    for k, loss in enumerate(curve, start=1):
        for s in range((k - 1) * 10 + 1, k * 10 + 1):
            t += step_s
            mon = {} if noise is None or noise(s) is None else {
                "noise_scale": noise(s), "noise_scale_lo": noise(s) / 2,
                "noise_scale_hi": noise(s) * 2}
            rows.append({"event": "step", "step": s, "batch_size": batch, "step_time_s": step_s,
                         "time_s": t, "lr": 0.1, "monitors": mon})
        rows.append({"event": "eval", "step": k * 10, "samples": k * 10 * batch,
                     "val_loss": loss, "batch_size": batch, "lr": 0.1, "time_s": t})
    rec = drv.parse_run(rows)
    rec.update(task="t", family=family, config=config, method=method, seed=seed)
    return rec


def test_a_record_holds_the_noise_scale_at_each_evaluation_and_step_time_summaries():
    # no noise scale before step 15, then 10 x step; evaluations at steps 10, 20, 30
    rec = _fake_run("m", "fixed", {}, 0, [2.0, 1.5, 1.0], 32,
                    noise=lambda s: None if s < 15 else 10.0 * s)
    e = rec["evals"]
    assert e["noise_scale"] == [None, 200.0, 300.0]
    assert e["noise_scale_lo"] == [None, 100.0, 150.0] and e["noise_scale_hi"][2] == 600.0
    assert rec["step_time_summary"] == {"32": {"count": 30, "median_s": pytest.approx(0.01)}}
    assert rec["step_batches"] == [[32, 30]] and rec["samples"] == 960
    # without any monitored step: None at every evaluation, no band keys
    plain = _fake_run("m", "fixed", {}, 0, [2.0, 1.5], 32)
    assert plain["evals"]["noise_scale"] == [None, None] and "noise_scale_lo" not in plain["evals"]
    # small and strict JSON once compacted: NaN becomes None and comes back as NaN
    rec["final_loss"] = float("nan")
    small = drv._compact(rec)
    assert small["final_loss"] is None and len(drv._json_bytes(small)) < 2000
    assert math.isnan(drv._restore(small)["final_loss"])


def test_a_diverged_run_is_recorded_as_never_reaching_a_target_and_ranks_last():
    """A configuration whose loss stays non-finite (the trainer's stop line says so, exit 1) is
    an outcome of the grid, not a crash of the sweep: its record ends with an evaluation of no
    loss at its last step, it crosses no target, and the tuning ranks it last."""
    rows = [{"event": "step", "step": s, "batch_size": 32, "step_time_s": 0.01,
             "time_s": 0.01 * s, "lr": 3.0, "monitors": {}} for s in range(1, 16)]
    rows.insert(10, {"event": "eval", "step": 10, "samples": 320, "val_loss": 5.0,
                     "batch_size": 32, "lr": 3.0, "time_s": 0.1})
    rows.append({"event": "stop", "reason": "5 steps with a non-finite loss"})
    assert drv.diverged_at(rows) is not None and drv.diverged_at(rows[:-1]) is None
    rec = drv.parse_run(rows, diverged=True)
    assert rec["diverged"] and rec["final_loss"] is None and rec["steps"] == 15
    assert rec["evals"]["step"] == [10, 15] and rec["evals"]["samples"] == [320, 480]
    rec = drv._restore(drv._compact(dict(rec, task="t", family="fixed", config={"batch": 32},
                                         method="diverged", seed=0)))
    good = _fake_run("good", "fixed", {"batch": 32}, 0, [3.0, 2.0], 32)
    drv.add_axes([rec, good], drv.fit_model([rec, good]))
    scores = drv.score_configs([rec, good], 2.5)
    assert scores["diverged"]["steps"] == math.inf
    assert drv._pick(scores, "final_loss") == drv._pick(scores, "steps") == "good"


def test_the_cost_model_fits_the_step_time_summaries():
    runs = [_fake_run("a", "fixed", {}, 0, [2.0] * 3, 16, step_s=0.026),
            _fake_run("b", "fixed", {}, 0, [2.0] * 3, 64, step_s=0.074),
            _fake_run("c", "fixed", {}, 0, [2.0] * 3, 256, step_s=0.266)]
    m = drv.fit_model(runs)
    assert m["c0_s"] == pytest.approx(0.01) and m["c1_s_per_sample"] == pytest.approx(0.001)


def _families():
    return {"fixed": {"winner": {"batch": 64, "lr": 0.1},
                      "winner_by": {"steps": {"batch": 64, "lr": 0.1},
                                    "samples": {"batch": 64, "lr": 0.1},
                                    "final_loss": {"batch": 64, "lr": 0.1}}},
            "seesaw": {"winner": {"start_batch": 64, "lr": 0.1}},
            "growth": {"winner": {"start_batch": 16, "lr": 0.1}},
            "adaptive": {"config": {"start_batch": 16, "lr": 0.1}}}


def test_analysis_of_fake_runs_gives_the_keys_and_says_who_missed():
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
    fams = _families()
    del fams["growth"], fams["seesaw"]
    detail, flat = drv.analyse("t", runs, fams, [0, 1], [1.5, 1.0, 0.5])
    assert set(flat) >= {"adaptive_steps_vs_best_fixed_t", "adaptive_steps_ci_hi_t",
                         "adaptive_samples_vs_best_fixed_t", "adaptive_final_loss_delta_t",
                         "growth_steps_vs_best_fixed_t", "growth_final_loss_delta_hi_t"}
    assert flat["growth_steps_vs_best_fixed_t"] is None   # growth did not run
    steps = detail["adaptive"]["vs_best_fixed"]["1"]["steps"]
    assert steps["log_ratios"][0] == pytest.approx(math.log(20 / 30))
    assert flat["adaptive_steps_vs_best_fixed_t"] == pytest.approx(steps["ratio"])
    assert detail["reached"][adaptive]["0.5"] == 0 and detail["reached"][fixed]["0.5"] == 0
    never = detail["adaptive"]["vs_best_fixed"]["0.5"]["steps"]
    assert never["ratio"] is None and never["both_censored"] == 2
    # samples: 20 steps x 16 against 30 x 64
    assert detail["adaptive"]["vs_best_fixed"]["1"]["samples"]["log_ratios"][0] == \
        pytest.approx(math.log(320 / 1920))
    # final loss at equal samples: the adaptive run's last evaluation (800 samples)
    assert detail["adaptive"]["final_loss_delta"]["at_samples"] == [800.0, 800.0]
    assert np.isfinite(flat["adaptive_final_loss_delta_t"])


def test_growth_headline_keys_against_the_best_fixed_by_loss_and_seesaw():
    fams = _families()
    labels = {f: drv.label(f, fams[f].get("winner") or fams[f]["config"]) for f in fams}
    curves = {"fixed": [2.0, 1.5, 1.0, 0.8, 0.6], "seesaw": [2.0, 1.4, 1.0, 0.8, 0.65],
              "growth": [1.9, 1.2, 0.9, 0.7, 0.5]}
    runs = [_fake_run(labels[f], f, fams[f]["winner"], seed,
                      [x + 0.01 * seed for x in curves[f]], 64 if f != "growth" else 16)
            for seed in (0, 1, 2) for f in curves]
    detail, flat = drv.analyse("lm", runs, fams, [0, 1, 2], [1.5, 1.0, 0.7])
    # the headline steps: the whole budget's, 50 steps of growth against 50 of fixed here
    assert flat["growth_steps_vs_best_fixed_lm"] == pytest.approx(1.0)
    assert flat["growth_steps_ci_hi_lm"] >= flat["growth_steps_vs_best_fixed_lm"]
    assert flat["growth_steps_to_middle_target_vs_best_fixed_lm"] is not None
    assert detail["growth"]["steps_whole_budget"]["baseline"] == labels["fixed"]
    # growth ends at 800 samples, fixed at 3,200: the fixed curve at 800 (step 12.5) is 1.875
    assert flat["growth_final_loss_delta_lm"] == pytest.approx(0.5 - 1.875)
    assert flat["growth_final_loss_delta_hi_lm"] == pytest.approx(0.5 - 1.875)  # no spread
    assert flat["growth_vs_seesaw_final_loss_delta_lm"] == pytest.approx(0.5 - 1.85)
    assert detail["growth"]["final_loss_delta"]["baseline"] == labels["fixed"]
    assert flat["adaptive_steps_vs_best_fixed_lm"] is None   # the adaptive method did not run


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


def test_targets_by_the_rule_and_the_record_a_full_comparison_refuses():
    runs = [_fake_run("fixed b64 lr0.1", "fixed", {"batch": 64, "lr": 0.1}, 1000,
                      [2.0, 1.6, 1.2, 1.0, 0.9, 0.8, 0.7, 0.6, 0.55, 0.5], 64),
            _fake_run("fixed b16 lr0.1", "fixed", {"batch": 16, "lr": 0.1}, 1000,
                      [2.0] * 10, 16)]
    targets, note = drv.targets_by_rule(runs, 1000)
    # 40% of 6,400 samples: 2,560 (eval 4: 1.0); 70%: 4,480 (eval 7: 0.7); 0.5 x 1.02
    assert targets == [1.0, 0.7, 0.51] and "fixed b64 lr0.1" in note
    task = drv.TASKS["mnist1d"]
    # a record of another grid, growth untried (the shipped record before issue 41's sweep)
    shipped = copy.deepcopy(drv.read_tuning(drv.TUNING_FILE)["tasks"]["mnist1d"])
    shipped["families"]["fixed"]["grid"] = shipped["families"]["fixed"]["grid"][:-1]
    shipped["families"]["growth"] = dict(shipped["families"]["growth"], provisional=True)
    problems = drv.record_problems(shipped, task, task["samples"], drv.FAMILIES)
    assert any("another grid" in p for p in problems) and any("growth" in p for p in problems)
    # quick: the fixed winner by final loss and growth (gns-batch while growth cannot run)
    fams = shipped["families"]
    assert [f for f, _ in drv.comparison_methods(fams, drv.FAMILIES, True)] == ["fixed", "growth"]
    no_growth = [f for f in drv.FAMILIES if f != "growth"]
    assert [f for f, _ in drv.comparison_methods(fams, no_growth, True)] == ["fixed", "adaptive"]
    full = [f for f, _ in drv.comparison_methods(fams, drv.FAMILIES, False)]
    assert full[-4:] == ["doubling", "seesaw", "growth", "adaptive"]
    # recorded by the sweep; an older record's is counted from its grid and seeds
    assert drv.tuning_compute(fams, 30000)["fixed"] == fams["fixed"]["tuning_compute"]
    old = {"fixed": {"grid": [{}] * 12, "tuning_seeds": [1000, 1001]}}
    assert drv.tuning_compute(old, 30000)["fixed"] == {"runs": 24, "samples": 24 * 30000}


# ----------------------------------------------------------------- the results folder

def test_results_folder_meta_written_once_and_a_foreign_one_refused_in_one_line(tmp_path):
    folder = tmp_path / "res"
    drv.open_results(folder, quick=True)
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["version"] == drv.RESULTS_VERSION and meta["quick"] is True
    assert meta["budgets"] == {"mnist1d": 4000, "lm": 768}
    drv.open_results(folder, quick=True)   # the same setting: accepted
    with pytest.raises(SystemExit) as stop:
        drv.open_results(folder, quick=False)
    msg = str(stop.value)
    assert "\n" not in msg and str(folder) in msg and "quick" in msg and "--results" in msg
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as stop:
        drv.open_results(other, quick=True)
    assert "no meta.json" in str(stop.value)
    leftover = tmp_path / "leftover"   # a kill during the first write: only meta.tmp there
    leftover.mkdir()
    (leftover / "meta.tmp").write_text("{")
    drv.open_results(leftover, quick=True)
    assert json.loads((leftover / "meta.json").read_text())["version"] == drv.RESULTS_VERSION


def test_records_are_written_atomically_never_through_a_symlink(tmp_path):
    path = tmp_path / "r.json"
    (tmp_path / "r.tmp").write_text("half a reco")   # a leftover: overwritten
    drv.write_atomic(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} and not (tmp_path / "r.tmp").exists()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "r.tmp").symlink_to(victim)
    with pytest.raises(OSError):
        drv.write_atomic(path, {"a": 2})
    assert victim.read_text() == "keep" and json.loads(path.read_text()) == {"a": 1}
    (tmp_path / "r.tmp").unlink()
    # a symlink at NAME.json is replaced, its target untouched
    path.unlink()
    path.symlink_to(victim)
    drv.write_atomic(path, {"a": 3})
    assert not path.is_symlink() and victim.read_text() == "keep"
    link = tmp_path / "linked"
    link.symlink_to(tmp_path)
    with pytest.raises(SystemExit):
        drv.make_folder(link)


def test_a_record_of_another_task_budget_or_flags_is_refused(tmp_path):
    name = drv.record_path(tmp_path, "mnist1d", "fixed", {"batch": 16, "lr": 0.05}, 3, 4000)
    assert name == tmp_path / "mnist1d" / "fixed_b16_lr0.05-s3-n4000.json"
    rec = drv._compact(_fake_run("fixed b16 lr0.05", "fixed", {"batch": 16, "lr": 0.05}, 3,
                                 [2.0, 1.0], 16))
    rec.update(task="mnist1d", budget_samples=4000, flags=["--a"])
    name.parent.mkdir()
    drv.write_atomic(name, rec)
    assert drv.load_record(name, "mnist1d", 4000, ["--a"])["final_loss"] == 1.0
    for args, what in ((("lm", 4000, ["--a"]), "task"), (("mnist1d", 768, ["--a"]), "task"),
                       (("mnist1d", 4000, ["--b"]), "flags")):
        with pytest.raises(SystemExit) as stop:
            drv.load_record(name, *args)
        assert what in str(stop.value) and "\n" not in str(stop.value)


def test_growth_has_one_set_of_defaults_on_every_task():
    """Issue 41: no per-task tuning of the policy. The growth flags of the two tasks differ only
    in what the task is (its starting rate, its grid's largest batch, its optimizer's rule);
    none of decay-growth's own parameters is set, so the policy's defaults (in the code, read
    here) are what both tasks run with."""
    from hpcadapt.policies import DecayGrowth

    per_task = {}
    for name, task in drv.TASKS.items():
        flags = drv.method_flags("growth", {"start_batch": 16, "lr": 0.01}, task, 1000)
        per_task[name] = flags
        own = [f for f in flags if f.startswith("--decay-growth-")]
        assert own == ["--decay-growth-max"], (name, own)
        assert "--monitor-window" not in flags    # the policy's own memory (4,096 samples)
    task_values = {"--batch-size", "--lr", "--lr-rule", "--decay-growth-max"}

    def shared(flags):
        out, skip = [], False
        for f in flags:
            if skip:
                skip = False
                continue
            if f in task_values:
                skip = True
                continue
            out.append(f)
        return out

    assert shared(per_task["mnist1d"]) == shared(per_task["lm"])
    defaults = {p.name: p.default for p in DecayGrowth.params}
    assert defaults["margin"] == 1.0 and defaults["temperature-power"] == 0.5
    assert defaults["granularity"] == pytest.approx(2 ** 0.5, abs=1e-4)
    assert DecayGrowth.monitor_window == 4096
