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
