"""The node-local state broadcast (a memory file) on real MPI ranks, and its MPI fallback:
every rank ends with root's bytes, both ways, from any root; assertions hold at any size."""

import numpy as np
import pytest
import torch

import hpcadapt
from hpcadapt.comm import nodecast
from hpcadapt.parallel.broadcasts import pack_broadcast

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def w():
    return hpcadapt.init()


def _tensors(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(700_000, generator=g),            # 2.8 MB: above MIN_BYTES alone
            torch.randn(3, 5, generator=g).t(),           # not contiguous
            torch.randn(1000, generator=g).to(torch.bfloat16),  # no numpy dtype
            torch.zeros(0),                                # empty
            torch.tensor(float(rank)),                     # 0-dim
            torch.arange(10, dtype=torch.int64) * (rank + 1)]


@pytest.mark.parametrize("transport", ["auto", "mpi"])
def test_every_rank_ends_with_roots_tensors(w, transport, monkeypatch):
    monkeypatch.setenv("HPCADAPT_STATE_TRANSPORT", transport)
    root = w.size - 1
    mine = _tensors(w.rank)
    expected = _tensors(root)
    pack_broadcast(mine, root, w.comm, 1 << 20, w.watch)
    for got, want in zip(mine, expected):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_buffers_go_through_the_memory_file_on_one_node(w, monkeypatch):
    monkeypatch.setenv("HPCADAPT_STATE_TRANSPORT", "auto")
    bufs = [np.full(1 << 20, w.rank, dtype=np.uint8), np.full(7, w.rank + 1, dtype=np.int64)]
    assert nodecast.broadcast_buffers(w.comm, bufs, 0, w.watch) is True
    assert (bufs[0] == 0).all() and (bufs[1] == 1).all()


def test_mpi_transport_declines_on_every_rank(w, monkeypatch):
    monkeypatch.setenv("HPCADAPT_STATE_TRANSPORT", "mpi")
    bufs = [np.full(1 << 21, w.rank, dtype=np.uint8)]
    assert nodecast.broadcast_buffers(w.comm, bufs, 0, w.watch) is False
    assert (bufs[0] == w.rank).all()  # untouched: the caller goes over MPI


def test_ranks_configured_differently_all_fall_back_together(w, monkeypatch):
    """One rank says mpi, the others auto: no rank goes its own way (the choice is folded
    into the confirmation), the broadcast still arrives over MPI."""
    monkeypatch.setenv("HPCADAPT_STATE_TRANSPORT", "mpi" if w.rank == 1 else "auto")
    mine = [torch.full((600_000,), float(w.rank))]
    pack_broadcast(mine, 0, w.comm, 1 << 20, w.watch)
    assert torch.equal(mine[0], torch.zeros(600_000))


def test_a_root_that_cannot_make_the_file_sends_over_mpi(w, monkeypatch):
    if w.rank == 0:
        def refuse(*a):
            raise OSError(24, "Too many open files")
        monkeypatch.setattr(nodecast, "_write_memfd", refuse)
    bufs = [np.full(1 << 21, w.rank, dtype=np.uint8)]
    assert nodecast.broadcast_buffers(w.comm, bufs, 0, w.watch) is False
    mine = [torch.full((600_000,), float(w.rank))]
    pack_broadcast(mine, 0, w.comm, 1 << 20, w.watch)
    assert torch.equal(mine[0], torch.zeros(600_000))
