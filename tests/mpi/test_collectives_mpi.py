"""Host collectives on real MPI ranks; every assertion holds at any world size."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcadapt
from hpcadapt import CommunicationError, ReduceOp
from hpcadapt.comm.collectives import check_same_layout

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def w():
    return hpcadapt.init()


@pytest.mark.parametrize("op,expect", [
    (ReduceOp.SUM, lambda r, n: sum(range(1, n + 1))),
    (ReduceOp.AVERAGE, lambda r, n: (n + 1) / 2),
    (ReduceOp.MIN, lambda r, n: 1),
    (ReduceOp.MAX, lambda r, n: n),
])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_allreduce_ops(w, op, expect, kind):
    base = np.full(1000, w.rank + 1, dtype=np.float64)
    x = base if kind == "numpy" else torch.from_numpy(base.copy())
    out = hpcadapt.allreduce(x, op)
    assert out is x
    assert np.allclose(np.asarray(out), expect(w.rank, w.size))


def test_allreduce_is_zero_copy_for_contiguous_tensors(w):
    t = torch.ones(64)
    ptr = t.data_ptr()
    hpcadapt.allreduce(t)
    assert t.data_ptr() == ptr and torch.all(t == w.size)


def test_non_contiguous_tensor_written_back(w):
    t = torch.ones(8, 6).t()  # a transposed view
    assert not t.is_contiguous()
    hpcadapt.allreduce(t, ReduceOp.SUM)
    assert torch.all(t == w.size)


def test_async_handles_test_and_wait(w):
    xs = [np.full(4096, float(w.rank)) for _ in range(5)]
    handles = [hpcadapt.allreduce_async(x, ReduceOp.SUM) for x in xs]
    while not all(h.test() for h in handles):
        pass
    total = sum(range(w.size))
    for h, x in zip(handles, xs):
        assert h.wait() is x and np.all(x == total)


def test_broadcast_blocking_and_async(w):
    x = torch.full((10,), float(w.rank))
    hpcadapt.broadcast(x, root=w.size - 1)
    assert torch.all(x == w.size - 1)
    y = np.arange(7) * (w.rank + 1)
    hpcadapt.broadcast_async(y, root=0).wait()
    assert np.array_equal(y, np.arange(7))


def test_allgather_stacks_in_rank_order(w):
    out = hpcadapt.allgather(np.array([w.rank, 10 * w.rank], dtype=np.int64))
    assert out.shape == (w.size, 2)
    assert out[:, 0].tolist() == list(range(w.size))
    t = hpcadapt.allgather_async(torch.tensor([float(w.rank)])).wait()
    assert isinstance(t, torch.Tensor) and t.reshape(-1).tolist() == list(map(float, range(w.size)))


def test_barrier(w):
    hpcadapt.barrier()
    hpcadapt.barrier_async().wait()


def test_grouped_allreduce_many_small_tensors(w):
    ts = [torch.full((i + 1,), float(w.rank + i)) for i in range(50)]
    hpcadapt.grouped_allreduce(hpcadapt.communicator(), ts, ReduceOp.AVERAGE, bucket_bytes=256)
    for i, t in enumerate(ts):
        assert torch.allclose(t, torch.full_like(t, (w.size - 1) / 2 + i))


def test_layout_mismatch_is_detected_on_every_rank(w):
    shape = (4,) if w.rank == 0 else (5,)
    with pytest.raises(CommunicationError, match="different shapes"):
        check_same_layout(w.comm, [(shape, np.float32)], what="test")
    check_same_layout(w.comm, [((3,), np.float32)], what="test")  # agreeing ranks pass


def test_checked_collective_refuses_mismatched_arrays(w, monkeypatch):
    monkeypatch.setenv("HPCADAPT_CHECK_COLLECTIVES", "1")
    comm = hpcadapt.MPICommunicator(w)
    x = np.zeros(3 if w.rank == 0 else 4)
    with pytest.raises(CommunicationError):
        comm.allreduce(x)


def test_bad_inputs_rejected_before_any_collective(w):
    with pytest.raises(CommunicationError, match="unknown reduction"):
        hpcadapt.allreduce(np.zeros(2), "median")
    with pytest.raises(CommunicationError, match="bfloat16"):
        hpcadapt.allreduce(torch.zeros(2, dtype=torch.bfloat16))
    with pytest.raises(CommunicationError, match="root"):
        hpcadapt.broadcast(np.zeros(2), root=w.size)
    with pytest.raises(CommunicationError, match="numpy array or a torch tensor"):
        hpcadapt.allreduce([1, 2])


def test_world_info(w):
    info = w.info()
    assert info.size == MPI.COMM_WORLD.Get_size() and info.rank == MPI.COMM_WORLD.Get_rank()
    assert 0 <= info.local_rank < info.local_size <= info.size
    ranks = hpcadapt.allgather(np.array([info.rank]))
    assert sorted(ranks.reshape(-1).tolist()) == list(range(info.size))
