"""Pair averaging on real MPI ranks (any size >= 2): one step mixes in exactly the chosen
peer's model before the local update, a fetch completes while its peer computes without
making any MPI call, a fetch returns one whole publication, and the window follows the
world (rebuilt when the cluster version changes, freed when the strategy leaves)."""

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import hpcadapt
from hpcadapt.parallel.pairavg import PairExchange, choose_peer
from hpcadapt.parallel.optimizer import DistributedOptimizer
from hpcadapt.base.strategies import strategy

pytestmark = pytest.mark.mpi(min_size=2)

DEADLINE_S = 60.0  # a failure bound, not a measurement: the fetch takes milliseconds


@pytest.fixture(scope="module")
def w():
    return hpcadapt.init()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _gather(w, flat):
    out = np.empty((w.size, flat.size), dtype=flat.dtype)
    w.comm.Allgather(flat, out)
    return out


def test_one_step_is_the_mean_with_the_chosen_peer_then_the_local_gradient(w):
    torch.manual_seed(2000 + w.rank)  # replicas that differ (no initial broadcast)
    model = torch.nn.Linear(5, 3)
    lr = 0.1
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                               model.named_parameters(), world=w, extra_slots=1,
                               broadcast_initial_state=False)
    opt.set_strategy(strategy("pair-avg"))
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(7 + w.rank))
    # the local gradient at the un-mixed parameters, on a copy
    twin = torch.nn.Linear(5, 3)
    twin.load_state_dict(model.state_dict())
    twin(x).pow(2).mean().backward()
    grad = torch.cat([p.grad.reshape(-1) for p in twin.parameters()]).numpy()
    everyone = _gather(w, _flat(model))
    for step in (3, 4):
        if step == 4:
            # A peer publishes at its own begin_step: a fetch may find its previous
            # version. A new cluster version makes a new window, whose first publication
            # every rank waits for: the peer's version is known.
            w.bump_version()
        opt.zero_grad()
        opt.begin_step(step)
        opt.stage_extras([float(w.rank + 1)])
        model(x).pow(2).mean().backward()
        stats = opt.synchronize()
        opt.step()
        peer = choose_peer(step, w.rank, w.size)
        assert peer != w.rank and opt._pairs.peer == peer
        assert stats.extras[0] == w.size * (w.size + 1) / 2  # control values still summed
        after = _flat(model)
        expected = (everyone[w.rank] + everyone[peer]) / 2 - lr * grad
        assert np.allclose(after, expected, rtol=1e-6, atol=1e-7), (step, peer)
        everyone = _gather(w, after)
        twin.load_state_dict(model.state_dict())
        twin.zero_grad()
        twin(x).pow(2).mean().backward()
        grad = torch.cat([p.grad.reshape(-1) for p in twin.parameters()]).numpy()
    # leaving pair-avg frees the window, on every rank at the same step
    opt.set_strategy(strategy("ssgd"))
    opt.zero_grad()
    opt.begin_step(5)
    assert opt._pairs is None and opt._release_pairs not in w.releases


def _shared_dir(w):
    path = tempfile.mkdtemp(prefix="pairavg-") if w.rank == 0 else None
    return Path(w.comm.bcast(path, root=0))


def _spin_until(path: Path) -> bool:
    """Pure Python, no MPI call: busy until ``path`` exists or the deadline passes."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < DEADLINE_S:
        if path.exists():
            return True
    return False


def test_a_fetch_completes_while_the_peer_computes_without_mpi_calls(w):
    """Even ranks fetch from the next odd one, which spins in pure Python (no MPI call, so
    no MPI progress) from before the fetch starts until the fetcher says it is done."""
    d = _shared_dir(w)
    n = 1 << 18
    mine = [torch.full((n,), float(w.rank)), torch.arange(7, dtype=torch.float64) + w.rank]
    pairs = PairExchange(w, mine)
    pairs.publish(mine)
    w.comm.Barrier()
    fetcher = w.rank % 2 == 0 and w.rank + 1 < w.size
    ok = True
    if fetcher:
        peer = w.rank + 1
        assert _spin_until(d / f"spinning-{peer}"), "the peer never started spinning"
        pairs.start_fetch(peer)
        theirs = pairs.finish_fetch()
        (d / f"fetched-{peer}").write_text("done")
        ok = bool((theirs[0].view(torch.float32) == peer).all()
                  and torch.equal(theirs[1].view(torch.float64),
                                  torch.arange(7, dtype=torch.float64) + peer))
    elif w.rank % 2 == 1:
        (d / f"spinning-{w.rank}").write_text("busy")
        ok = _spin_until(d / f"fetched-{w.rank}")  # False: the fetch waited for us
    results = w.comm.allgather(ok)
    pairs.free()
    if w.rank == 0:
        shutil.rmtree(d)
    assert all(results), results


def test_a_fetch_returns_one_whole_publication_the_newest_when_overrun(w):
    """The owner publishes twice between the fetch's start and its end: the read started
    on a slot that was written again, so it reads again and returns the newest, whole."""
    n = 1 << 16
    pairs = PairExchange(w, [torch.zeros(n)])
    pairs.publish([torch.full((n,), 100.0 + w.rank)])
    w.comm.Barrier()
    peer = (w.rank + 1) % w.size
    pairs.start_fetch(peer)
    w.comm.Barrier()
    for k in (1, 2):
        pairs.publish([torch.full((n,), 100.0 * (k + 1) + w.rank)])
    w.comm.Barrier()
    theirs = pairs.finish_fetch()[0].view(torch.float32)
    w.comm.Barrier()
    pairs.free()
    assert bool((theirs == 300.0 + peer).all()), theirs[:4]


def test_the_window_follows_the_cluster_version(w):
    torch.manual_seed(3000 + w.rank)
    model = torch.nn.Linear(3, 2)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                               model.named_parameters(), world=w,
                               broadcast_initial_state=False)
    opt.set_strategy(strategy("pair-avg"))

    def step(i):
        opt.zero_grad()
        opt.begin_step(i)
        model(torch.ones(1, 3)).sum().backward()
        opt.synchronize()
        opt.step()

    step(0)
    first = opt._pairs
    assert first.cluster_version == w.cluster_version
    w.bump_version()  # as a strategy or topology switch does, on every rank
    step(1)
    assert opt._pairs is not first and opt._pairs.cluster_version == w.cluster_version
    assert first._win is None  # the old one was freed
    opt._release_pairs(abandon=False)
    assert opt._release_pairs not in w.releases
