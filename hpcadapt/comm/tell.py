"""Root tells everyone: the one way a decision, a flag or a verdict of one rank (the
coordinator) reaches every rank of a world.

A length first, then the bytes when there are any: ``None`` costs one 8-byte broadcast (the
plan of a step without a decision). Values travel as ``torch.save`` bytes and are read with
``weights_only=True``: plain values, containers and tensors, never an arbitrary pickle.
Every wait is bounded by the world's watch (PeerFailure when a peer dies or stays silent)."""

from __future__ import annotations

import io
from typing import Any, Optional

import numpy as np
import torch

from hpcadapt.comm.world import World, wait_request, world as current_world

__all__ = ["root_tells", "broadcast_object_state"]


def root_tells(value: Any, world: World, *, root: int = 0, what: str = "a broadcast") -> Any:
    """``root``'s ``value`` on every rank of ``world`` (the others pass anything, usually
    None). ``what`` names the broadcast in a failure's message."""
    comm = world.comm
    if comm.Get_size() == 1:
        return value
    mine = comm.Get_rank() == root
    payload = b""
    if mine and value is not None:
        buf = io.BytesIO()
        torch.save(value, buf)
        payload = buf.getvalue()
    n = np.array([len(payload)], dtype=np.int64)
    wait_request(comm.Ibcast(n, root=root), world.watch, what)
    if n[0] == 0:
        return None
    data = np.frombuffer(payload, dtype=np.uint8).copy() if mine \
        else np.empty(int(n[0]), dtype=np.uint8)
    wait_request(comm.Ibcast(data, root=root), world.watch, what)
    if mine:
        return value
    return torch.load(io.BytesIO(data.tobytes()), weights_only=True)


def broadcast_object_state(state: Optional[dict], *, root: int = 0,
                           world: Optional[World] = None) -> dict:
    """Broadcast a dict of tensors and plain values from root (``root_tells`` for the
    library's users: the current world by default)."""
    return root_tells(state, world if world is not None else current_world(), root=root,
                      what="a state broadcast")
