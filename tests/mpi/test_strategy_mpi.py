"""Model averaging in the data-parallel optimizer, on real MPI ranks (any size >= 2):
replicas that start apart are pulled together exactly as each strategy says, the control
values still reach every rank when gradients stay local, and a monitored step averages the
gradients whatever the strategy."""

import numpy as np
import pytest
import torch

import hpcadapt
from hpcadapt.parallel.optimizer import DistributedOptimizer
from hpcadapt.base.strategies import strategy as make_strategy

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def w():
    return hpcadapt.init()


def _setup(w, strategy, lr=0.0):
    """A linear model whose weights differ per rank (no initial broadcast)."""
    torch.manual_seed(1000 + w.rank)
    model = torch.nn.Linear(6, 3)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                               model.named_parameters(), world=w, extra_slots=2,
                               broadcast_initial_state=False)
    opt.set_strategy(strategy)
    return model, opt


def _all(w, model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    out = np.empty((w.size, flat.size), dtype=flat.dtype)
    w.comm.Allgather(flat, out)
    return flat, out


def _step(w, model, opt, step, extras=(1.0, 2.0)):
    opt.zero_grad()
    opt.begin_step(step)
    opt.stage_extras([e * (w.rank + 1) for e in extras])
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step * 100 + w.rank))
    model(x).pow(2).mean().backward()
    stats = opt.synchronize()
    opt.step()
    return stats


def test_sma_pulls_each_replica_alpha_of_the_way_to_the_average(w):
    model, opt = _setup(w, make_strategy("sma", sma_alpha=0.25))
    before, everyone = _all(w, model)
    stats = _step(w, model, opt, 0)
    after, _ = _all(w, model)
    expected = 0.75 * before + 0.25 * everyone.mean(axis=0)
    assert np.allclose(after, expected, rtol=1e-6, atol=1e-7)
    # the control values rode their own reduction: the sums over ranks
    n = w.size
    assert np.allclose(stats.extras, [n * (n + 1) / 2, n * (n + 1)])


def test_local_sgd_averages_after_every_period_th_update(w):
    """As the job runs it: local updates, and after the update of every third step the
    plain average, after which the replicas are one (lr > 0: their updates differ)."""
    strategy = make_strategy("local-sgd", period=3)
    model, opt = _setup(w, strategy, lr=0.1)
    _, start_all = _all(w, model)
    for step in range(3):
        _step(w, model, opt, step)
        if step < 2:
            _, everyone = _all(w, model)
            assert not np.allclose(everyone[0], everyone[1])  # apart between averages
        if strategy.averages_after(step):
            before, before_all = _all(w, model)
            opt.average_models()
    _, everyone = _all(w, model)
    assert step == 2 and np.array_equal(everyone, np.broadcast_to(everyone[0], everyone.shape))
    assert np.allclose(everyone[0], before_all.mean(axis=0), rtol=1e-6, atol=1e-7)


def test_local_gradients_stay_local_unless_the_step_is_monitored(w):
    model, opt = _setup(w, make_strategy("sma", sma_alpha=1.0), lr=0.1)
    opt.average_models()  # one model everywhere: the gradients differ by data only
    _step(w, model, opt, 0)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
    out = np.empty((w.size, grads.size), dtype=grads.dtype)
    w.comm.Allgather(grads, out)
    assert not np.allclose(out[0], out[1])  # each rank's own gradient
    opt.track_grad_norms = True             # a monitored step: averaged, norms measured
    stats = _step(w, model, opt, 1)
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
    w.comm.Allgather(grads, out)
    assert np.allclose(out, out[0], atol=1e-7) and stats.global_sqnorm > 0


def test_ssgd_is_unchanged(w):
    model, opt = _setup(w, make_strategy("ssgd"), lr=0.1)
    opt.average_models()
    _step(w, model, opt, 0)
    _, everyone = _all(w, model)
    assert np.allclose(everyone, everyone[0], atol=1e-7)


@pytest.mark.parametrize("topology,ranks_per_node", [
    ("ring", None), ("tree", None), ("hierarchical", 2), ("hierarchical", None)])
def test_a_topology_switch_averages_the_gradients_as_flat_does(w, topology, ranks_per_node):
    """Whole-number gradients (input x, loss sum(W x)) with shares 1/size: every sum is
    exact, so each topology's average is bit-identical to flat's; between steps the switch
    rebuilds the communicators (collective) and training goes on."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4, bias=False)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                               model.named_parameters(), world=w)
    x = torch.arange(16, dtype=torch.float32).reshape(2, 8) + w.rank

    def averaged():
        opt.zero_grad()
        opt.begin_step(0)
        model(x).sum().backward()
        opt.synchronize()
        opt.step()
        return model.weight.grad.clone()

    flat = averaged()
    opt.set_topology(topology, ranks_per_node)
    other = averaged()
    assert opt.topology == topology and torch.equal(flat, other)
    # on random floats the sums are added in another order: equal within rounding
    xs = torch.randn(2, 8, generator=torch.Generator().manual_seed(w.rank))
    opt.zero_grad(); opt.begin_step(1); model(xs).sum().backward(); opt.synchronize()
    theirs = model.weight.grad.clone()
    opt.set_topology("flat", None)
    opt.zero_grad(); opt.begin_step(2); model(xs).sum().backward(); opt.synchronize()
    assert torch.allclose(theirs, model.weight.grad, rtol=1e-5, atol=1e-6)
