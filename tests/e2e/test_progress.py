"""Progress for schedulers under an adaptive batch: the example's cosine schedule, wrapped in
hpcadapt.ProgressLR, follows the samples seen, so it ends at the end of the run even though
gns-batch grew the batch and the run took far fewer steps than the schedule's length."""

import json
import math

import pytest

from conftest import ROOT, run_mpi

pytestmark = pytest.mark.slow


def test_a_cosine_keyed_on_progress_ends_with_the_run_under_gns_batch(tmp_path):
    metrics = tmp_path / "m.jsonl"
    epochs, samples, batch = 3, 2000, 16
    run_mpi(2, [str(ROOT / "examples" / "mnist1d_adamw.py"), "--epochs", str(epochs),
                "--samples", str(samples), "--workers", "0", "--batch-size", str(batch),
                "--cosine", "--policy", "gns-batch", "--gns-batch-max", "256",
                "--gns-batch-warmup", "10", "--gns-batch-interval", "5",
                "--gns-batch-cooldown", "10", "--metrics-file", str(metrics)])
    steps = [r for r in map(json.loads, metrics.read_text().splitlines())
             if r["event"] == "step"]
    length = epochs * math.ceil(samples * 0.8 / batch)  # the schedule, in steps at batch 16
    assert max(r["batch_size"] for r in steps) > batch  # gns-batch grew it
    assert len(steps) < length / 2
    rates = [r["lr"] for r in steps]
    assert all(b <= a for a, b in zip(rates, rates[1:]))  # a cosine only falls
    assert rates[-1] < 0.02 * rates[0]  # and it reached its end with the run
