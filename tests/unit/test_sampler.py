import numpy as np
import pytest

from hpcadapt import ConfigurationError, ElasticSampler


def consume(sampler, schedule):
    """Run one epoch, changing (batch, world size) at the given steps; return all indices
    every rank trained on, and the per-step shares."""
    seen = []
    step = 0
    batch, size = schedule[0]
    while not sampler.epoch_done:
        if step in schedule:
            batch, size = schedule[step]
        parts = [sampler.peek(batch, r, size) for r in range(size)]
        assert sum(len(p.indices) for p in parts) == parts[0].global_count
        assert abs(sum(p.weight for p in parts) - 1.0) < 1e-12
        for p in parts:
            seen.extend(p.indices.tolist())
        sampler.advance(parts[0].global_count)
        step += 1
    return seen


@pytest.mark.parametrize("schedule", [
    {0: (32, 2)},
    {0: (10, 3), 5: (64, 3), 9: (7, 4)},
    {0: (16, 2), 3: (16, 4), 6: (48, 3), 10: (5, 1), 12: (100, 2)},
])
def test_every_sample_exactly_once_across_batch_and_world_changes(schedule):
    s = ElasticSampler(1000, seed=3)
    seen = consume(s, schedule)
    assert sorted(seen) == list(range(1000))


def test_epochs_are_different_permutations_and_reproducible():
    a, b = ElasticSampler(50, seed=1), ElasticSampler(50, seed=1)
    first = a.peek(50, 0, 1).indices.copy()
    a.set_epoch(1)
    second = a.peek(50, 0, 1).indices
    assert sorted(first) == sorted(second) and not np.array_equal(first, second)
    assert np.array_equal(first, b.peek(50, 0, 1).indices)


def test_state_round_trip_resumes_at_the_cursor():
    s = ElasticSampler(100, seed=7)
    s.set_epoch(2)
    s.advance(s.peek(30, 0, 1).global_count)
    t = ElasticSampler(100, seed=0)
    t.load_state_dict(s.state_dict())
    assert t.epoch == 2 and t.cursor == 30
    assert np.array_equal(t.peek(20, 1, 2).indices, s.peek(20, 1, 2).indices)


def test_tail_smaller_than_world_gives_empty_shares():
    s = ElasticSampler(5)
    s.advance(4)
    parts = [s.peek(8, r, 3) for r in range(3)]
    assert [len(p.indices) for p in parts] == [1, 0, 0]
    assert parts[1].weight == 0.0


@pytest.mark.parametrize("bad", [0, -4])
def test_bad_batch_rejected(bad):
    with pytest.raises(ConfigurationError, match="positive"):
        ElasticSampler(10).peek(bad, 0, 1)


def test_overrun_rejected_and_cursor_kept():
    s = ElasticSampler(10)
    with pytest.raises(ConfigurationError, match="remain"):
        s.advance(11)
    assert s.cursor == 0
