"""The data-parallel optimizer on real MPI ranks."""

import numpy as np
import pytest
import torch
from torch import nn

import hpcadapt
from hpcadapt import CommunicationError, DistributedOptimizer
from hpcadapt.models import build_model

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def w():
    return hpcadapt.init()


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def gathered_equal(w, vec):
    all_vecs = hpcadapt.allgather(vec.double().numpy())
    return all(np.array_equal(all_vecs[0], v) for v in all_vecs)


def test_initial_state_broadcast_from_rank_0(w):
    model = build_model("cnn", (1, 8, 8), 10, seed=100 + w.rank)  # different on purpose
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               model.named_parameters(), world=w)
    assert gathered_equal(w, flat_params(model))
    opt.remove_hooks()


@pytest.mark.parametrize("bucket_bytes", [512, 1 << 22])
def test_gradient_is_the_weighted_average_and_replicas_stay_identical(w, bucket_bytes):
    torch.manual_seed(0)
    x_all = torch.randn(37, 1, 8, 8)  # uneven split on purpose
    y_all = torch.randint(0, 10, (37,))
    model = build_model("cnn", (1, 8, 8), 10, seed=1)
    reference = build_model("cnn", (1, 8, 8), 10, seed=1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               model.named_parameters(), world=w, bucket_bytes=bucket_bytes)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    sampler = hpcadapt.ElasticSampler(37, shuffle=False)
    for _ in range(3):
        sampler.set_epoch(0)
        part = sampler.peek(37, w.rank, w.size)
        idx = torch.from_numpy(part.indices)
        opt.zero_grad()
        opt.set_local_weight(part.weight)
        nn.functional.cross_entropy(model(x_all[idx]), y_all[idx]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.cross_entropy(reference(x_all), y_all).backward()
        ref_opt.step()
    assert torch.allclose(flat_params(model), flat_params(reference), atol=1e-5)
    assert gathered_equal(w, flat_params(model))
    opt.remove_hooks()


def test_gradient_statistics_travel_in_the_control_reduction(w):
    model = nn.Linear(5, 1, bias=False)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                               model.named_parameters(), world=w, extra_slots=2,
                               track_grad_norms=True)
    with torch.no_grad():
        model.weight.zero_()
    opt.zero_grad()
    opt.stage_extras([1.0, float(w.rank)])
    # loss = (w . x) with x = (rank+1) * ones: local gradient is (rank+1) * ones(5)
    (model(torch.full((1, 5), float(w.rank + 1)))).sum().backward()
    stats = opt.synchronize()
    n = w.size
    mean_local = sum(5 * (r + 1) ** 2 for r in range(n)) / n
    avg = sum(r + 1 for r in range(n)) / n
    assert stats.local_sqnorm_mean == pytest.approx(mean_local)
    assert stats.global_sqnorm == pytest.approx(5 * avg ** 2)
    assert stats.extras.tolist() == pytest.approx([n, sum(range(n))])
    assert torch.allclose(model.weight.grad, torch.full((1, 5), avg))
    opt.remove_hooks()


def test_control_values_are_summed_in_float64_beside_float32_gradients(w):
    # 2**24 + 1 has no float32 twin: in a float32 gradient bucket the sum would round
    model = nn.Linear(3, 1, bias=False)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                               model.named_parameters(), world=w, extra_slots=1)
    opt.zero_grad()
    opt.stage_extras([2.0 ** 24 + 1])
    model(torch.ones(1, 3)).sum().backward()
    stats = opt.synchronize()
    assert stats.extras[0] == w.size * (2.0 ** 24 + 1)
    opt.remove_hooks()


def test_no_sync_accumulates_then_reduces_once(w):
    model = nn.Linear(3, 1, bias=False)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                               model.named_parameters(), world=w)
    opt.zero_grad()
    x = torch.ones(1, 3) * (w.rank + 1)
    with opt.no_sync():
        model(x).sum().backward()
    model(x).sum().backward()
    opt.synchronize()
    expected = 2 * sum(r + 1 for r in range(w.size)) / w.size
    assert torch.allclose(model.weight.grad, torch.full((1, 3), expected))
    opt.remove_hooks()


def test_every_way_of_zeroing_gradients_gives_the_average_step_after_step(w):
    """The job zeroes the buckets in place (``zero_grad(set_to_none=False)``), a user's
    loop calls ``opt.zero_grad()`` or ``model.zero_grad()`` (gradients set to None), a
    micro-batch runs under ``no_sync``, a step keeps its gradients local (local SGD between
    averages) and a parameter is left unused on some steps: in any order, each step's
    gradients are the ranks' average of that step's alone (the local step's: its own)."""
    from hpcadapt.base.strategies import SSGD
    from hpcadapt.base.strategies.local_sgd import LocalSGD

    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(2, 1), "spare": nn.Linear(3, 1)})
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                               model.named_parameters(), world=w, bucket_bytes=64)
    ways = ["in_place", "opt_none", "in_place", "model_none", "in_place", "no_sync",
            "opt_none", "in_place", "local", "in_place", "in_place"]
    for step, way in enumerate(ways):
        opt.set_strategy(LocalSGD(period=1000) if way == "local" else SSGD())
        opt.begin_step(step)
        if way in ("opt_none", "local"):
            opt.zero_grad()
        elif way == "model_none":
            model.zero_grad()
        else:
            opt.zero_grad(set_to_none=False)
        use_spare = step % 3 == 0

        def loss_of(r):
            x = torch.full((1, 3), float(r + 1 + step))
            out = model["b"](model["a"](x)).sum()
            return out + model["spare"](x).sum() * (r + 1) if use_spare else out

        passes = 2 if way == "no_sync" else 1
        if passes == 2:
            with opt.no_sync():
                loss_of(w.rank).backward()
        loss_of(w.rank).backward()
        opt.synchronize()
        got = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
               for n, p in model.named_parameters()}
        expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for r in ([w.rank] if way == "local" else range(w.size)):
            grads = torch.autograd.grad(loss_of(r), list(model.parameters()),
                                        allow_unused=True)
            for (n, _), g in zip(model.named_parameters(), grads):
                if g is not None:
                    expected[n] += passes * g / (1 if way == "local" else w.size)
        for n in got:
            assert torch.allclose(got[n], expected[n], atol=1e-5), (step, way, n)
        opt.step()
    opt.remove_hooks()


def test_second_backward_without_step_is_refused(w):
    model = nn.Linear(3, 1)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                               model.named_parameters(), world=w)
    opt.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    with pytest.raises(CommunicationError, match="no_sync"):
        model(torch.ones(1, 3)).sum().backward()
    opt.synchronize()
    opt.remove_hooks()


def test_layout_mismatch_refused_when_wrapping(w):
    width = 4 if w.rank == 0 else 5
    model = nn.Linear(width, 2)
    with pytest.raises(CommunicationError, match="different shapes"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             model.named_parameters(), world=w)


def test_optimizer_state_broadcast(w):
    model = nn.Linear(4, 2)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4) * (w.rank + 1)).sum().backward()
    base.step()  # momentum buffers now differ across ranks
    hpcadapt.broadcast_optimizer_state(base, world=w)
    bufs = torch.cat([base.state[p]["momentum_buffer"].reshape(-1) for p in model.parameters()])
    assert gathered_equal(w, bufs)


def _train_batch_norm_cnn(w, strategy: str, wrap_buffers: bool = False, plane: str = "mpi",
                          topology: str = "flat"):
    """Three steps of the BatchNorm CNN, each rank on batches of its own (so its running
    statistics are its own unless they are kept consistent): the model, and its buffers
    after each step."""
    from hpcadapt.base.strategies import strategy as make_strategy

    model = build_model("cnn", (1, 8, 8), 10, seed=0, width=4, batch_norm=True)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               model.named_parameters(), world=w,
                               buffers=model.buffers() if wrap_buffers else (),
                               data_plane=plane)
    opt.set_strategy(make_strategy(strategy))
    opt.set_topology(topology)
    gen = torch.Generator().manual_seed(w.rank)
    after = []
    for step in range(3):
        opt.begin_step(step)
        opt.zero_grad()
        x = torch.randn(8, 1, 8, 8, generator=gen) * (1 + w.rank)
        model(x).square().mean().backward()
        opt.step()
        after.append(flat_buffers(model))
    opt.remove_hooks()
    return model, after


def flat_buffers(model):
    return torch.cat([b.detach().double().reshape(-1) for b in model.buffers()])


@pytest.mark.parametrize("strategy,plane,topology", [
    ("ssgd", "mpi", "flat"), ("sma", "mpi", "flat"), ("ssgd", "host-staged", "flat"),
    ("ssgd", "mpi", "ring")])
def test_buffers_are_rank_0s_on_every_rank_after_every_step(w, strategy, plane, topology):
    """Under S-SGD (the broadcast overlaps the gradient exchange) and under model averaging
    (gradients stay local: it travels beside the control reduction alone), over the host
    plane, the host-staged one (CPU tensors take its path with plain copies) and a
    topology's communicator."""
    kept, kept_after = _train_batch_norm_cnn(w, strategy, wrap_buffers=True, plane=plane,
                                             topology=topology)
    assert all([gathered_equal(w, b) for b in kept_after])
    assert [int(b) for n, b in kept.named_buffers() if n.endswith("num_batches_tracked")] \
        == [3, 3, 3]
    _, own_after = _train_batch_norm_cnn(w, strategy, plane=plane, topology=topology)
    assert not gathered_equal(w, own_after[-1]), "the test's ranks never differed"
    if w.rank == 0:  # the root's statistics are its own batches', as without the broadcast
        assert all(torch.equal(k, o) for k, o in zip(kept_after, own_after))
