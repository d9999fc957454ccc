"""NCCL collectives on CUDA tensors through CuPy (``cupy.cuda.nccl``), one GPU per rank.

The unique id travels from rank 0 over MPI (the control plane); collectives run on a
dedicated stream after the producer's stream, zero-copy on the tensors' device pointers,
and return ``StreamHandle``s that order the consumer's stream after them (no host sync per
bucket). ``abort()`` before destroying on a resize or a failure, so a communicator with a
dead peer cannot block the process. The GPU-only part of hpcadapt is this module: the rest
(device choice, dtype table, handles) is tested on the CPU."""

from __future__ import annotations

from typing import Any, Dict

import numpy as np

from hpcadapt.base.errors import CommunicationError

from .streams import StreamHandle, TorchStreamOps

__all__ = ["NCCLCommunicator", "nccl_dtype", "NCCL_DTYPES", "NCCL_OPS", "comm_id",
           "unique_id_array"]

# NCCL's own codes (nccl.h), used when the CuPy build does not name them (bfloat16 came in
# NCCL 2.10): stable across releases.
NCCL_DTYPES: Dict[str, int] = {"float32": 7, "float16": 6, "bfloat16": 9, "float64": 8,
                               "int32": 2, "int64": 4, "uint8": 1}
NCCL_OPS: Dict[str, int] = {"sum": 0, "max": 2, "min": 3, "average": 4}


def nccl_dtype(dtype: Any) -> int:
    """The NCCL datatype code of a torch dtype; CommunicationError for one NCCL lacks."""
    name = str(dtype).replace("torch.", "")
    try:
        return NCCL_DTYPES[name]
    except KeyError:
        raise CommunicationError(f"NCCL has no {name} reduction; use one of "
                                 f"{sorted(NCCL_DTYPES)}") from None


UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES (nccl.h)


def unique_id_array(raw) -> np.ndarray:
    """NCCL's unique id as 128 signed bytes to broadcast over MPI: CuPy 14 gives ``bytes``,
    earlier releases a tuple of ints (C ``char`` values)."""
    if isinstance(raw, (bytes, bytearray)):
        return np.frombuffer(bytes(raw), dtype=np.int8).copy()
    return np.asarray(raw, dtype=np.int64).astype(np.int8)


def comm_id(uid: np.ndarray, cupy_version: str):
    """The id in the form ``NcclCommunicator`` takes: ``bytes`` from CuPy 14, a tuple of
    ints before."""
    if int(cupy_version.split(".")[0]) >= 14:
        return uid.astype(np.int8).tobytes()
    return tuple(int(v) for v in uid)


class NCCLCommunicator:
    """Collectives over NCCL for the ranks of ``comm`` (an MPI intracommunicator), on CUDA
    device ``device`` (this rank's own GPU). Rebuild it on every cluster version
    (``hpcadapt.parallel.dataplane.DataPlane`` does)."""

    def __init__(self, comm, device: int, watch=None):
        import cupy
        from cupy.cuda import nccl

        from hpcadapt.comm.world import wait_request

        self._nccl = nccl
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.device = device
        uid = np.zeros(UNIQUE_ID_BYTES, dtype=np.int8)
        if self.rank == 0:
            uid[:] = unique_id_array(nccl.get_unique_id())
        # bounded like every wait on a peer (``watch``: the world's liveness checks)
        wait_request(comm.Ibcast(uid, root=0), watch, "the NCCL unique id's broadcast")
        with cupy.cuda.Device(device):
            self._comm = nccl.NcclCommunicator(self.size, comm_id(uid, cupy.__version__),
                                               self.rank)
        self._ops = TorchStreamOps(device)
        self._stream = self._ops.new_stream()

    def _launch(self, tensor, call) -> StreamHandle:
        if not tensor.is_cuda or tensor.device.index != self.device:
            raise CommunicationError(f"NCCL communicator of cuda:{self.device} got a tensor "
                                     f"on {tensor.device}")
        if not tensor.is_contiguous():
            raise CommunicationError("NCCL collectives need contiguous tensors")
        # The collective reads what the producer's stream wrote: order it after that work.
        self._ops.wait_stream(self._stream, self._ops.current_stream())
        tensor.record_stream(self._stream)
        return StreamHandle(self._ops, self._stream, tensor,
                            after=lambda: call(self._stream.cuda_stream))

    def allreduce_async(self, tensor, op: str = "sum") -> StreamHandle:
        code = NCCL_OPS[getattr(op, "value", op)]
        ptr, n, dt = tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor.dtype)
        return self._launch(tensor, lambda s: self._comm.allReduce(ptr, ptr, n, dt, code, s))

    def broadcast_async(self, tensor, root: int = 0) -> StreamHandle:
        ptr, n, dt = tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor.dtype)
        return self._launch(tensor, lambda s: self._comm.bcast(ptr, n, dt, root, s))

    def allgather_async(self, tensor) -> StreamHandle:
        import torch

        out = torch.empty((self.size,) + tuple(tensor.shape), dtype=tensor.dtype,
                          device=tensor.device)
        ptr, n, dt = tensor.data_ptr(), tensor.numel(), nccl_dtype(tensor.dtype)
        handle = self._launch(tensor, lambda s: self._comm.allGather(ptr, out.data_ptr(), n,
                                                                     dt, s))
        handle._result = out
        return handle

    def abort(self) -> None:
        """End the communicator at once, even with collectives stuck on a dead peer."""
        if self._comm is not None:
            self._comm.abort()
            self._comm = None

    def destroy(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
