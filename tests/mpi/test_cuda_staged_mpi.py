"""The host-staged data plane on real MPI ranks, with CPU tensors standing in for CUDA
tensors (the staging, the buffer pool and the write-back are the same code)."""

import pytest
import torch

import hpcadapt
from hpcadapt.cuda.staged import HostStagedCommunicator

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def staged():
    hpcadapt.init()
    return HostStagedCommunicator(hpcadapt.communicator())


def test_allreduce_and_broadcast_write_back_into_the_tensor(staged):
    n = staged.size
    x = torch.full((1000,), float(staged.rank + 1))
    assert staged.allreduce_async(x).wait() is x
    assert torch.all(x == n * (n + 1) / 2)
    y = torch.full((10,), float(staged.rank))
    staged.broadcast_async(y, root=0).wait()
    assert torch.all(y == 0)


def test_collectives_in_flight_together_each_have_their_own_buffer(staged):
    """Two buckets of the same shape in flight at once (as the optimizer launches them)."""
    a = torch.full((256,), 1.0)
    b = torch.full((256,), 2.0)
    ha, hb = staged.allreduce_async(a), staged.allreduce_async(b)
    hb.wait()
    ha.wait()
    assert torch.all(a == staged.size) and torch.all(b == 2 * staged.size)


def test_allgather_stacks_the_ranks_tensors_on_the_tensors_device(staged):
    x = torch.full((3,), float(staged.rank))
    g = staged.allgather_async(x).wait()
    assert g.shape == (staged.size, 3) and g.device == x.device
    assert torch.equal(g[:, 0], torch.arange(staged.size, dtype=x.dtype))


def _train(plane, steps=6, track=True):
    """A few steps of a small model through DistributedOptimizer over ``plane``; returns
    the final parameters and the statistics of each step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 5))
    opt = hpcadapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                        momentum=0.9),
                                        model.named_parameters(), bucket_bytes=4096,
                                        extra_slots=2, track_grad_norms=track,
                                        data_plane=plane)
    g = torch.Generator().manual_seed(1 + hpcadapt.world().rank)
    stats = []
    for step in range(steps):
        x, y = torch.randn(8, 20, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        opt.stage_extras([float(step), 1.0])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        s = opt.last_stats
        stats.append((s.local_sqnorm_mean, s.global_sqnorm, s.extras.tolist()))
    opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()], stats


def test_the_optimizer_over_the_host_staged_plane_trains_exactly_as_over_mpi(staged):
    """The same bucketed, backward-overlapped step over either plane: bit-identical
    weights and the same in-step statistics (squared norms, summed metric slots)."""
    n = staged.size
    params_mpi, stats_mpi = _train("mpi")
    params_staged, stats_staged = _train("host-staged")
    assert all(torch.equal(a, b) for a, b in zip(params_mpi, params_staged))
    assert stats_mpi == stats_staged
    assert [s[2] for s in stats_mpi] == [[float(k * n), float(n)] for k in range(6)]
    assert all(s[0] > 0 and s[1] > 0 for s in stats_mpi)


@pytest.mark.parametrize("case, expected", [
    ("own GPUs", "nccl"),              # one GPU each, all can use NCCL
    ("one GPU shared", "host-staged"),  # a joiner on a GPU a rank uses (NCCL refuses it)
    ("one without NCCL", "host-staged"),
])
def test_the_ranks_agree_on_one_cuda_plane_for_the_world(staged, monkeypatch, case, expected):
    """The agreement on real ranks (a bounded allgather); the GPU's identity is stood in
    for (a real one needs a GPU): every rank ends with the same plane."""
    from hpcadapt.comm.world import world
    from hpcadapt.parallel import dataplane

    rank = staged.rank
    key = 7 if case == "one GPU shared" and rank < 2 else 100 + rank
    monkeypatch.setattr(dataplane, "gpu_key", lambda index: key)
    plane = dataplane.DataPlane(world(), torch.device("cuda:0"), "nccl")
    if case == "one without NCCL" and rank == staged.size - 1:
        plane.capable = "host-staged"
    assert plane._agree() == expected
