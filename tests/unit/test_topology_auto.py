"""The topology-auto policy's decisions from snapshots (pure, no MPI): the layout at the
start and after a resize, a majority of slower ranks switching to an untried candidate, a
minority or a steady exchange changing nothing."""

import pytest

from hpcadapt.base.plan import Plan
from hpcadapt.base.errors import ConfigurationError
from hpcadapt.policies import TopologyAuto
from hpcadapt.policies.base import Decision, MetricsSnapshot
from hpcadapt.policies.topology_auto import layout_choice


def _snap(step=0, world_size=4, nodes=2, topology="flat", waits=None):
    return MetricsSnapshot(step=step, epoch=0, world_size=world_size, batch_size=32, lr=0.1,
                           momentum=0.9, base_lr=0.1, base_batch_size=32, nodes=nodes,
                           topology=topology,
                           wait_time=tuple(waits if waits is not None else [0.01] * world_size))


def test_the_layout_decides_at_the_start_and_after_a_resize():
    assert layout_choice(4, 2) == "hierarchical"
    assert layout_choice(4, 1) == "flat" and layout_choice(4, 4) == "flat"
    p = TopologyAuto()
    d = p.before_train(_snap())
    assert d.topology == "hierarchical" and "2 node(s)" in d.reason
    assert p.before_train(_snap(topology="hierarchical")) is None
    d = p.on_resize(_snap(world_size=2, nodes=2, topology="hierarchical"), old_size=4,
                    new_size=2)
    assert d.topology == "flat" and "4 -> 2" in d.reason


def _feed(p, topology, waits, steps, start=0):
    out = []
    for i in range(steps):
        d = p.after_step(_snap(step=start + i, topology=topology, waits=waits))
        if d is not None:
            out.append(d)
    return out


def test_a_majority_of_slower_ranks_switches_and_a_minority_does_not():
    p = TopologyAuto(threshold=0.8, window=5)
    p.before_train(_snap(topology="hierarchical"))
    assert _feed(p, "hierarchical", [0.010] * 4, 5) == []           # the reference window
    assert _feed(p, "hierarchical", [0.030, 0.030, 0.010, 0.010], 5, 5) == []  # 2 of 4
    d = _feed(p, "hierarchical", [0.030, 0.030, 0.030, 0.010], 5, 10)
    assert len(d) == 1 and d[0].topology == "ring" and "3 of 4 ranks" in d[0].reason
    # the reference starts again on the new topology; the next change tries another one
    assert _feed(p, "ring", [0.030] * 4, 5, 15) == []
    d = _feed(p, "ring", [0.100] * 4, 5, 20)
    assert d[0].topology == "tree"


def test_a_single_rank_job_or_a_resize_in_flight_is_left_alone():
    p = TopologyAuto(window=1)
    assert p.after_step(_snap(world_size=1, nodes=1, waits=[0.1])) is None
    assert p.after_step(MetricsSnapshot(step=1, epoch=0, world_size=4, batch_size=32, lr=0.1,
                                        momentum=0.9, base_lr=0.1, base_batch_size=32,
                                        resizing=True, wait_time=(0.1,) * 4)) is None


def test_decisions_and_plans_refuse_an_unknown_topology():
    with pytest.raises(ConfigurationError, match="unknown allreduce topology 'star'"):
        Decision(reason="x", topology="star").validate()
    with pytest.raises(ConfigurationError, match="choose one of flat, hierarchical, ring"):
        Plan.from_json(Plan(version=0, step=0, topology="star").to_json())


def test_state_round_trips():
    p = TopologyAuto(window=2)
    p.before_train(_snap())
    _feed(p, "hierarchical", [0.01] * 4, 2)
    q = TopologyAuto(window=2)
    q.load_state_dict(p.state_dict())
    assert q.reference == p.reference and q.tried == p.tried
