"""Pair averaging's model exchange: every rank publishes its parameters in an MPI window
that any other rank reads without the owner taking part (KungFu's pair averaging).

The window is ``MPI.Win.Allocate`` memory, read with ``Rget`` inside one passive epoch
opened with ``Lock_all(MODE_NOCHECK)`` for the window's life. MPICH (ch4) serves such a
read between processes of one node straight from the owner's memory (no message, no
progress needed of the owner: measured with the owner spinning in pure Python) and over
the network by RDMA where the interconnect has it; a lock without NOCHECK, or a window
made by ``Win.Create``, waited for the owner's next MPI call (a 10 s stall in the test).

Consistency: NOCHECK gives no exclusion, so the owner double-buffers. Header words
``started`` and ``done`` (int64); publishing number k stores ``started = k``, writes slot
``k % 2``, then stores ``done = k`` (``Win.Sync`` between, as memory barriers). A reader
takes ``done = v``, reads slot ``v % 2``, then reads ``started`` again: the slot can only
have been touched if ``started >= v + 2`` (the owner began a second publication during the
read), and then it reads again. A fetch never mixes two versions. (Rare in the job: a peer
publishes once per step, and the fetcher usually finishes its fetch before the step's
control reduction lets the peer start another; on monitored steps the fetch is finished
after the gradient allreduce, so two publications during one fetch can happen there, and
the retry handles them.) Assumed: each aligned 8-byte header word is read whole (true of
loads from shared memory and of RDMA reads), and ``Win.Sync`` orders the owner's stores
(it is the window's memory barrier in MPI's unified and separate models alike).

Parameters on a GPU are published and fetched through host copies (the window is host
memory), one device-to-host copy per step for the publication and one host-to-device copy
for the mix."""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence

import numpy as np
import torch
from hpcadapt.comm.mpi import MPI

from hpcadapt.base.errors import CommunicationError
from hpcadapt.comm.world import ABANDONED, PeerFailure, World, wait_request

__all__ = ["choose_peer", "PairExchange"]

log = logging.getLogger(__name__)

_SEED = 0x9A1A  # the pairs differ per step and per rank, but every run draws the same ones
_HEADER = 64    # bytes before slot 0: int64 started, done (a cache line)
_ALIGN = 64
_RETRIES = 8    # torn reads in a row before giving up (each needs two publications)


def choose_peer(step: int, rank: int, size: int, seed: int = _SEED) -> int:
    """The rank that ``rank`` averages with at ``step``: uniform over the other ``size - 1``
    ranks, the same in every run (a pure function of its arguments)."""
    if size < 2:
        raise ValueError(f"pair averaging needs 2 or more ranks, got a world of {size}")
    j = int(np.random.default_rng([seed, step, rank, size]).integers(size - 1))
    return j if j < rank else j + 1


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class PairExchange:
    """The published parameters of every rank of one world (``cluster_version``), and this
    rank's fetch of one peer's. Collective: construction and ``free`` (every rank of the
    world, at the same point); ``publish``, ``start_fetch`` and ``finish_fetch`` are this
    rank's alone."""

    def __init__(self, world: World, tensors: Sequence[torch.Tensor]):
        self.world = world
        self.cluster_version = world.cluster_version
        self._layout = []  # (offset, nbytes) of each tensor in a slot
        offset = 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            self._layout.append((offset, nbytes))
            offset += _round(nbytes)
        self.slot_bytes = max(offset, _ALIGN)
        # Our own communicator: freeing the window needs a barrier first that is bounded,
        # and the world's communicator may already be gone (freed in a resize).
        self._comm = world.comm.Dup()
        self._win = MPI.Win.Allocate(_HEADER + 2 * self.slot_bytes, 1, comm=self._comm)
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._mem = torch.frombuffer(self._win.tomemory(), dtype=torch.uint8)
        self._header = self._mem[:16].view(torch.int64)
        self._header.zero_()
        self._published = 0
        self._recv = np.empty(self.slot_bytes, dtype=np.uint8)
        self._peer_header = np.zeros(2, dtype=np.int64)
        self._fetch: Optional[tuple] = None  # (peer, version, request)
        self.peer: Optional[int] = None

    # -- the owner ------------------------------------------------------------------------
    def publish(self, tensors: Sequence[torch.Tensor]) -> None:
        """Make ``tensors`` (same layout as at construction) the version others fetch."""
        k = self._published + 1
        self._header[0] = k
        self._win.Sync()
        base = _HEADER + (k % 2) * self.slot_bytes
        with torch.no_grad():
            for t, (offset, nbytes) in zip(tensors, self._layout):
                dst = self._mem[base + offset:base + offset + nbytes]
                dst.view(t.dtype).view(t.shape).copy_(t.detach())
        self._win.Sync()
        self._header[1] = k
        self._win.Sync()
        self._published = k

    # -- the fetcher ----------------------------------------------------------------------
    def _get_header(self, peer: int, what: str) -> None:
        req = self._win.Rget([self._peer_header, MPI.BYTE], peer, (0, 16, MPI.BYTE))
        wait_request(req, self.world.watch, what)

    def _get_slot(self, peer: int, version: int) -> MPI.Request:
        disp = _HEADER + (version % 2) * self.slot_bytes
        return self._win.Rget([self._recv, MPI.BYTE], peer, (disp, self.slot_bytes, MPI.BYTE))

    def start_fetch(self, peer: int) -> None:
        """Start reading ``peer``'s newest complete publication (the header read is waited
        for, bounded; the slot's read goes on in the background)."""
        if peer == self.world.rank:
            raise ValueError(f"rank {peer} cannot fetch its own model")
        self._get_header(peer, "a peer's model version (pair averaging)")
        version = int(self._peer_header[1])
        if version < 1:
            raise CommunicationError(f"rank {peer} has published no model yet")
        self._fetch = (peer, version, self._get_slot(peer, version))

    @property
    def fetching(self) -> bool:
        return self._fetch is not None

    def finish_fetch(self) -> List[torch.Tensor]:
        """Wait (bounded) for the fetch; the peer's tensors as flat views of the receive
        buffer (valid until the next fetch), in the construction's order. PeerFailure if
        the peer is dead or silent, CommunicationError if its publications overran every
        read (never expected)."""
        peer, version, req = self._fetch
        self._fetch = None
        for _ in range(_RETRIES):
            wait_request(req, self.world.watch, "a peer's model (pair averaging)")
            self._get_header(peer, "a peer's model version (pair averaging)")
            if int(self._peer_header[0]) < version + 2:
                break  # the slot was not written again while we read it
            version = int(self._peer_header[1])
            req = self._get_slot(peer, version)
        else:
            raise CommunicationError(f"rank {peer} published faster than {_RETRIES} reads "
                                     f"of its model could complete")
        self.peer = peer
        recv = torch.from_numpy(self._recv)
        return [recv[o:o + n] for o, n in self._layout]

    # -- lifetime -------------------------------------------------------------------------
    def free(self) -> None:
        """Release the window (collective over the ranks it was made for: a bounded
        barrier first, since MPI's own free waits on every one of them). A peer found dead
        here leaves the window abandoned instead."""
        if self._win is None:
            return
        try:
            wait_request(self._comm.Ibarrier(), self.world.watch, "the pair window's release")
        except PeerFailure as exc:
            log.warning("pair-averaging window left unfreed: %s", exc)
            self.abandon()
            return
        self._win.Unlock_all()
        self._win.Free()
        log.debug("pair-averaging window of cluster version %d freed", self.cluster_version)
        self._comm.Free()
        self._win = self._comm = self._mem = self._header = None

    def abandon(self) -> None:
        """A peer died: keep the window and its buffers referenced, never freed (freeing
        would wait on the dead; an Rget in flight may still write into ``_recv``)."""
        if self._win is not None:
            ABANDONED.append((self._win, self._comm, self._mem, self._recv, self._fetch))
        self._win = self._comm = None
        self._fetch = None
