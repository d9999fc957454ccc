"""The step runner (hpcadapt/loop/steps.py) on real MPI ranks, read through its own state:
what a step leaves for the boundary, a non-finite step, the once-per-batch contract."""

import math

import pytest
import torch
from torch.utils.data import TensorDataset

import hpcadapt
from hpcadapt.base.errors import ConfigurationError

pytestmark = pytest.mark.mpi(min_size=2)


def _job(batch=16, **options):
    torch.manual_seed(0)
    x = torch.randn(256, 4)
    y = (x.sum(1) > 0).long()
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = hpcadapt.ElasticDataLoader(TensorDataset(x, y), batch_size=batch)
    job = hpcadapt.Job(monitor_interval=1, **options).setup(model, opt, loader)
    return job, model, loader


def test_a_step_leaves_its_commit_and_control_values_for_the_boundary():
    job, model, loader = _job()
    runner = job.steps
    with pytest.raises(ConfigurationError, match="once per batch"):
        job.step(torch.zeros((), requires_grad=True))  # outside the loop: no step open
    losses = []
    for _ in job.epochs(1):
        for x, y in loader:
            assert runner.open and runner.micro_left == 1
            loss = torch.nn.functional.cross_entropy(model(x), y)
            losses.append(float(loss))
            assert job.step(loss) is True
            # committed: nothing in flight, the share counted, the loss agreed by all
            assert not runner.open and runner.in_flight is None
            assert runner.last_count == 16 and len(runner.part.indices) == 16 // job.size
            assert math.isfinite(runner.last_loss) and runner.nonfinite_run == 0
            assert runner.last_times is not None and len(runner.last_times.samples) >= job.size
            assert runner.used_settings["lr"] == pytest.approx(0.05)
            mine = hpcadapt.allgather(torch.tensor([runner.last_loss]).numpy()).reshape(-1)
            assert len(set(mine.tolist())) == 1  # the global loss, the same on every rank
            break
        break
    job.optimizer.remove_hooks()


def test_a_non_finite_loss_commits_a_skipped_update_on_every_rank():
    job, model, loader = _job()
    runner = job.steps
    before = [p.detach().clone() for p in model.parameters()]
    for _ in job.epochs(1):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y) * float("nan")
            assert job.step(loss) is True  # the step commits (the cursor moves) ...
            assert runner.nonfinite_run == 1 and math.isnan(runner.last_loss)
            break
        break
    # ... but its update is skipped everywhere
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert job.step_count == 1
    job.optimizer.remove_hooks()
