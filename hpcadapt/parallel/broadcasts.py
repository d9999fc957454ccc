"""Root's tensors to every rank: parameters and buffers (packed into fused buckets, or
through a memory file between processes of one node), the optimizer's state, and the
per-step broadcast of BatchNorm's buffers from rank 0 (``BufferBroadcast``)."""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from hpcadapt.comm.mpi import MPI

from hpcadapt.comm import nodecast
from hpcadapt.comm.collectives import Communicator, Handle
from hpcadapt.comm.fusion import Bucket, plan_buckets
from hpcadapt.comm.tell import root_tells
from hpcadapt.comm.world import World, wait_request, world as current_world

__all__ = ["BufferBroadcast", "broadcast_parameters", "broadcast_optimizer_state",
           "pack_broadcast"]

log = logging.getLogger(__name__)


class BufferBroadcast:
    """Rank 0's buffers to every rank, as one flat byte buffer on the parameters' device in
    one nonblocking broadcast over the data plane's communicator (any dtype: the bytes
    travel).

    ``start`` packs the buffers (after forward has updated them) and starts the broadcast;
    ``finish`` waits for it (bounded: PeerFailure for a dead or silent peer) and, off rank
    0, copies rank 0's values into the buffers. Between the two nothing may change them.
    (A step given up to a dead peer: the job puts the buffers back as the step began,
    hpcadapt.state.rollback, before it is trained again.)"""

    def __init__(self, buffers: Sequence[torch.Tensor], device: torch.device):
        self.buffers = list(buffers)
        self._device = device
        self._layout: List[Tuple[int, int]] = []  # (offset, nbytes) in the flat buffer
        offset = 0
        for t in self.buffers:
            offset = -(-offset // t.element_size()) * t.element_size()  # aligned views
            nbytes = t.numel() * t.element_size()
            self._layout.append((offset, nbytes))
            offset += nbytes
        self.nbytes = offset
        self._flat: Optional[torch.Tensor] = None
        self._views: List[torch.Tensor] = []
        self._inflight: Optional[Tuple[Handle, torch.Tensor]] = None

    def _allocate(self) -> None:
        from hpcadapt.comm.fusion import zeros

        self._flat = zeros(self.nbytes, torch.uint8, self._device)
        self._views = [self._flat[o:o + n].view(t.dtype).view(t.shape)
                       for t, (o, n) in zip(self.buffers, self._layout)]

    def start(self, comm: Communicator, root: int = 0) -> None:
        if not self.buffers:
            return
        if self._flat is None:
            self._allocate()
        with torch.no_grad():
            torch._foreach_copy_(self._views, [b.detach() for b in self.buffers])
        self._inflight = (comm.broadcast_async(self._flat, root), self._flat)

    def finish(self, rank: int, root: int = 0) -> None:
        if self._inflight is None:
            return
        handle, _ = self._inflight
        handle.wait()  # bounded like every wait on a peer
        self._inflight = None
        if rank != root:
            with torch.no_grad():
                torch._foreach_copy_(self.buffers, self._views)

    def abandon(self) -> None:
        """A peer died: the broadcast in flight never completes and MPI may still name its
        buffer, so that is kept (never reused, never freed); a fresh one comes next time."""
        from hpcadapt.comm.world import ABANDONED

        if self._inflight is not None:
            ABANDONED.append(self._inflight)
            self._inflight = None
            self._flat = None
            self._views = []


def _bcast(comm: MPI.Intracomm, buf: np.ndarray, root: int, watch) -> None:
    """A broadcast whose wait is bounded (PeerFailure when a peer is dead or silent)."""
    wait_request(comm.Ibcast(buf, root=root), watch, "a state broadcast")


def pack_broadcast(tensors: Sequence[torch.Tensor], root: int, comm: MPI.Intracomm,
                    bucket_bytes: int, watch=None) -> None:
    """Root's ``tensors`` to every rank. State travels only at joins and recoveries, and
    device tensors go through the host. Between processes of one node straight from and
    into the tensors' memory through a memory file (``hpcadapt.comm.nodecast``: no packing);
    otherwise packed into fused buffers over MPI."""
    if _node_broadcast(tensors, root, comm, watch):
        return
    for group in plan_buckets(tensors, bucket_bytes):
        members = [tensors[i] for i in group]
        bucket = Bucket.for_tensors(members)
        if comm.Get_rank() == root:
            bucket.pack(members)
        host = bucket.flat if bucket.flat.is_cpu else bucket.flat.cpu()
        _bcast(comm, host.view(torch.uint8).numpy(), root, watch)  # bytes: any dtype
        with torch.no_grad():
            if host is not bucket.flat:
                bucket.flat.copy_(host)
            bucket.unpack(members)


def _node_broadcast(tensors: Sequence[torch.Tensor], root: int, comm: MPI.Intracomm,
                    watch) -> bool:
    """``tensors`` through ``nodecast`` as raw bytes; False (on every rank) where it does
    not apply. A tensor that is not contiguous in host memory goes through a host copy."""
    # The same on every rank (sizes only): whether to try is never a rank's own choice.
    if sum(t.nbytes for t in tensors) < nodecast.MIN_BYTES:
        return False
    hosts = [t if t.is_cpu and t.is_contiguous() else t.detach().cpu().contiguous()
             for t in tensors]
    views = [h.detach().reshape(-1).view(torch.uint8).numpy() for h in hosts if h.numel()]
    if not nodecast.broadcast_buffers(comm, views, root, watch):
        return False
    with torch.no_grad():
        for t, h in zip(tensors, hosts):
            if h is not t:
                t.copy_(h)
    return True


def broadcast_parameters(tensors: Sequence[torch.Tensor], *, root: int = 0,
                         world: Optional[World] = None,
                         bucket_bytes: int = 16 * 1024 * 1024) -> None:
    """Overwrite ``tensors`` (parameters, buffers) on every rank with root's values."""
    w = world if world is not None else current_world()
    tensors = [t.data if isinstance(t, torch.nn.Parameter) else t for t in tensors]
    pack_broadcast(tensors, root, w.comm, bucket_bytes, w.watch)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, *, root: int = 0,
                              world: Optional[World] = None) -> None:
    """Make every rank's optimizer state (momentum buffers, hyper-parameters) root's.

    The structure travels as a small document; the tensors travel as fused buffers."""
    w = world if world is not None else current_world()
    if w.size == 1:
        return
    is_root = w.comm.Get_rank() == root
    tensors: List[torch.Tensor] = []

    def strip(obj):
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            return ["__tensor__", len(tensors) - 1, list(obj.shape), str(obj.dtype)]
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(strip(v) for v in obj)
        return obj

    skeleton = root_tells(strip(optimizer.state_dict()) if is_root else None, w, root=root,
                          what="the optimizer state's broadcast")
    if not is_root:
        def build(obj):
            if isinstance(obj, list) and len(obj) == 4 and obj[0] == "__tensor__":
                t = torch.empty(obj[2], dtype=getattr(torch, obj[3].replace("torch.", "")))
                tensors.append(t)
                return t
            if isinstance(obj, dict):
                return {k: build(v) for k, v in obj.items()}
            if isinstance(obj, (list, tuple)):
                return type(obj)(build(v) for v in obj)
            return obj
        state = build(skeleton)
    if tensors:
        pack_broadcast(tensors, root, w.comm, 16 * 1024 * 1024, w.watch)
    if not is_root:
        optimizer.load_state_dict(state)
