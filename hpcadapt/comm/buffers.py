"""Views of numpy arrays and CPU torch tensors as MPI buffers, without copies where possible."""

from __future__ import annotations

import hashlib
import weakref
from typing import Callable, Tuple, Union

import numpy as np
import torch

from hpcadapt.base.errors import CommunicationError

__all__ = ["Array", "as_buffer", "layout_signature"]

Array = Union[np.ndarray, torch.Tensor]

# dtypes MPI can reduce through mpi4py's numpy type map
_REDUCIBLE = {np.dtype(t) for t in (np.float32, np.float64, np.int8, np.int16, np.int32,
                                     np.int64, np.uint8, np.uint16, np.uint32, np.uint64)}


def as_buffer(x: Array, *, reduce: bool = False) -> Tuple[np.ndarray, Callable[[], None]]:
    """Return a numpy view of ``x`` for MPI and a function that writes results back.

    Contiguous arrays and CPU tensors are shared, so write-back does nothing; a
    non-contiguous input is copied into a contiguous buffer and copied back after.
    Raises CommunicationError for tensors off the CPU and dtypes MPI cannot carry."""
    cached = _views.get(id(x))
    if (cached is not None and cached[0]() is x and cached[1] == x.data_ptr()
            and cached[2] == x.shape):
        # the hot path: a tensor seen before, already checked
        if reduce and not cached[4]:
            _check_reducible(cached[3])
        return cached[3], _nothing
    if isinstance(x, torch.Tensor):
        if not x.is_cpu:
            raise CommunicationError(
                f"host collectives take CPU tensors, got one on {x.device}; "
                "CUDA tensors travel through hpcadapt.cuda (NCCL)")
        if x.dtype == torch.bfloat16:
            raise CommunicationError("bfloat16 tensors cannot travel over MPI; cast to float32")
        if x.is_contiguous():
            view = (x.detach() if x.requires_grad else x).numpy()
            done = _nothing
            key = id(x)
            _views[key] = (weakref.ref(x, lambda _, k=key: _views.pop(k, None)),
                           x.data_ptr(), x.shape, view, view.dtype in _REDUCIBLE)
        else:
            t = x.detach()
            tmp = t.contiguous()
            view = tmp.numpy()

            def done() -> None:
                t.copy_(tmp)
    elif isinstance(x, np.ndarray):
        if x.flags.c_contiguous:
            view = x
            done = _nothing
        else:
            tmp_np = np.ascontiguousarray(x)
            view = tmp_np

            def done() -> None:
                np.copyto(x, tmp_np)
    else:
        raise CommunicationError(
            f"expected a numpy array or a torch tensor, got {type(x).__name__}")
    if reduce:
        _check_reducible(view)
    return view, done


def _check_reducible(view: np.ndarray) -> None:
    if view.dtype not in _REDUCIBLE:
        raise CommunicationError(f"dtype {view.dtype} cannot be reduced over MPI; "
                                 f"use one of {sorted(str(d) for d in _REDUCIBLE)}")


# Making a numpy view of a tensor costs microseconds per call; tensors that travel every
# step (buckets, user buffers) keep theirs. Entries die with their tensors.
_views: dict = {}


def _nothing() -> None:
    return None


def layout_signature(items) -> int:
    """A 63-bit hash of (shape, dtype) pairs: cheap to compare across ranks."""
    h = hashlib.blake2b(digest_size=8)
    for shape, dtype in items:
        h.update(repr((tuple(shape), str(dtype))).encode())
    return int.from_bytes(h.digest(), "little") >> 1
