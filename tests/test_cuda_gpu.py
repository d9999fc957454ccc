"""The GPU-only calls (CuPy/NCCL, CUDA streams, pinned memory): run where a GPU, CuPy and
NCCL exist (the lent GPU machine), skipped with the reason elsewhere."""

import pytest
import torch

from hpcadapt.cuda.device import gpu_problems

PROBLEMS = gpu_problems()
pytestmark = pytest.mark.skipif(bool(PROBLEMS), reason="no GPU data plane here: "
                                + "; ".join(PROBLEMS))


@pytest.fixture(scope="module")
def nccl():
    from mpi4py import MPI

    from hpcadapt.cuda.nccl import NCCLCommunicator

    comm = NCCLCommunicator(MPI.COMM_SELF, 0)
    yield comm
    comm.destroy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nccl_allreduce_at_world_size_one_matches_the_reference(nccl, dtype):
    x = torch.randn(1 << 20, device="cuda:0").to(dtype)
    want = x.clone()
    out = nccl.allreduce_async(x, "sum").wait()
    torch.cuda.synchronize()
    assert out is x and torch.equal(x, want)


def test_nccl_broadcast_and_allgather(nccl):
    x = torch.arange(10, device="cuda:0", dtype=torch.float32)
    assert torch.equal(nccl.broadcast_async(x, 0).wait(), torch.arange(10, device="cuda:0",
                                                                         dtype=torch.float32))
    g = nccl.allgather_async(x).wait()
    torch.cuda.synchronize()
    assert g.shape == (1, 10) and torch.equal(g[0], x)


def test_host_staged_cuda_tensors_at_world_size_one():
    import hpcadapt
    from hpcadapt.cuda.staged import HostStagedCommunicator

    hpcadapt.init()
    staged = HostStagedCommunicator(hpcadapt.communicator())
    x = torch.randn(4096, device="cuda:0")
    want = x.clone() * staged.size
    assert torch.allclose(staged.allreduce_async(x).wait(), want)
