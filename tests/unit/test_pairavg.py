"""Pair averaging's peer choice: a pure function, never the rank itself, the same in every
run, and uniform over the other ranks."""

from collections import Counter

import pytest

from hpcadapt.parallel.pairavg import choose_peer


@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_the_peer_is_another_rank_drawn_uniformly_and_reproducibly(size):
    steps = 4000
    for rank in range(size):
        counts = Counter(choose_peer(s, rank, size) for s in range(steps))
        assert rank not in counts and set(counts) == set(range(size)) - {rank}
        expected = steps / (size - 1)
        # binomial spread: 5 standard deviations
        sd = (steps * (1 / (size - 1)) * (1 - 1 / (size - 1))) ** 0.5
        assert all(abs(c - expected) <= 5 * sd + 1e-9 for c in counts.values()), counts
    assert [choose_peer(s, 1, 5) for s in range(50)] == [choose_peer(s, 1, 5) for s in range(50)]


def test_one_rank_has_no_peer():
    with pytest.raises(ValueError, match="2 or more"):
        choose_peer(0, 0, 1)
