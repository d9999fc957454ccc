"""Synchronisation strategies as values, the plan that carries a switch, and the sync-switch
policy's decisions: pure functions, no MPI."""

import math

import pytest

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.base.plan import Plan
from hpcadapt.policies import SyncSwitch
from hpcadapt.policies.base import MetricsSnapshot
from hpcadapt.base.strategies import STRATEGIES, Strategy, strategy


def test_which_steps_average_what():
    assert strategy("ssgd").averages_gradients and strategy("ssgd").model_alpha(3) is None
    sma = strategy("sma", sma_alpha=0.25)
    assert not sma.averages_gradients and all(sma.model_alpha(s) == 0.25 for s in range(5))
    local = strategy("local-sgd", period=4)
    assert all(local.model_alpha(s) is None for s in range(8))
    assert [local.averages_after(s) for s in range(8)] == [False, False, False, True] * 2
    assert not sma.averages_after(3) and not strategy("ssgd").averages_after(3)


@pytest.mark.parametrize("kwargs,needle", [
    ({"name": "pair"}, "unknown strategy 'pair'; choose from ssgd, sma, local-sgd"),
    ({"name": "sma", "sma_alpha": 0.0}, "--sma-alpha 0.0 is outside (0, 1]"),
    ({"name": "sma", "sma_alpha": 1.5}, "--sma-alpha 1.5 is outside (0, 1]"),
    ({"name": "sma", "sma_alpha": math.nan}, "--sma-alpha nan"),
    ({"name": "local-sgd", "period": 0}, "--local-sgd-period 0"),
])
def test_bad_settings_are_refused_with_the_value_and_the_choices(kwargs, needle):
    with pytest.raises(ConfigurationError, match=None) as err:
        strategy(**kwargs)
    assert needle in str(err.value)


def test_a_plan_carries_a_strategy_through_json_and_refuses_a_bad_one():
    plan = Plan(version=3, step=10, strategy=strategy("sma", sma_alpha=0.5).to_dict())
    again = Plan.from_json(plan.to_json())
    assert Strategy.from_dict(again.strategy) == strategy("sma", sma_alpha=0.5) and not again.empty
    with pytest.raises(ConfigurationError, match="unknown strategy"):
        Plan.from_json(Plan(version=3, step=10, strategy={"name": "x"}).to_json())
    with pytest.raises(ConfigurationError, match="unknown strategy settings"):
        Strategy.from_dict({"name": "sma", "alpha": 0.2})


def _snap(step, strategy="sma", world_size=2, noise_scale=math.nan, monitored=False):
    return MetricsSnapshot(step=step, epoch=0, world_size=world_size, batch_size=32, lr=0.1,
                           momentum=0.9, base_lr=0.1, base_batch_size=32,
                           noise_scale=noise_scale, monitored=monitored, strategy=strategy)


def test_sync_switch_follows_its_schedule_in_order_and_once():
    p = SyncSwitch(steps=[(10, "ssgd"), (20, "sma")])
    assert p.after_step(_snap(9)) is None
    d = p.after_step(_snap(10))
    assert d.strategy["name"] == "ssgd" and "scheduled at step 10" in d.reason
    assert p.after_step(_snap(15, "ssgd")) is None
    assert p.after_step(_snap(21, "ssgd")).strategy["name"] == "sma"
    assert p.after_step(_snap(30, "sma")) is None
    d.validate()


def test_sync_switch_on_the_noise_scale_and_the_world_size_fires_once():
    p = SyncSwitch(noise_scale=500.0, to="ssgd")
    assert p.requires == ("gns",) and "noise_scale" in p.reads
    assert p.after_step(_snap(5, noise_scale=400.0, monitored=True)) is None
    assert p.after_step(_snap(6, noise_scale=900.0, monitored=False)) is None  # not measured
    d = p.after_step(_snap(10, noise_scale=600.0, monitored=True))
    assert d.strategy["name"] == "ssgd" and d.metrics == {"noise_scale": 600.0}
    assert p.after_step(_snap(20, "sma", noise_scale=900.0, monitored=True)) is None
    w = SyncSwitch(workers=4, to="local-sgd", period=5)
    assert w.requires == () and "noise_scale" not in w.reads
    assert w.after_step(_snap(1, "ssgd", world_size=2)) is None
    d = w.after_step(_snap(2, "ssgd", world_size=4))
    assert Strategy.from_dict(d.strategy) == strategy("local-sgd", period=5)


def test_sync_switch_needs_a_trigger_and_usable_settings():
    with pytest.raises(ConfigurationError, match="needs a trigger"):
        SyncSwitch()
    with pytest.raises(ConfigurationError, match="--sma-alpha 2"):
        SyncSwitch(steps=[(5, "sma")], sma_alpha=2.0)
    assert set(STRATEGIES) == {"ssgd", "sma", "local-sgd", "pair-avg", "bounded-delay"}


def test_sync_switch_state_round_trips():
    p = SyncSwitch(steps=[(1, "ssgd")], workers=3)
    p.after_step(_snap(1))
    q = SyncSwitch(steps=[(1, "ssgd")], workers=3)
    q.load_state_dict(p.state_dict())
    assert q.after_step(_snap(2, "ssgd")) is None and q.next == 1


def test_bounded_delay_settings_are_checked_and_travel():
    s = strategy("bounded-delay", max_delay=0, round_steps=3)
    assert s.asynchronous and not s.averages_gradients and s.min_workers == 2
    assert Strategy.from_dict(s.to_dict()) == s
    assert Strategy.from_dict({"name": "sma", "sma_alpha": 0.2}) == strategy("sma", sma_alpha=0.2)
    with pytest.raises(ConfigurationError, match="--max-delay -1"):
        strategy("bounded-delay", max_delay=-1)
    with pytest.raises(ConfigurationError, match="--async-round-steps 0"):
        strategy("bounded-delay", round_steps=0)
    assert "max delay 0" in s.describe()


def test_every_strategy_names_itself_and_is_public():
    import hpcadapt

    assert hpcadapt.Strategy is Strategy
    for name in STRATEGIES:
        assert strategy(name).describe().startswith(name)


def test_strategy_flags_that_do_nothing_are_named():
    from hpcadapt.args import warn_unused_policy_flags
    from hpcadapt.train import build_parser

    parse = build_parser().parse_args
    assert warn_unused_policy_flags(parse(["--max-delay", "3"])) == [
        "--max-delay given without --strategy bounded-delay: ignored"]
    assert warn_unused_policy_flags(parse(["--strategy", "bounded-delay", "--max-delay", "3",
                                           "--async-round-steps", "5"])) == []
    assert any("--slow-comm given without --slow-rank" in m
               for m in warn_unused_policy_flags(parse(["--slow-comm", "2"])))
    s = SyncSwitch(steps=[(5, "bounded-delay")], max_delay=3, round_steps=7)
    d = s.after_step(_snap(5))
    assert Strategy.from_dict(d.strategy) == strategy("bounded-delay", max_delay=3,
                                                      round_steps=7)


def test_a_registered_strategy_is_a_full_citizen_and_clashes_are_refused():
    """tests/scripts/sparse_sma_strategy.py registers a strategy from outside the package:
    the parser offers it and its flags, plans and checkpoint records (to_dict/from_dict)
    carry it, sync-switch takes it, the options build it; a second class under a taken name
    or flag is refused."""
    import importlib.util
    import os
    from dataclasses import dataclass

    from hpcadapt.base.options import JobOptions
    from hpcadapt.base.strategies import Setting, from_options, register_strategy
    from hpcadapt.train import build_parser

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts",
                        "sparse_sma_strategy.py")
    spec = importlib.util.spec_from_file_location("sparse_sma_strategy", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        s = strategy("sparse-sma", every=2, alpha=0.25)
        assert [s.model_alpha(k) for k in range(4)] == [0.25, None, 0.25, None]
        assert Strategy.from_dict(Plan.from_json(Plan(version=1, step=1, strategy=s.to_dict())
                                                 .to_json()).strategy) == s
        args = build_parser().parse_args(["--strategy", "sparse-sma", "--sparse-sma-every", "5"])
        assert from_options(JobOptions.from_args(args).steps) == strategy("sparse-sma", every=5)
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--strategy", "sparse-sma", "--sparse-sma-every", "0"])
        d = SyncSwitch(steps=[(3, "sparse-sma")]).after_step(_snap(3, "ssgd"))
        assert Strategy.from_dict(d.strategy) == strategy("sparse-sma")
        with pytest.raises(ConfigurationError, match="has no setting"):
            strategy("sparse-sma", period=3)

        @dataclass(frozen=True)
        class Twin(Strategy):
            name = "sparse-sma"

        @dataclass(frozen=True)
        class Thief(Strategy):
            name = "thief"
            settings = (Setting("x", "--sma-alpha", float, "taken"),)
            x: float = 1.0

        with pytest.raises(ConfigurationError, match="registered already"):
            register_strategy(Twin)
        with pytest.raises(ConfigurationError, match="--sma-alpha belong"):
            register_strategy(Thief)
    finally:
        STRATEGIES.pop("sparse-sma", None)


def test_keyword_overrides_win_over_flags_and_unregistered_strategies_are_refused():
    """Found by review: ``Job(args, sma_alpha=0.3)`` kept the flag's 0.1; the base class (or a
    class never registered) would have trained without combining the replicas."""
    from dataclasses import dataclass

    import hpcadapt
    from hpcadapt.base.options import JobOptions
    from hpcadapt.base.strategies import Setting, from_options, register_strategy
    from hpcadapt.train import build_parser

    args = build_parser().parse_args(["--strategy", "sma", "--sma-alpha", "0.2"])
    assert from_options(JobOptions.from_args(args).steps) == strategy("sma", sma_alpha=0.2)
    assert from_options(JobOptions.from_args(args, sma_alpha=0.3).steps) == strategy("sma",
                                                                               sma_alpha=0.3)
    assert from_options(JobOptions.from_args(args, strategy="local-sgd",
                                             local_sgd_period=3).steps) == strategy("local-sgd",
                                                                              period=3)
    assert from_options(JobOptions.of(strategy=strategy("local-sgd", period=2)).steps).period == 2
    # the whole options are read through their step group (not a silent default ssgd)
    assert from_options(JobOptions.of(strategy="local-sgd", local_sgd_period=3)) == strategy(
        "local-sgd", period=3)
    assert hpcadapt.strategy is strategy and hpcadapt.register_strategy is register_strategy

    @dataclass(frozen=True)
    class Unregistered(Strategy):
        name = "unregistered"

    for bad in (Strategy(), Unregistered()):
        with pytest.raises(ConfigurationError, match="is not a registered strategy"):
            from_options(JobOptions.of(strategy=bad).steps)

    @dataclass(frozen=True)
    class NoDefault(Strategy):
        name = "no-default"
        settings = (Setting("k", "--no-default-k", int, "k"),)

    with pytest.raises(ConfigurationError, match="needs a field of that name with a default"):
        register_strategy(NoDefault)
    assert "no-default" not in STRATEGIES


def test_a_checkpoint_of_the_flat_form_still_reads():
    flat = {"name": "sma", "sma_alpha": 0.2, "period": 8, "max_delay": 1, "round_steps": 50}
    assert Strategy.from_dict(flat) == strategy("sma", sma_alpha=0.2)
    assert Strategy.from_dict(dict(flat, name="bounded-delay")) == strategy(
        "bounded-delay", max_delay=1, round_steps=50)


def test_sync_switch_refuses_any_setting_out_of_range_whatever_it_switches_to():
    with pytest.raises(ConfigurationError, match="--sma-alpha 1.5"):
        SyncSwitch(workers=4, to="ssgd", sma_alpha=1.5)
