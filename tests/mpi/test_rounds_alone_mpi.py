"""Issue 45: the bounded-delay rounds (``loop/rounds.py``) alone on real ranks: the Job's parts
as a plain object (``tests/collaborator_parts.py``: a world of the launch, a real optimizer,
loader, training state and recorder), the rounds driven through the step runner they are
handed, with no Job. A round covers its samples once, commits as its steps on every rank,
ends with rank 0's model everywhere, and rank 0 records it."""

import json

import numpy as np
import pytest
import torch
from mpi4py import MPI

from collaborator_parts import BATCH, Assembly, loss_of

pytestmark = pytest.mark.mpi(min_size=2)

ROUND_STEPS = 3


def _round(job, runner):
    """One round as the loop drives it: the batches the rounds yield (a worker's), ``step``
    after each. Returns (the round's samples, this rank's updates sent, samples trained)."""
    walk, sent, trained = runner.rounds.round(), 0, 0
    try:
        batch = next(walk)
        while True:
            trained += len(batch[0])
            sent += runner.step(loss_of(job.model, batch)).committed
            batch = walk.send(None)
    except StopIteration as end:
        return end.value, sent, trained


def _flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()


def test_a_round_commits_its_steps_everywhere_and_ends_with_rank_0s_model(tmp_path):
    job = Assembly(tmp_path, strategy="bounded-delay", comm=MPI.COMM_WORLD, samples=256,
                   async_round_steps=ROUND_STEPS, max_delay=4)
    world, st = job.parts.world, job.parts.state
    runner = job.runner()
    count, sent, trained = _round(job, runner)
    flats = world.comm.allgather(_flat(job.model))
    losses = world.comm.allgather(runner.report().loss)
    trained_by = world.comm.allgather(trained)
    line = None   # rank 0's record, told to every rank: each asserts the same, none waits
    if world.rank == 0:
        line = [r for r in map(json.loads, job.metrics.read_text().splitlines())
                if r.get("event") == "bounded-delay"]
    lines = world.comm.bcast(line, root=0)
    assert count == ROUND_STEPS * BATCH
    assert (st.step, st.sampler.cursor) == (ROUND_STEPS, count)   # on every rank
    assert runner.report().count == count and np.isfinite(runner.report().loss)
    if world.rank == 0:
        assert sent == 0                          # the aggregator trains nothing itself
    assert all(np.array_equal(f, flats[0]) for f in flats)          # rank 0's model
    assert not np.array_equal(flats[0], _flat(job.start))           # which trained
    assert len(set(losses)) == 1                                    # the round's, agreed
    # every sample of the round was trained (a dropped update's samples again), and rank
    # 0's line says the round covered them, each applied once
    assert trained_by[0] == 0 and sum(trained_by) >= count
    (line,) = lines
    assert (line["samples"], line["steps"], line["first_step"]) == (count, ROUND_STEPS, 0)
    assert line["applied_updates"] >= 1 and line["world_size"] == world.size
