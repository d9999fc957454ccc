"""CUDA tensors over MPI through pinned host memory, for clusters without NCCL and for
ranks that share one GPU (which NCCL refuses).

A collective copies the tensor to a pinned host buffer (from a pool per shape and dtype:
each collective in flight holds its own, returned on ``wait()``), runs the host collective
on it asynchronously, and on ``wait()`` copies the result back.
Written against torch tensors on any device, so the same code runs in the CPU tests (a CPU
tensor stands in for the device tensor; the copies are then plain copies)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

__all__ = ["HostStagedCommunicator"]


class _Staged:
    """A host collective on a staging buffer; ``wait()`` writes the result back."""

    def __init__(self, inner, tensor, host, give_back: Callable[[Any], None], keep=None):
        self._inner, self._tensor, self._host = inner, tensor, host
        self._give_back = give_back
        self._keep = keep if keep is not None else host   # the staging buffer to give back
        self._done = False

    def test(self) -> bool:
        return self._inner.test()

    def wait(self):
        if not self._done:
            result = self._inner.wait()
            # Synchronous back to a device: the buffer is reused as soon as it is given back.
            self._tensor.copy_(result if self._host is None else self._host)
            self._give_back(self._keep)
            self._done = True
        return self._tensor


class HostStagedCommunicator:
    """Collectives on tensors of any device over a host communicator (``MPICommunicator``
    or anything with the same ``*_async`` methods on CPU tensors)."""

    def __init__(self, host):
        self._host = host
        self._free: Dict[Tuple[Any, Tuple[int, ...]], List[Any]] = {}

    @property
    def rank(self) -> int:
        return self._host.rank

    @property
    def size(self) -> int:
        return self._host.size

    def _stage(self, tensor):
        import torch

        free = self._free.setdefault((tensor.dtype, tuple(tensor.shape)), [])
        buf = free.pop() if free else torch.empty(tensor.shape, dtype=tensor.dtype,
                                                  pin_memory=tensor.is_cuda)
        # MPI reads the host buffer from the CPU: the copy must be complete before.
        buf.copy_(tensor)
        return buf

    def _give_back(self, buf) -> None:
        self._free.setdefault((buf.dtype, tuple(buf.shape)), []).append(buf)

    def allreduce_async(self, tensor, op=None) -> _Staged:
        host = self._stage(tensor)
        inner = self._host.allreduce_async(host, op) if op is not None \
            else self._host.allreduce_async(host)
        return _Staged(inner, tensor, host, self._give_back)

    def broadcast_async(self, tensor, root: int = 0) -> _Staged:
        host = self._stage(tensor)
        return _Staged(self._host.broadcast_async(host, root), tensor, host, self._give_back)

    def allgather_async(self, tensor) -> _Staged:
        """The ranks' tensors stacked on a new leading axis, on ``tensor``'s device."""
        import torch

        host = self._stage(tensor)
        out = torch.empty((self.size,) + tuple(tensor.shape), dtype=tensor.dtype,
                          device=tensor.device)
        return _Staged(self._host.allgather_async(host), out, None, self._give_back,
                       keep=host)

    def barrier_async(self):
        return self._host.barrier_async()

    def release(self) -> None:
        """Drop the staging buffers (after a resize the shapes may change)."""
        self._free.clear()
