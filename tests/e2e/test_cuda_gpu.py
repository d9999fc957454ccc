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


# -- the wrapper and the entry point on the GPU ---------------------------------------------
def _train(tmp_path, name, ranks, flags):
    import json

    from conftest import run_mpi

    path = tmp_path / f"{name}.jsonl"
    run_mpi(ranks, ["-m", "hpcadapt.train", "--model", "cnn", "--epochs", "20",
                    "--no-progress", "--check-replicas", "--metrics-file", str(path)] + flags,
            timeout=900)
    rows = [json.loads(line) for line in open(path)]
    return rows, [r for r in rows if r["event"] == "epoch"][-1]["test_accuracy"]


def test_the_built_in_cnn_trains_on_the_gpu_to_the_cpu_accuracy(tmp_path):
    """One rank on the GPU over NCCL, then two ranks sharing it (host-staged), against the
    CPU path: the same accuracy to a point."""
    _, cpu = _train(tmp_path, "cpu", 1, ["--device", "cpu"])
    _, gpu = _train(tmp_path, "gpu", 1, ["--device", "cuda"])
    _, shared = _train(tmp_path, "shared", 2, ["--device", "cuda"])
    assert abs(gpu - cpu) <= 0.01 and abs(shared - cpu) <= 0.01, (cpu, gpu, shared)


def test_a_grow_and_a_shrink_rebuild_the_host_staged_plane_on_the_gpu(tmp_path):
    from conftest import grow_and_shrink

    rows = grow_and_shrink(tmp_path, ["--device", "cuda", "--data-plane", "host-staged"])
    assert {r["world_size"] for r in rows if r["event"] == "step"} == {1, 2}


def test_a_joiner_on_the_same_gpu_turns_nccl_into_host_staged_and_back(tmp_path):
    """One rank on the GPU over NCCL grows to 2 on the same GPU (NCCL refuses two ranks on
    one device: the ranks agree on host-staged), then shrinks back to 1 (NCCL again)."""
    from conftest import grow_and_shrink

    rows = grow_and_shrink(tmp_path, ["--device", "cuda"])
    assert {r["world_size"] for r in rows if r["event"] == "step"} == {1, 2}
    assert "gradients over host-staged from now on (2 workers" in \
        (tmp_path / "grow.err").read_text()


def test_a_user_script_in_mixed_precision_on_the_gpu(tmp_path):
    import json

    from conftest import ROOT, run_mpi

    path = tmp_path / "amp.jsonl"
    proc = run_mpi(1, [str(ROOT / "examples" / "mnist1d_adamw.py"), "--epochs", "3",
                       "--workers", "0", "--no-progress", "--amp", "--monitor", "gns",
                       "--metrics-file", str(path)], timeout=600)
    summary = json.loads([line for line in proc.stdout.splitlines()
                          if line.startswith("{")][-1])
    assert summary["final_test_accuracy"] > 0.6
    steps = [json.loads(line) for line in open(path) if '"step"' in line]
    assert any(s["monitors"].get("noise_scale") for s in steps)
