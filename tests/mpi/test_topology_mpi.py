"""Allreduce topologies on real MPI ranks (run at -n 2 and -n 4); every assertion holds at
any world size >= 2.

What "the same as flat" means here: integer data, and floats holding whole numbers (exact
in the dtype, so any order of addition gives the same bits), are compared bit for bit, for
SUM, AVERAGE, MIN and MAX; random floats are compared within the bound on the rounding of
two summation orders, ``|topology - flat| <= 2 * size * eps * sum_i |x_i|`` per element.
Every topology must also leave the same bits on every rank."""

import logging

import numpy as np
import pytest
import torch
from mpi4py import MPI

import hpcadapt
from hpcadapt import ReduceOp
from hpcadapt.base.errors import CommunicationError, ConfigurationError
from hpcadapt.comm.topology import Topology, TopologySwitch, build_topology

pytestmark = pytest.mark.mpi(min_size=2)

TOPOLOGIES = list(Topology)
NODES = ["1", "2", "size"]  # emulated ranks per node: one each, pairs, everyone on one node
# Only the hierarchical topology looks at the nodes: the others are run in pairs only.
LAYOUTS = [(t, k) for t in TOPOLOGIES for k in (NODES if t is Topology.HIERARCHICAL else ["2"])]
OPS = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX]


@pytest.fixture(scope="module")
def w():
    return hpcadapt.init()


@pytest.fixture(scope="module")
def built(w):
    """Topologies built once per (topology, ranks per node) for the module, freed after.
    Tests run in the same order on every rank, so the collective builds line up."""
    cache = {}

    def get(topology, per_node):
        k = w.size if per_node == "size" else int(per_node)
        key = (topology, k)
        if key not in cache:
            cache[key] = build_topology(topology, w, ranks_per_node=k)
        return cache[key]

    yield get
    for topo in cache.values():
        topo.free()


def flat(w, x, op):
    """The reference: MPI's own allreduce on the world, on a copy."""
    return hpcadapt.MPICommunicator(w).allreduce(x.copy(), op)


def integer_valued(n, rank, dtype):
    """Whole numbers, different on every rank, negative ones too: exact in every dtype."""
    return (((np.arange(n) * 7 + 3 * rank) % 101) - 50 + rank).astype(dtype)


def same_bits_everywhere(w, x):
    rows = w.comm.allgather(np.ascontiguousarray(x).tobytes())
    return all(r == rows[0] for r in rows)


def lengths(size):
    """Empty, shorter than the world (odd), around the world size, and longer odd ones."""
    return sorted({0, 1, max(size - 1, 1), size + 1, 1001})


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
@pytest.mark.parametrize("topology,per_node", LAYOUTS)
def test_bit_identical_to_flat_on_exact_values(w, built, topology, per_node, dtype):
    topo = built(topology, per_node)
    results = []
    for n in lengths(w.size):
        for op in OPS:
            x = integer_valued(n, w.rank, dtype)
            expect = flat(w, x, op)
            out = topo.allreduce(x, op)
            assert out is x
            assert x.dtype == np.dtype(dtype) and x.shape == (n,)
            assert np.array_equal(x, expect), (topology, per_node, n, op, x[:8], expect[:8])
            results.append(x)
    assert same_bits_everywhere(w, np.concatenate(results))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("topology,per_node", LAYOUTS)
def test_random_floats_within_rounding_of_flat(w, built, topology, per_node, dtype):
    topo = built(topology, per_node)
    rng = np.random.default_rng(1000 + w.rank)
    eps = np.finfo(dtype).eps
    for n in (5, 4099):
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)
        expect = flat(w, x, ReduceOp.SUM)
        bound = 2 * w.size * eps * flat(w, np.abs(x), ReduceOp.SUM)
        topo.allreduce(x, ReduceOp.SUM)
        assert np.all(np.abs(x.astype(np.float64) - expect) <= bound), topology
        assert same_bits_everywhere(w, x)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_torch_tensors_in_place(w, built, topology):
    topo = built(topology, "2")
    t = torch.full((37,), float(w.rank + 1))
    ptr = t.data_ptr()
    assert topo.allreduce_async(t, ReduceOp.AVERAGE).wait() is t
    assert t.data_ptr() == ptr and torch.all(t == (w.size + 1) / 2)
    v = torch.ones(6, 5).t()  # a transposed view: copied out and written back
    topo.allreduce(v, ReduceOp.SUM)
    assert torch.all(v == w.size)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_many_handles_in_flight_polled_out_of_order(w, built, topology):
    """Operations in flight together on one topology do not take each other's messages."""
    topo = built(topology, "2")
    xs = [np.full(i * 5 + 1, float(w.rank + i), dtype=np.float64) for i in range(6)]
    handles = [topo.allreduce_async(x, ReduceOp.SUM) for x in xs]
    while not all(h.test() for h in reversed(handles)):
        pass
    for i, (h, x) in enumerate(zip(handles, xs)):
        assert h.wait() is x
        assert np.all(x == sum(range(w.size)) + i * w.size)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_ranks_that_poll_differently_agree(w, built, topology):
    """Even ranks finish the first allreduce before starting the second; odd ranks start
    both, then wait for the second first: the collectives inside the hierarchical
    topology still line up (each stage has its own communicator, later stages start in
    issue order)."""
    topo = built(topology, "2")
    a, b = np.full(9, float(w.rank)), np.full(4, 1.0 + w.rank)
    if w.rank % 2 == 0:
        topo.allreduce_async(a).wait()
        hb = topo.allreduce_async(b)
        while not hb.test():
            pass
    else:
        ha, hb = topo.allreduce_async(a), topo.allreduce_async(b)
        hb.wait()
        ha.wait()
    total = sum(range(w.size))
    assert np.all(a == total) and np.all(b == total + w.size)


def test_hierarchical_on_one_node_falls_back_to_flat_with_a_reason(w, caplog):
    with caplog.at_level(logging.INFO, logger="hpcadapt.comm.topology"):
        topo = build_topology("hierarchical", w, ranks_per_node=w.size)
    try:
        assert topo.topology is Topology.FLAT and topo.requested is Topology.HIERARCHICAL
        assert f"all {w.size} ranks are on one node" == topo.fallback_reason
        logged = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
        assert len(logged) == (1 if w.rank == 0 else 0), logged
        x = integer_valued(11, w.rank, np.float32)
        assert np.array_equal(topo.allreduce(x.copy()), flat(w, x, ReduceOp.SUM))
    finally:
        topo.free()


def test_hierarchical_on_the_real_nodes(w):
    """On one host the real nodes are one node: flat, with the reason; on a cluster of
    several nodes the node communicators are used."""
    topo = build_topology(Topology.HIERARCHICAL, w)
    try:
        nodes = len(topo.layout.nodes)
        assert not topo.layout.emulated and topo.layout.size == w.size
        if nodes == 1:
            assert topo.topology is Topology.FLAT and "one node" in topo.fallback_reason
        elif nodes < w.size:
            assert topo.topology is Topology.HIERARCHICAL and topo.fallback_reason is None
        x = integer_valued(9, w.rank, np.float64)
        assert np.array_equal(topo.allreduce(x.copy()), flat(w, x, ReduceOp.SUM))
    finally:
        topo.free()


def test_hierarchical_one_rank_per_node_is_flat(w, built):
    topo = built(Topology.HIERARCHICAL, "1")
    assert topo.topology is Topology.FLAT and "one rank" in topo.fallback_reason


def test_hierarchical_uses_nodes_when_there_are_several(w, built):
    topo = built(Topology.HIERARCHICAL, "2")
    if w.size > 2:
        assert topo.topology is Topology.HIERARCHICAL and topo.fallback_reason is None
        assert topo.layout.leaders == tuple(range(0, w.size, 2))
    else:  # two ranks in nodes of two: one node
        assert topo.topology is Topology.FLAT and topo.fallback_reason


def test_switch_at_step_boundaries_gives_flat_results(w):
    """A training-like loop switching topology every step: the same bits as flat for
    whole-number gradients, within rounding for random ones."""
    switch = TopologySwitch(w, ranks_per_node=2)
    rng = np.random.default_rng(7 + w.rank)
    try:
        order = ["flat", "ring", "tree", "hierarchical", "ring", "flat", "tree", "hierarchical"]
        for step, name in enumerate(order):
            assert switch.switch(name).requested is Topology(name)
            grads = [integer_valued(n, w.rank + step, np.float32) for n in (3, 129)]
            expect = [flat(w, g, ReduceOp.AVERAGE) for g in grads]
            handles = [switch.allreduce_async(g, ReduceOp.AVERAGE) for g in grads]
            for h, g, e in zip(handles, grads, expect):
                assert h.wait() is g and np.array_equal(g, e), (step, name)
            noisy = rng.standard_normal(257).astype(np.float32)
            bound = 2 * w.size * np.finfo(np.float32).eps * flat(w, np.abs(noisy), ReduceOp.SUM)
            reference = flat(w, noisy, ReduceOp.SUM)
            switch.allreduce(noisy, ReduceOp.SUM)
            assert np.all(np.abs(noisy - reference) <= bound)
        # a handle started before a switch finishes on its own topology, and the ranks
        # may wait for the two in different orders
        x, y = np.full(10, 1.0), np.full(3, 2.0)
        switch.switch("ring")
        hx = switch.allreduce_async(x)
        switch.switch("tree")
        hy = switch.allreduce_async(y)
        for h in ([hx, hy] if w.rank % 2 else [hy, hx]):
            h.wait()
        assert np.all(x == w.size) and np.all(y == 2 * w.size)
    finally:
        switch.free()


def test_other_collectives_through_a_topology(w, built):
    topo = built(Topology.RING, "2")
    x = np.arange(4.0) * (w.rank + 1)
    topo.broadcast_async(x, root=w.size - 1).wait()
    assert np.array_equal(x, np.arange(4.0) * w.size)
    stacked = topo.allgather_async(torch.tensor([float(w.rank)])).wait()
    assert stacked.reshape(-1).tolist() == [float(r) for r in range(w.size)]
    topo.barrier_async().wait()
    with pytest.raises(CommunicationError, match="root"):
        topo.broadcast_async(x, root=w.size)


def test_bad_inputs_are_refused_before_any_message(w, built):
    with pytest.raises(ConfigurationError, match="flat, hierarchical, ring, tree"):
        build_topology("star", w)
    with pytest.raises(ConfigurationError, match="ranks per node 0"):
        build_topology("ring", w, ranks_per_node=0)
    topo = built(Topology.TREE, "1")
    with pytest.raises(CommunicationError, match="unknown reduction"):
        topo.allreduce(np.zeros(2), "median")
    with pytest.raises(CommunicationError, match="bfloat16"):
        topo.allreduce(torch.zeros(2, dtype=torch.bfloat16))


def test_mismatched_lengths_are_caught_when_checking(w, monkeypatch):
    monkeypatch.setenv("HPCADAPT_CHECK_COLLECTIVES", "1")
    topo = build_topology("ring", w)
    try:
        with pytest.raises(CommunicationError, match="different shapes"):
            topo.allreduce(np.zeros(3 if w.rank == 0 else 4))
    finally:
        topo.free()


def test_free_releases_communicators(w):
    topo = build_topology("hierarchical", w, ranks_per_node=2)
    topo.free()
    topo.free()  # idempotent
    with pytest.raises(ConfigurationError, match="freed"):
        topo.allreduce(np.ones(3))
    assert MPI.COMM_WORLD.Get_size() == w.size  # the world itself untouched
    hpcadapt.allreduce(np.ones(3))
