"""Policies and the engine's decision logic, without MPI."""

import math

import pytest

from hpcadapt import ConfigurationError
from hpcadapt.base.plan import Plan
from hpcadapt.adapt.engine import PolicyEngine
from hpcadapt.policies import (Decision, GNSBatchSize, LRRule, MetricsSnapshot, Policy, Ramp,
                               Schedule)
from hpcadapt.train import build_parser


def snap(**kw):
    base = dict(step=100, epoch=1, world_size=2, batch_size=32, lr=0.1, momentum=0.9,
                base_lr=0.1, base_batch_size=32, noise_scale=100.0, grad_sq=1.0,
                trace_sigma=100.0, monitored=True)
    base.update(kw)
    return MetricsSnapshot(**base)


# -- gns-batch ----------------------------------------------------------------------------
def test_gns_batch_grows_when_noise_scale_exceeds_batch():
    p = GNSBatchSize(min=16, max=1024, factor=2.0, cooldown=0, warmup=0)
    d = p.after_step(snap(noise_scale=100.0, batch_size=32))
    assert d.batch_size == 64 and d.policy == "gns-batch"
    assert d.metrics["noise_scale"] == 100.0 and "supports batch 64" in d.reason
    assert p.after_step(snap(noise_scale=20.0, batch_size=32)) is None


def test_gns_batch_jumps_to_the_batch_the_estimate_supports():
    """Not x2 per decision: straight to the noise scale (within factor, rounded down to a
    multiple of the world size), and not at all for a growth below min-growth."""
    p = GNSBatchSize(min=16, max=4096, factor=8.0, warmup=0, cooldown_samples=0)
    assert p.after_step(snap(noise_scale=203.0, batch_size=32, world_size=3)).batch_size == 201
    assert p.after_step(snap(noise_scale=1000.0, batch_size=32)).batch_size == 256  # x8 at most
    assert p.after_step(snap(noise_scale=38.0, batch_size=32)) is None   # 19% is not worth it
    assert p.after_step(snap(noise_scale=9000.0, batch_size=1024)).batch_size == 4096  # to max


def test_gns_batch_decides_on_a_lower_bound_of_the_noise_scale():
    """A band of the monitor's (95%, two-sided, log-normal) makes the decision conservative:
    at confidence 0.8 the bound is exp(-0.84 sigma) below the estimate; an estimate whose
    error is not known yet (an infinite band) decides nothing."""
    p = GNSBatchSize(min=16, max=4096, factor=8.0, warmup=0, cooldown_samples=0)
    sigma = 0.5
    band = dict(noise_scale=200.0, noise_scale_lo=200.0 * math.exp(-1.96 * sigma),
                noise_scale_hi=200.0 * math.exp(1.96 * sigma))
    d = p.after_step(snap(batch_size=32, **band))
    bound = 200.0 * math.exp(-0.8416 * sigma)
    assert d.batch_size == int(bound // 2 * 2)
    assert p.after_step(snap(batch_size=32, noise_scale=200.0, noise_scale_lo=0.0,
                             noise_scale_hi=math.inf)) is None
    sure = GNSBatchSize(min=16, max=4096, factor=8.0, warmup=0, cooldown_samples=0,
                        confidence=0.5)
    assert sure.after_step(snap(batch_size=32, **band)).batch_size == 200


def test_gns_batch_cooldown_counts_samples():
    p = GNSBatchSize(min=16, max=4096, warmup=0, cooldown_samples=5000)
    d = p.after_step(snap(noise_scale=100.0, batch_size=32, samples_seen=1000))
    p.on_decision(d, snap(samples_seen=1000))
    assert p.after_step(snap(noise_scale=400.0, batch_size=100, samples_seen=5999)) is None
    assert p.after_step(snap(noise_scale=400.0, batch_size=100, samples_seen=6000)).batch_size == 400
    restored = GNSBatchSize(min=16, max=4096, warmup=0, cooldown_samples=5000)
    restored.load_state_dict(p.state_dict())
    assert restored.after_step(snap(noise_scale=400.0, batch_size=100, samples_seen=5999)) is None


def test_gns_batch_clips_to_max_and_respects_cooldown_and_warmup():
    p = GNSBatchSize(min=16, max=48, factor=2.0, cooldown=30, warmup=50)
    assert p.after_step(snap(step=40)) is None  # warm-up
    d = p.after_step(snap(step=60))
    assert d.batch_size == 48
    p.on_decision(d, snap(step=60))
    assert p.after_step(snap(step=80)) is None  # cooldown
    assert p.after_step(snap(step=90, batch_size=48)) is None  # at max


@pytest.mark.parametrize("kwargs,match", [
    (dict(min=64, max=32), "--gns-batch-min .* must not exceed --gns-batch-max"),
    (dict(factor=1.0), "--gns-batch-factor"),
])
def test_gns_batch_bad_settings(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        GNSBatchSize(**kwargs)


# -- seesaw ------------------------------------------------------------------------------
def test_seesaw_points_are_where_the_cosine_halves():
    from hpcadapt.policies.seesaw import halving_points

    pts = halving_points(10000)
    assert pts[:3] == [5000, 6667, 7700]
    for k, s in enumerate(pts, start=1):
        assert 0.5 * (1 + math.cos(math.pi * s / 10000)) <= 2.0 ** -k + 1e-9


def test_seesaw_doubles_the_batch_and_scales_the_rate_at_each_halving():
    from hpcadapt.policies import Seesaw

    p = Seesaw(samples=10000, max=128)
    p.before_train(snap(step=0, batch_size=32, lr=0.1, samples_seen=0))
    assert p.after_step(snap(batch_size=32, lr=0.1, samples_seen=4999)) is None
    d = p.after_step(snap(batch_size=32, lr=0.1, samples_seen=5000))
    assert d.batch_size == 64 and d.lr == pytest.approx(0.1 / math.sqrt(2))
    p.on_decision(d, snap())
    d = p.after_step(snap(batch_size=64, lr=0.09, samples_seen=6700))   # mid-ramp rate
    assert d.batch_size == 128 and d.lr == pytest.approx(0.05)   # the heading rate scaled
    p.on_decision(d, snap())
    d = p.after_step(snap(batch_size=128, lr=0.05, samples_seen=7700))   # at max: rate x1/2
    assert d.batch_size is None and d.lr == pytest.approx(0.025)
    restored = Seesaw(samples=10000, max=128)
    restored.load_state_dict(p.state_dict())
    assert restored.after_step(snap(batch_size=128, lr=0.025, samples_seen=7800)) is None


def test_seesaw_needs_its_budget():
    from hpcadapt.policies import Seesaw

    with pytest.raises(ConfigurationError, match="--seesaw-samples"):
        Seesaw()


# -- schedule ----------------------------------------------------------------------------
def test_schedule_by_step_fires_each_point_once():
    p = Schedule(unit="step", batch=[(0, 16), (10, 64)], lr=[(10, 0.2)])
    assert p.before_train(snap(step=0)).batch_size == 16
    assert p.after_step(snap(step=5)) is None
    d = p.after_step(snap(step=10))
    assert (d.batch_size, d.lr) == (64, 0.2)
    assert p.after_step(snap(step=11)) is None


def test_schedule_by_epoch():
    p = Schedule(unit="epoch", batch=[(2, 128)])
    assert p.before_epoch(snap(epoch=1)) is None
    assert p.before_epoch(snap(epoch=2)).batch_size == 128


def test_schedule_needs_something():
    with pytest.raises(ConfigurationError, match="--schedule-batch, --schedule-lr and/or"):
        Schedule()



def test_schedule_lr_scale_multiplies_the_rate_the_run_is_heading_for():
    """A decay composes with the lr rule: it scales the end of a running ramp (the last
    applied decision's rate), not the mid-ramp rate of the step it happens at."""
    p = Schedule(unit="epoch", lr_scale=[(7, 0.1)])
    assert p.before_train(snap(step=0, epoch=0, batch_size=32, lr=0.02)) is None
    rule = Decision(reason="rule", lr=0.16, policy="lr-rule:linear")
    p.on_decision(Decision(reason="grow", batch_size=256, policy="gns-batch"), snap(step=50))
    p.on_decision(rule, snap(step=50))
    assert p.before_epoch(snap(epoch=6, batch_size=256, lr=0.09)) is None
    d = p.before_epoch(snap(epoch=7, batch_size=256, lr=0.09))   # mid-ramp rate 0.09
    assert d.lr == pytest.approx(0.016) and d.batch_size is None and "x0.1" in d.reason
    assert p.before_epoch(snap(epoch=8, batch_size=256)) is None   # once


def test_schedule_lr_scale_without_decisions_scales_the_current_rate():
    p = Schedule(unit="step", lr_scale=[(10, 0.5), (20, 0.5)])
    p.before_train(snap(step=0, lr=0.2))
    assert p.after_step(snap(step=9, lr=0.2)) is None
    d = p.after_step(snap(step=10, lr=0.2))
    assert d.lr == pytest.approx(0.1)
    p.on_decision(d, snap(step=10))
    assert p.after_step(snap(step=20, lr=0.1)).lr == pytest.approx(0.05)


def test_schedule_lr_scale_waits_for_another_policys_batch_change():
    """The rule's rate for a batch another policy changes in the same call is not known yet:
    the scale waits for the next call, then scales what the rule set."""
    p = Schedule(unit="step", lr_scale=[(10, 0.1)])
    p.before_train(snap(step=0, batch_size=32, lr=0.02))
    assert p.after_step(snap(step=10, batch_size=64, lr=0.02)) is None   # a grow is pending
    p.on_decision(Decision(reason="grow", batch_size=64, policy="gns-batch"), snap(step=10))
    p.on_decision(Decision(reason="rule", lr=0.04, policy="lr-rule:linear"), snap(step=10))
    assert p.after_step(snap(step=11, batch_size=64, lr=0.0204)).lr == pytest.approx(0.004)


def test_schedule_lr_scale_in_epochs_waits_to_the_next_step_not_the_next_epoch():
    p = Schedule(unit="epoch", lr_scale=[(2, 0.1)])
    p.before_train(snap(step=0, epoch=0, batch_size=32, lr=0.02))
    assert p.before_epoch(snap(epoch=2, batch_size=128, lr=0.02)) is None   # a change pending
    p.on_decision(Decision(reason="grow", batch_size=128, policy="goodput"), snap())
    p.on_decision(Decision(reason="rule", lr=0.08, policy="lr-rule:linear"), snap())
    assert p.after_step(snap(epoch=2, batch_size=128, lr=0.03)).lr == pytest.approx(0.008)
    assert p.after_step(snap(epoch=2, batch_size=128, lr=0.008)) is None


def test_schedule_lr_scale_with_an_explicit_rate_at_the_same_point_scales_it():
    p = Schedule(unit="step", lr=[(5, 0.3)], lr_scale=[(5, 0.5)])
    assert p.after_step(snap(step=5)).lr == pytest.approx(0.15)


def test_schedule_lr_scale_state_survives_a_restore():
    p = Schedule(unit="epoch", lr_scale=[(1, 0.1), (3, 0.1)])
    p.before_train(snap(step=0, epoch=0, batch_size=32, lr=0.02))
    d = p.before_epoch(snap(epoch=1, batch_size=32, lr=0.02))
    p.on_decision(d, snap())
    q = Schedule(unit="epoch", lr_scale=[(1, 0.1), (3, 0.1)])
    q.load_state_dict(p.state_dict())
    assert q.before_epoch(snap(epoch=2, batch_size=32, lr=0.002)) is None
    assert q.before_epoch(snap(epoch=3, batch_size=32, lr=0.002)).lr == pytest.approx(0.0002)


def test_schedule_lr_scale_on_a_batch_point_is_refused():
    with pytest.raises(ConfigurationError, match="--schedule-lr-scale and --schedule-batch"):
        Schedule(batch=[(5, 64)], lr_scale=[(5, 0.1)])


def test_schedule_lr_scale_through_the_engine_rescales_the_base():
    """The decayed rate becomes the base at the current batch, so a later batch change
    under the linear rule scales the decayed rate."""
    eng = PolicyEngine([Schedule(unit="step", lr_scale=[(10, 0.1)])], LRRule("linear", 0))
    s = snap(step=10, batch_size=256, lr=0.16, base_lr=0.02, base_batch_size=32)
    eng.decide("before_train", snap(step=0, batch_size=256, lr=0.16))
    plan = eng.plan(eng.decide("after_step", s), s, 0)
    assert plan.lr == pytest.approx(0.016)
    assert (plan.base_lr, plan.base_batch_size) == (pytest.approx(0.016), 256)
    after = snap(step=20, batch_size=256, lr=0.016, base_lr=0.016, base_batch_size=256)
    assert LRRule("linear").target(after, 512) == pytest.approx(0.032)

# -- learning-rate rules -------------------------------------------------------------------
@pytest.mark.parametrize("rule,expect", [("linear", 0.4), ("sqrt", 0.2), ("none", None)])
def test_lr_rules(rule, expect):
    d = LRRule(rule, 8).on_change(snap(batch_size=32), 128)
    if expect is None:
        assert d is None
    else:
        assert d.lr == pytest.approx(expect)


def test_adascale_gain_ratio():
    s = snap(grad_sq=1.0, trace_sigma=32.0 * 3.0)  # s2 = trS / B0 = 3, m2 = 1
    lr = LRRule("adascale").target(s, 128)  # scale 4: r = (3 + 1) / (3/4 + 1)
    assert lr == pytest.approx(0.1 * 4 / 1.75)
    # no usable estimate: r = 1
    assert LRRule("adascale").target(snap(grad_sq=float("nan")), 128) == pytest.approx(0.1)
    # no measurable signal (|G|^2 <= 0, clipped at 0 as AdaptDL does): every sample counts,
    # r = S = 4
    for g in (0.0, -0.5):
        s = snap(grad_sq=g, trace_sigma=32.0 * 3.0)
        assert LRRule("adascale").target(s, 128) == pytest.approx(0.1 * 4)


def test_ramp_follows_lin_et_al():
    r = Ramp(start_step=10, steps=8, start_lr=0.1, end_lr=0.4)  # k = 4
    assert r.lr_at(10) == pytest.approx(0.1)
    assert r.lr_at(14) == pytest.approx(0.1 * (1 + 4 / 8 * 3))
    assert r.lr_at(18) == pytest.approx(0.4) and r.done(18)


# -- the engine ---------------------------------------------------------------------------
class Fixed(Policy):
    name = "fixed"

    def __init__(self, **changes):
        self.changes = changes

    def after_step(self, s):
        return Decision(reason="fixed", **self.changes)


class Boom(Policy):
    name = "boom"

    def after_step(self, s):
        raise RuntimeError("policy bug")


class Reader(Policy):
    name = "reader"
    reads = ("noise_scale",)

    def after_step(self, s):
        return Decision(reason="read", batch_size=999)


def test_later_policy_wins_and_rule_follows_batch_change():
    eng = PolicyEngine([Fixed(batch_size=64), Fixed(batch_size=128)], LRRule("linear", 4))
    decisions = eng.decide("after_step", snap())
    plan = eng.plan(decisions, snap(), version=3)
    assert plan.batch_size == 128 and plan.version == 3 and plan.step == 100
    assert plan.ramp == (100, 4, 0.1, pytest.approx(0.4))
    assert Plan.from_json(plan.to_json()) == plan


def test_explicit_lr_beats_the_rule_and_becomes_base():
    eng = PolicyEngine([Fixed(batch_size=64, lr=0.05)], LRRule("linear", 4))
    plan = eng.plan(eng.decide("after_step", snap()), snap(), version=0)
    assert plan.lr == 0.05 and (plan.base_lr, plan.base_batch_size) == (0.05, 64)
    assert plan.ramp is None


def test_raising_policy_is_discarded_others_still_run(caplog):
    eng = PolicyEngine([Boom(), Fixed(momentum=0.5)])
    decisions = eng.decide("after_step", snap())
    assert [d.changes() for d in decisions] == [{"momentum": 0.5}]
    assert "policy bug" in caplog.text and "discarded" in caplog.text


def test_invalid_decision_is_discarded(caplog):
    eng = PolicyEngine([Fixed(batch_size=0), Fixed(lr=float("nan"))])
    assert eng.decide("after_step", snap()) == []
    assert "batch_size must be a positive integer" in caplog.text


def test_nan_metric_skips_the_policy(caplog):
    eng = PolicyEngine([Reader()])
    assert eng.decide("after_step", snap(noise_scale=float("nan"))) == []
    assert "skips step 100" in caplog.text
    assert eng.decide("after_step", snap())[0].batch_size == 999


# -- flags ---------------------------------------------------------------------------------
def parse_error(args, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(args)
    return capsys.readouterr().err


def test_policy_flags_parse_in_order():
    a = build_parser().parse_args(["--policy", "schedule", "--policy", "gns-batch",
                                   "--gns-batch-max", "512", "--schedule-batch", "0:16,100:32",
                                   "--lr-rule", "sqrt"])
    assert a.policy == ["schedule", "gns-batch"]
    assert a.gns_batch_max == 512 and a.schedule_batch == [(0, 16), (100, 32)]
    assert a.lr_rule == "sqrt"


@pytest.mark.parametrize("args,words", [
    (["--policy", "magic"], "invalid choice: 'magic'"),
    (["--gns-batch-min", "-3"], "--gns-batch-min"),
    (["--gns-batch-factor", "0.5"], "greater than 1.0"),
    (["--lr-rule", "cubic"], "none, linear, sqrt, adascale"),
    (["--schedule-batch", "10:32,5:64"], "points must increase"),
    (["--schedule-lr-scale", "7:-0.1"], "--schedule-lr-scale"),
])
def test_bad_policy_flags_name_the_flag_and_rule(capsys, args, words):
    assert words in parse_error(args, capsys)


def test_min_above_max_is_a_startup_error():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "hpcadapt.train", "--policy", "gns-batch",
                          "--gns-batch-min", "512", "--gns-batch-max", "64"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "--gns-batch-min (512) must not exceed --gns-batch-max (64)" in out.stderr


def test_help_lists_every_policy_and_flag_with_defaults():
    text = build_parser().format_help()
    for flag in ("--policy", "--gns-batch-min", "--gns-batch-max", "--gns-batch-factor",
                 "--gns-batch-cooldown", "--gns-batch-interval", "--schedule-batch",
                 "--schedule-lr", "--schedule-lr-scale", "--lr-rule", "--lr-ramp-steps"):
        assert flag in text
    assert "(default: 1024)" in text


# -- elastic policies ---------------------------------------------------------------------
from hpcadapt.policies import AutoScale, ResizeSchedule, Straggler  # noqa: E402
from hpcadapt.policies.autoscale import scaling_efficiency  # noqa: E402


def test_resize_schedule_waits_for_a_pending_grow_and_keeps_order():
    p = ResizeSchedule(steps=[(20, 4), (40, 1)])
    assert p.after_step(snap(step=19, world_size=2)) is None
    assert p.after_step(snap(step=20, world_size=2)).world_size == 4
    assert p.after_step(snap(step=45, world_size=2, resizing=True)) is None
    late = p.after_step(snap(step=46, world_size=4))
    assert late.world_size == 1
    # it says when it applied, not only when it was scheduled
    assert late.reason.startswith("scheduled at step 40, applied at step 46")


def test_resize_schedule_on_time_says_so():
    p = ResizeSchedule(steps=[(5, 2)])
    assert p.after_step(snap(step=5, world_size=1)).reason == "scheduled at step 5: 1 -> 2 workers"


def test_scaling_efficiency():
    assert scaling_efficiency(100.0, 2, 150.0, 3) == pytest.approx(1.0)  # +50 = one more worker's 50
    assert scaling_efficiency(100.0, 2, 110.0, 3) == pytest.approx(0.2)


def test_autoscale_probes_then_undoes_an_inefficient_step():
    p = AutoScale(step=1, interval=10, threshold=0.5, settle=0, backoff=100)
    for s in range(1, 10):
        assert p.after_step(snap(step=s, world_size=2, samples_per_s=100.0, max_workers=4)) is None
    grow = p.after_step(snap(step=10, world_size=2, samples_per_s=100.0, max_workers=4))
    assert grow.world_size == 3
    p.on_resize(snap(step=10, world_size=3), old_size=2, new_size=3)
    for s in range(11, 20):
        p.after_step(snap(step=s, world_size=3, samples_per_s=110.0, max_workers=4))
    undo = p.after_step(snap(step=20, world_size=3, samples_per_s=110.0, max_workers=4))
    assert undo.world_size == 2 and undo.metrics["scaling_efficiency"] == pytest.approx(0.2)
    p.on_resize(snap(step=20, world_size=2), old_size=3, new_size=2)
    for s in range(21, 40):  # backing off
        assert p.after_step(snap(step=s, world_size=2, samples_per_s=100.0, max_workers=4)) is None


def test_autoscale_keeps_growing_while_efficient_and_stops_at_capacity():
    p = AutoScale(step=1, interval=5, threshold=0.5, settle=0)
    for s in range(1, 5):
        p.after_step(snap(step=s, world_size=3, samples_per_s=150.0, max_workers=4))
    p.previous = {"k": 2.0, "rate": 100.0}
    d = p.after_step(snap(step=5, world_size=3, samples_per_s=150.0, max_workers=4))
    assert d.world_size == 4
    for s in range(6, 10):
        p.after_step(snap(step=s, world_size=4, samples_per_s=200.0, max_workers=4))
    p.previous = {"k": 3.0, "rate": 150.0}
    assert p.after_step(snap(step=10, world_size=4, samples_per_s=200.0, max_workers=4)) is None


def test_straggler_detected_after_patience_then_replaced():
    p = Straggler(factor=1.5, patience=3, action="replace")
    slow = dict(world_size=3, compute_time=(0.10, 0.11, 0.30))
    assert p.after_step(snap(step=1, **slow)) is None
    assert p.after_step(snap(step=2, **slow)) is None
    d = p.after_step(snap(step=3, **slow))
    assert (d.world_size, d.remove_rank) == (2, 2)
    back = p.on_resize(snap(step=3, world_size=2), old_size=3, new_size=2)
    assert back.world_size == 3


def test_straggler_streak_resets_and_rank_0_stays(caplog):
    p = Straggler(factor=1.5, patience=2, action="remove")
    p.after_step(snap(step=1, world_size=2, compute_time=(0.1, 0.3)))
    p.after_step(snap(step=2, world_size=2, compute_time=(0.1, 0.1)))  # recovered
    assert p.after_step(snap(step=3, world_size=2, compute_time=(0.1, 0.3))) is None
    p.after_step(snap(step=4, world_size=2, compute_time=(0.5, 0.1)))
    assert p.after_step(snap(step=5, world_size=2, compute_time=(0.5, 0.1))) is None
    assert "rank 0 is a straggler" in caplog.text


def test_keep_local_batch_across_resize_triggers_the_lr_rule():
    eng = PolicyEngine([], LRRule("linear", 0), resize_batch="keep-local")
    s = snap(batch_size=32, world_size=4)
    plan = eng.plan(eng.decide("on_resize", s, old_size=2, new_size=4), s, version=1)
    assert plan.batch_size == 64 and plan.ramp[3] == pytest.approx(0.2)


def test_remove_rank_must_name_a_non_zero_rank():
    with pytest.raises(ConfigurationError, match="remove_rank"):
        Decision(reason="x", world_size=2, remove_rank=0).validate()


def test_a_plan_that_cannot_be_applied_is_refused_whole():
    with pytest.raises(ConfigurationError, match="batch_size must be a positive integer"):
        Plan.from_json(Plan(version=0, step=1, batch_size=0, lr=0.1).to_json())
    with pytest.raises(ConfigurationError, match="lr must be positive and finite"):
        Plan(version=0, step=1, lr=float("nan")).validate()
    with pytest.raises(ConfigurationError, match="JSON object"):
        Plan.from_json("[1, 2]")
