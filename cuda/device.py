"""Which device a rank trains on, and what is missing when it cannot be a GPU.

One process per GPU: the device index comes from the rank's local rank among the GPUs this
process can see (``CUDA_VISIBLE_DEVICES``, or Slurm's GPU binding, which sets it per task).
NCCL refuses two ranks on one device (since NCCL 2.5: "Duplicate GPU detected"), so when
more ranks share a host than it has visible GPUs, the ranks share GPUs and the gradients
must travel host-staged over MPI (``hpcadapt.cuda.staged``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

from hpcadapt.base.errors import ConfigurationError

__all__ = ["DEVICES", "DeviceChoice", "gpu_problems", "choose_device", "INSTALL_HINT"]

DEVICES = ("auto", "cpu", "cuda")

INSTALL_HINT = ("install the GPU extra with `pip install \"hpcadapt[cuda]\"` (CuPy with NCCL, "
                "for CUDA 13) on a machine with an NVIDIA GPU and its driver")


@dataclass(frozen=True)
class DeviceChoice:
    """Where this rank trains and how its gradients travel. ``kind``: "cpu" or "cuda";
    ``index``: the CUDA device among the visible ones; ``shared``: other ranks of this host
    use the same GPU; ``data_plane``: "mpi" (host tensors), "nccl", or "host-staged" (CUDA
    tensors through pinned host memory and MPI: GPUs shared, or no NCCL); ``reason``: why."""

    kind: str
    index: Optional[int] = None
    shared: bool = False
    data_plane: str = "mpi"
    reason: str = ""

    @property
    def torch_device(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


def gpu_problems(*, visible_gpus: Optional[Callable[[], int]] = None,
                 import_cupy: Optional[Callable[[], object]] = None) -> List[str]:
    """What stands between this process and the NCCL data plane, one phrase each (empty:
    nothing). The probes are parameters so the decision can be tested without a GPU."""
    problems = []
    count = (visible_gpus or _visible_gpus)()
    if count < 1:
        problems.append("no GPU is visible (torch.cuda.is_available() is False; check the "
                        "driver and CUDA_VISIBLE_DEVICES)")
    try:
        cupy = (import_cupy or _import_cupy)()
    except ImportError as e:
        # "not installed" only when CuPy itself is missing; else say what its import hit
        missing = getattr(e, "name", None) == "cupy"
        problems.append("CuPy is not installed" if missing
                        else f"CuPy failed to import ({e})")
        return problems
    nccl = getattr(getattr(cupy, "cuda", None), "nccl", None)
    if nccl is None or not getattr(nccl, "available", True):
        problems.append("CuPy was built without NCCL")
    return problems


def choose_device(requested: str, *, local_rank: int, local_size: int,
                  visible_gpus: Optional[Callable[[], int]] = None,
                  problems: Optional[List[str]] = None,
                  local_gpu_ids: Optional[Sequence[str]] = None) -> DeviceChoice:
    """The device for ``--device auto|cpu|cuda``. ``auto``: CUDA when a GPU is visible,
    else the CPU. ``cuda`` without a usable GPU: ConfigurationError in one line saying what
    is missing and how to install it.

    ``local_gpu_ids``: the physical GPU (its UUID) each rank of this host would use, by local
    rank, gathered by the caller; it tells GPUs shared by ranks from Slurm's per-task binding
    (each task sees one GPU, device 0, but a different one). Without it, ranks share GPUs
    when the host has more ranks than this process sees GPUs (every rank sees them all)."""
    if requested not in DEVICES:
        raise ConfigurationError(f"--device {requested!r}: choose one of {list(DEVICES)}")
    if requested == "cpu":
        return DeviceChoice("cpu", reason="asked for")
    count = (visible_gpus or _visible_gpus)()
    if requested == "auto" and count < 1:
        return DeviceChoice("cpu", reason="no GPU visible")
    missing = problems if problems is not None else gpu_problems(visible_gpus=lambda: count)
    if count < 1:
        raise ConfigurationError(f"--device cuda: {'; '.join(missing)}; {INSTALL_HINT}")
    if local_rank < 0 or local_size < 1 or local_rank >= local_size:
        raise ConfigurationError(f"local rank {local_rank} of {local_size} is not a rank")
    index = local_rank % count
    if local_gpu_ids is not None:
        shared = list(local_gpu_ids).count(local_gpu_ids[local_rank]) > 1
    else:
        shared = local_size > count
    plane = "nccl" if not missing and not shared else "host-staged"
    why = ("ranks share GPUs (NCCL allows one rank per GPU)" if shared else
           "; ".join(missing) if missing else "")
    return DeviceChoice("cuda", index, shared, plane,
                        f"local rank {local_rank} of {local_size} on GPU {index} of {count} "
                        f"visible; gradients over {plane}" + (f" ({why})" if why else ""))


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _import_cupy():
    import cupy  # noqa: F401  (the extra: hpcadapt[cuda])
    import cupy.cuda.nccl  # noqa: F401

    return cupy
