"""Allreduce topologies without mpiexec: the flag and name parsers, node layouts, the ring's
chunks, the error messages, and every topology on a world of one (MPI.COMM_SELF)."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcadapt import ReduceOp
from hpcadapt.base.errors import ConfigurationError
from hpcadapt.comm.topology import (NodeLayout, Topology, TopologySwitch, _chunks, build_topology,
                               emulated_layout, layout_from_keys, parse_ranks_per_node,
                               parse_topology)


@pytest.mark.parametrize("name,expect", [
    ("flat", Topology.FLAT), ("Hierarchical", Topology.HIERARCHICAL), (" ring ", Topology.RING),
    ("TREE", Topology.TREE), (Topology.RING, Topology.RING)])
def test_topology_names(name, expect):
    assert parse_topology(name) is expect


@pytest.mark.parametrize("bad", ["star", "", "rings", None, 3])
def test_unknown_topology_quotes_it_and_lists_the_choices(bad):
    with pytest.raises(ConfigurationError) as err:
        parse_topology(bad)
    message = str(err.value)
    assert repr(bad) in message
    assert "choose one of flat, hierarchical, ring, tree" in message


@pytest.mark.parametrize("value,expect", [
    (None, None), ("", None), ("auto", None), (" AUTO ", None), (1, 1), ("2", 2), (" 4 ", 4),
    (np.int64(3), 3), (1000, 1000)])
def test_ranks_per_node_flag(value, expect):
    assert parse_ranks_per_node(value) == expect


@pytest.mark.parametrize("bad", [0, -1, "0", "-2", "2.5", "two", "2 nodes", True, 2.0, [2]])
def test_bad_ranks_per_node_quotes_it_and_says_what_works(bad):
    with pytest.raises(ConfigurationError) as err:
        parse_ranks_per_node(bad)
    message = str(err.value)
    assert f"ranks per node {bad!r} is not usable" in message
    assert "whole number >= 1" in message and "'auto'" in message


def test_ranks_per_node_is_a_value_error_for_argparse():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks-per-node", type=parse_ranks_per_node, default=None)
    assert ap.parse_args(["--ranks-per-node", "2"]).ranks_per_node == 2
    with pytest.raises(SystemExit):
        ap.parse_args(["--ranks-per-node", "0"])


@pytest.mark.parametrize("size,k,nodes", [
    (4, 2, ((0, 1), (2, 3))),
    (5, 2, ((0, 1), (2, 3), (4,))),
    (4, 1, ((0,), (1,), (2,), (3,))),
    (4, 4, ((0, 1, 2, 3),)),
    (3, 8, ((0, 1, 2),)),
    (1, 1, ((0,),)),
])
def test_emulated_nodes_are_consecutive_ranks(size, k, nodes):
    layout = emulated_layout(size, k)
    assert layout == NodeLayout(nodes, emulated=True)
    assert layout.size == size
    assert layout.leaders == tuple(n[0] for n in nodes)
    assert [layout.node_of(r) for r in range(size)] == [
        i for i, n in enumerate(nodes) for _ in n]


def test_emulated_layout_refuses_bad_input():
    with pytest.raises(ConfigurationError, match="ranks per node 0"):
        emulated_layout(4, 0)
    with pytest.raises(ConfigurationError, match="cannot lay 0 rank"):
        emulated_layout(0, 2)
    with pytest.raises(ConfigurationError, match="rank 9 is on no node"):
        emulated_layout(4, 2).node_of(9)


def test_real_nodes_from_keys_keep_rank_order():
    layout = layout_from_keys([7, 9, 7, 9, 5])
    assert layout.nodes == ((0, 2), (1, 3), (4,)) and not layout.emulated
    assert layout.leaders == (0, 1, 4)
    assert "3 real node(s) of [2, 2, 1] ranks" == layout.describe()


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 7, 1001])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_ring_chunks_cover_the_array(n, parts):
    chunks = _chunks(n, parts)
    assert len(chunks) == parts
    assert chunks[0][0] == 0 and chunks[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    lengths = [b - a for a, b in chunks]
    assert max(lengths) - min(lengths) <= 1 and lengths[0] == max(lengths)


# -- a world of one: no messages, but the whole path of every topology -----------------------
@pytest.mark.parametrize("topology", list(Topology))
def test_world_of_one(topology):
    topo = build_topology(topology, MPI.COMM_SELF)
    try:
        x = np.arange(5, dtype=np.float32)
        assert topo.allreduce(x, ReduceOp.AVERAGE) is x and np.array_equal(x, np.arange(5))
        t = torch.ones(3)
        assert topo.allreduce_async(t, ReduceOp.SUM).wait() is t and torch.all(t == 1)
        assert topo.allreduce(np.zeros(0)).shape == (0,)
        if topology is Topology.HIERARCHICAL:
            assert topo.topology is Topology.FLAT
            assert topo.fallback_reason == "all 1 ranks are on one node"
        else:
            assert topo.topology is topology and topo.fallback_reason is None
    finally:
        topo.free()
    with pytest.raises(ConfigurationError, match=f"this {topo.topology.value} topology has "
                                                 "been freed"):
        topo.allreduce(np.ones(2))


def test_build_refuses_what_is_not_a_communicator():
    with pytest.raises(ConfigurationError, match="World or an MPI intracommunicator, got list"):
        build_topology("flat", [1, 2])


def test_switch_on_a_world_of_one():
    switch = TopologySwitch(MPI.COMM_SELF, initial="tree")
    try:
        assert switch.current.topology is Topology.TREE and switch.size == 1
        ring = switch.switch("ring")
        assert switch.switch(Topology.RING) is ring  # built once, kept
        x = np.ones(4)
        assert np.all(switch.allreduce(x) == 1)
        with pytest.raises(ConfigurationError, match="choose one of"):
            switch.switch("mesh")
        assert switch.current is ring  # a refused switch changes nothing
    finally:
        switch.free()
