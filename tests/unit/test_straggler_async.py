"""The straggler-async policy's decisions, from snapshots: a rank slower than factor x the
others for patience checks switches to bounded delay (the aggregator, which trains nothing
in a round, is left out of the comparison); no straggler for patience rounds switches back
to the strategy it left; rank 0 as the straggler keeps the job asynchronous; its state
survives a coordinator change; bad settings are refused in one line."""

import logging

import pytest

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.policies import MetricsSnapshot, POLICIES
from hpcadapt.policies.straggler_async import StragglerAsync
from hpcadapt.base.strategies import Strategy, strategy


def snap(times, samples=None, strategy="ssgd", step=10):
    return MetricsSnapshot(step=step, epoch=0, world_size=len(times), batch_size=32, lr=0.1,
                           momentum=0.9, base_lr=0.1, base_batch_size=32,
                           compute_time=tuple(times),
                           rank_samples=tuple(samples or [8.0] * len(times)),
                           strategy=strategy)


def test_a_persistent_straggler_switches_to_bounded_delay_and_back_when_it_goes():
    p = StragglerAsync(factor=1.5, patience=3, max_delay=2, round_steps=10)
    slow = [0.01, 0.01, 0.04]
    assert p.after_step(snap(slow)) is None
    assert p.after_step(snap([0.01, 0.01, 0.01])) is None  # the streak breaks
    assert p.after_step(snap(slow)) is None
    assert p.after_step(snap(slow)) is None
    d = p.after_step(snap(slow))
    assert d is not None and "rank 2" in d.reason
    assert Strategy.from_dict(d.strategy) == strategy("bounded-delay", max_delay=2,
                                                      round_steps=10)
    # asynchronous: rank 0 aggregates (no samples, no compute) and is left out
    fast_round = snap([0.0, 0.02, 0.021], samples=[0, 40, 40], strategy="bounded-delay")
    slow_round = snap([0.0, 0.02, 0.08], samples=[0, 40, 40], strategy="bounded-delay")
    assert p.after_step(slow_round) is None
    assert p.after_step(fast_round) is None
    assert p.after_step(fast_round) is None
    d = p.after_step(fast_round)
    assert d is not None and Strategy.from_dict(d.strategy).name == "ssgd"
    assert p.after_step(fast_round) is None  # once


def test_the_strategy_it_left_is_the_one_it_goes_back_to():
    p = StragglerAsync(patience=1)
    d = p.after_step(snap([0.01, 0.01, 0.05], strategy="sma"))
    assert Strategy.from_dict(d.strategy).name == "bounded-delay"
    d = p.after_step(snap([0.0, 0.02, 0.02], samples=[0, 30, 30], strategy="bounded-delay"))
    assert Strategy.from_dict(d.strategy).name == "sma"


def test_two_ranks_switch_only_for_a_slow_rank_0_and_never_flip_back(caplog):
    p = StragglerAsync(patience=1)
    with caplog.at_level(logging.INFO, logger="hpcadapt.policies.straggler_async"):
        for _ in range(3):  # rank 1 slow: bounded delay would leave it training alone
            assert p.after_step(snap([0.01, 0.05])) is None
    assert sum("with 2 ranks" in r.getMessage() for r in caplog.records) == 1  # said once
    d = p.after_step(snap([0.05, 0.01]))
    assert d is not None and "rank 0" in d.reason
    q = StragglerAsync(patience=1)
    q.left, q.straggler = "ssgd", 1  # as if switched: one worker trains, no evidence
    for _ in range(3):
        assert q.after_step(snap([0.0, 0.02], samples=[0, 30], strategy="bounded-delay")) \
            is None


def test_rank_0_as_the_straggler_stays_asynchronous():
    p = StragglerAsync(patience=1)
    assert p.after_step(snap([0.05, 0.01, 0.01])) is not None
    for _ in range(5):
        assert p.after_step(snap([0.0, 0.01, 0.01], samples=[0, 30, 30],
                                 strategy="bounded-delay")) is None


def test_a_job_asynchronous_from_the_start_is_left_so():
    p = StragglerAsync(patience=1)
    for _ in range(3):
        assert p.after_step(snap([0.0, 0.01, 0.01], samples=[0, 30, 30],
                                 strategy="bounded-delay")) is None


def test_state_travels_to_a_new_coordinator():
    p = StragglerAsync(patience=1)
    p.after_step(snap([0.01, 0.01, 0.05]))
    q = StragglerAsync(patience=1)
    q.load_state_dict(p.state_dict())
    d = q.after_step(snap([0.0, 0.02, 0.02], samples=[0, 30, 30], strategy="bounded-delay"))
    assert Strategy.from_dict(d.strategy).name == "ssgd"


def test_registered_and_bad_settings_refused():
    assert POLICIES["straggler-async"] is StragglerAsync
    with pytest.raises(ConfigurationError, match="--max-delay"):
        StragglerAsync(max_delay=-1)
    with pytest.raises(ConfigurationError, match="--async-round-steps"):
        StragglerAsync(round_steps=0)
