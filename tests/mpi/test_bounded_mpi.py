"""Bounded-delay aggregation on real MPI ranks (any size >= 2; the drop test needs 3): every
sample of a round is applied exactly once and the aggregated update is exactly the
samples-weighted sum; a worker held back until the model has moved past the bound has its
update dropped, its samples handed out again, and nothing older than the bound is applied
(delays count global batches applied, not applications)."""

import os
import tempfile
import time

import numpy as np
import pytest
import torch

import hpcadapt
from hpcadapt.parallel.bounded import Aggregator, AsyncWorker, FlatModel

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def w():
    return hpcadapt.init()


def _model():
    model = torch.nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        model.weight.zero_()
    return model


def _round(w, samples, batch, max_delay, lr, before_send=None, on_apply=None):
    """One round: rank 0 aggregates with plain SGD at lr * n / batch; worker r's gradient
    is r for every sample. Returns rank 0's report and model (None elsewhere)."""
    model = _model()
    flat = FlatModel(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if w.rank == 0:
        def apply(n, slot):
            for g in opt.param_groups:
                g["lr"] = lr * n / batch
            opt.step()
            if on_apply is not None:
                on_apply(n)
        report = Aggregator(w, flat, np.arange(samples), global_batch=batch,
                            max_delay=max_delay, apply=apply).run()
        return report, model
    worker = AsyncWorker(w, flat)
    first = True
    while True:
        work = worker.next_batch()
        if work is None:
            return None, model
        model.weight.grad = torch.full_like(model.weight, float(w.rank))
        if before_send is not None and first:
            before_send()
        first = False
        worker.send_update(work.batch_id, len(work.indices), float(len(work.indices)), 0.0)


def test_every_sample_is_applied_once_and_the_sum_is_exact(w):
    samples, batch, lr = 203, 12, 0.5
    report, model = _round(w, samples, batch, max_delay=2, lr=lr)
    if w.rank != 0:
        return
    applied = np.sort(np.concatenate([idx for _, _, idx in report.applied]))
    assert applied.tolist() == list(range(samples))
    assert sum(report.trained.values()) == samples
    # plain SGD is linear: whatever the aggregation and order, the weight is
    # -lr / batch x (sum over samples of their worker's gradient)
    expected = -lr / batch * sum(rank * n for rank, n in report.trained.items())
    assert float(model.weight) == pytest.approx(expected, rel=1e-12)
    assert max(report.delays_applied) <= 2
    assert all(d > 2 for d in report.delays_dropped)
    assert report.loss_sum == pytest.approx(samples)


def test_a_held_back_worker_is_dropped_and_its_samples_handed_out_again(w):
    if w.size < 3:
        pytest.skip("needs a second worker to move the model on")
    folder = w.comm.bcast(tempfile.mkdtemp(prefix="hpcadapt-bd-") if w.rank == 0 else None)
    moved = os.path.join(folder, "moved")
    applied = [0]
    batch = 6

    def on_apply(n):
        applied[0] += n
        if applied[0] >= 3 * batch and not os.path.exists(moved):
            # 3 global batches applied: the model is 3 versions past the held-back update's
            with open(moved, "w") as f:
                f.write("3")

    def hold_back():
        if w.rank != 1:
            return
        deadline = time.monotonic() + 120
        while not os.path.exists(moved):  # no MPI call while held back
            assert time.monotonic() < deadline, "the others never moved the model on"
            time.sleep(0.01)

    report, _ = _round(w, 600, batch, max_delay=1, lr=0.1, before_send=hold_back,
                       on_apply=on_apply)
    w.comm.Barrier()
    if w.rank != 0:
        return
    os.remove(moved)
    os.rmdir(folder)
    assert report.dropped_updates >= 1
    assert sum(report.delays_dropped.values()) == report.dropped_updates
    assert max(report.delays_dropped) >= 3  # the held-back update
    assert min(report.delays_dropped) > 1 and max(report.delays_applied) <= 1
    applied = np.sort(np.concatenate([idx for _, _, idx in report.applied]))
    assert applied.tolist() == list(range(600))  # the dropped samples came back
    assert report.pulls >= 1

