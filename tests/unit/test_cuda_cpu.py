"""The GPU data plane's device-generic parts, on the CPU: the device choice and its messages,
the NCCL dtype table, the stream-handle bookkeeping (with a recording stand-in for CUDA
streams), and the host-staged path with CPU tensors standing in for device tensors. The
calls into CuPy/NCCL themselves run only where a GPU exists (tests/e2e/test_cuda_gpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcadapt import CommunicationError, ConfigurationError
from hpcadapt.cuda.device import INSTALL_HINT, choose_device, gpu_problems
from hpcadapt.cuda.nccl import comm_id, nccl_dtype, unique_id_array
from hpcadapt.cuda.streams import StreamHandle

ROOT = Path(__file__).resolve().parents[2]


def gpus(n):
    return lambda: n


def test_auto_is_the_cpu_without_a_gpu_and_cpu_is_always_the_cpu():
    assert choose_device("auto", local_rank=0, local_size=2, visible_gpus=gpus(0)).kind == "cpu"
    c = choose_device("cpu", local_rank=1, local_size=2, visible_gpus=gpus(4))
    assert (c.kind, c.data_plane, c.torch_device) == ("cpu", "mpi", "cpu")


def test_cuda_without_a_gpu_says_what_is_missing_and_how_to_install_it():
    with pytest.raises(ConfigurationError) as exc:
        choose_device("cuda", local_rank=0, local_size=1, visible_gpus=gpus(0),
                      problems=["no GPU is visible", "CuPy is not installed"])
    text = str(exc.value)
    assert text.startswith("--device cuda: no GPU is visible; CuPy is not installed; ")
    assert INSTALL_HINT in text and 'pip install "hpcadapt[cuda]"' in text
    assert "\n" not in text


def test_one_gpu_per_rank_uses_nccl_and_the_local_rank_picks_the_gpu():
    c = choose_device("auto", local_rank=3, local_size=4, visible_gpus=gpus(4), problems=[])
    assert (c.kind, c.index, c.shared, c.data_plane) == ("cuda", 3, False, "nccl")
    assert c.torch_device == "cuda:3"


def test_slurm_binding_one_visible_gpu_per_task_is_device_zero_and_not_shared():
    c = choose_device("cuda", local_rank=1, local_size=2, visible_gpus=gpus(1), problems=[],
                      local_gpu_ids=["GPU-a", "GPU-b"])
    assert (c.index, c.shared, c.data_plane) == (0, False, "nccl")
    c = choose_device("cuda", local_rank=1, local_size=2, visible_gpus=gpus(1), problems=[],
                      local_gpu_ids=["GPU-a", "GPU-a"])
    assert (c.index, c.shared, c.data_plane) == (0, True, "host-staged")


def test_ranks_sharing_a_gpu_are_host_staged():
    c = choose_device("cuda", local_rank=1, local_size=2, visible_gpus=gpus(1), problems=[])
    assert (c.index, c.shared, c.data_plane) == (0, True, "host-staged")
    assert "NCCL allows one rank per GPU" in c.reason


def test_a_gpu_without_nccl_is_host_staged_with_the_reason():
    c = choose_device("cuda", local_rank=0, local_size=1, visible_gpus=gpus(1),
                      problems=["CuPy is not installed"])
    assert c.data_plane == "host-staged" and "CuPy is not installed" in c.reason


def test_bad_device_names_list_the_choices():
    with pytest.raises(ConfigurationError, match=r"--device 'tpu': choose one of \['auto', 'cpu', 'cuda'\]"):
        choose_device("tpu", local_rank=0, local_size=1)


def test_gpu_problems_names_each_missing_part():
    def no_cupy():
        raise ModuleNotFoundError("No module named 'cupy'", name="cupy")

    def cupy_broken():  # what the GPU machine said when NVIDIA's cuda namespace was hidden
        raise ModuleNotFoundError("No module named 'cuda.pathfinder'", name="cuda.pathfinder")

    assert gpu_problems(visible_gpus=gpus(0), import_cupy=no_cupy) == [
        "no GPU is visible (torch.cuda.is_available() is False; check the driver and "
        "CUDA_VISIBLE_DEVICES)", "CuPy is not installed"]
    assert gpu_problems(visible_gpus=gpus(1), import_cupy=cupy_broken) == [
        "CuPy failed to import (No module named 'cuda.pathfinder')"]

    class CupyWithoutNccl:
        class cuda:
            nccl = None

    assert gpu_problems(visible_gpus=gpus(1), import_cupy=lambda: CupyWithoutNccl) == [
        "CuPy was built without NCCL"]


@pytest.mark.parametrize("dtype,code", [(torch.float32, 7), (torch.float16, 6),
                                        (torch.bfloat16, 9), (torch.float64, 8)])
def test_nccl_dtypes_cover_fp32_fp16_bf16(dtype, code):
    assert nccl_dtype(dtype) == code


@pytest.mark.parametrize("cupy_version", ["13.6.0", "14.2.0"])
def test_the_nccl_unique_id_survives_the_broadcast_in_either_cupy_form(cupy_version):
    """CuPy 14 gives and takes the id as bytes, earlier CuPy as a tuple of C char values:
    both round-trip through the int8 array that rank 0 broadcasts."""
    raw = bytes(range(256))[::2]  # 128 bytes, half of them negative as C chars
    old = tuple(b - 256 if b > 127 else b for b in raw)
    given = raw if cupy_version.startswith("14") else old
    uid = unique_id_array(given)
    assert uid.dtype == np.int8 and uid.shape == (128,)
    assert comm_id(uid.copy(), cupy_version) == given


def test_a_top_level_cuda_import_from_the_repository_root_leaves_nvidias_namespace_visible(
        tmp_path):
    """Python started in the repository's root finds ``cuda/`` first: NVIDIA's ``cuda.*``
    modules (which CuPy imports) must still resolve."""
    site = tmp_path / "site"
    (site / "cuda" / "pathfinder").mkdir(parents=True)  # a namespace portion, as installed
    (site / "cuda" / "pathfinder" / "__init__.py").write_text("FOUND = True\n")
    code = "import cuda.pathfinder, cuda.nccl; print(cuda.pathfinder.FOUND)"
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def test_a_dtype_nccl_cannot_reduce_is_refused_by_name():
    with pytest.raises(CommunicationError, match="NCCL has no complex64 reduction"):
        nccl_dtype(torch.complex64)


class RecordingOps:
    """Stands in for CUDA streams and events: records what the data plane asks for."""

    def __init__(self):
        self.log = []
        self.finished = set()
        self._events = 0

    def current_stream(self):
        return "compute"

    def new_event(self):
        self._events += 1
        return f"event{self._events}"

    def record(self, event, stream):
        self.log.append(("record", event, stream))

    def wait_event(self, stream, event):
        self.log.append(("wait_event", stream, event))

    def query(self, event):
        return event in self.finished

    def wait_stream(self, stream, other):
        self.log.append(("wait_stream", stream, other))


def test_a_stream_handle_orders_the_consumer_after_the_collective_without_a_host_sync():
    ops = RecordingOps()
    h = StreamHandle(ops, "comm", "result", after=lambda: ops.log.append(("launch",)))
    assert ops.log == [("launch",), ("record", "event1", "comm")]  # event after the launch
    assert not h.test()
    ops.finished.add("event1")
    assert h.test()
    assert h.wait() == "result" and h.wait() == "result"
    assert ops.log[-1] == ("wait_event", "compute", "event1")
    assert sum(1 for e in ops.log if e[0] == "wait_event") == 1  # waited once


# -- the data plane each device uses ---------------------------------------------------------
def test_the_plane_follows_the_parameters_device():
    from hpcadapt.parallel.dataplane import resolve_plane

    cpu, cuda = torch.device("cpu"), torch.device("cuda:0")
    assert resolve_plane(cpu) == resolve_plane(cpu, "mpi") == "mpi"
    assert resolve_plane(cpu, "host-staged") == "host-staged"
    assert resolve_plane(cuda, "nccl") == "nccl"
    assert resolve_plane(cuda, "host-staged") == "host-staged"
    # auto on CUDA: NCCL only where CuPy with NCCL is there
    assert resolve_plane(cuda) == ("host-staged" if gpu_problems() else "nccl")


def test_nccl_is_agreed_only_when_every_rank_can_and_no_two_share_a_gpu():
    from hpcadapt.parallel.dataplane import agreed_cuda_plane

    assert agreed_cuda_plane([(1, True), (2, True)]) == "nccl"
    assert agreed_cuda_plane([(1, True)]) == "nccl"
    assert agreed_cuda_plane([(1, True), (1, True)]) == "host-staged"  # one GPU, two ranks
    assert agreed_cuda_plane([(1, True), (2, False)]) == "host-staged"  # one without NCCL


@pytest.mark.parametrize("device, plane, words", [
    ("cpu", "nccl", ["'nccl' carries CUDA tensors", "model to the GPU"]),
    ("cuda:1", "mpi", ["'mpi' carries CPU tensors", "cuda:1", "'nccl' or 'host-staged'"]),
    ("cpu", "gloo", ["'gloo'", "'auto'", "'host-staged'"]),
    ("meta", "auto", ["meta", "cpu or cuda"]),
])
def test_a_plane_that_cannot_carry_the_tensors_is_refused_in_one_line(device, plane, words):
    from hpcadapt.parallel.dataplane import resolve_plane

    with pytest.raises(ConfigurationError) as exc:
        resolve_plane(torch.device(device), plane)
    assert all(w in str(exc.value) for w in words) and "\n" not in str(exc.value)


def test_parameters_on_two_devices_are_refused_naming_the_tensor_and_the_devices():
    import hpcadapt

    hpcadapt.init()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].to("meta")
    with pytest.raises(ConfigurationError) as exc:
        hpcadapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      model.named_parameters())
    assert "'1.weight' is on meta" in str(exc.value) and "'0.weight' on cpu" in str(exc.value)


def test_the_communicator_is_rebuilt_on_a_new_cluster_version_and_the_old_one_aborted():
    """What a resize or a recovery does to the NCCL plane, with stand-ins for the
    communicators (building a real one needs a GPU)."""
    from hpcadapt.parallel.dataplane import DataPlane

    class World:
        cluster_version = 0

    class Comm:
        def __init__(self):
            self.aborted = False

        def abort(self):
            self.aborted = True

    built = []
    plane = DataPlane(World(), torch.device("cuda:0"), "nccl")
    plane._build = lambda: built.append(Comm()) or built[-1]
    first = plane.current()
    assert plane.current() is first and len(built) == 1
    World.cluster_version = 1
    second = plane.current()
    assert second is not first and first.aborted and not second.aborted
    plane.close()
    assert second.aborted and plane.current() is built[-1] and len(built) == 3
