"""decay-growth from the entry point (a cosine's decay becomes batch growth, the rate rule
keeps the rate), and one replica adapting on the noise scale from inside its steps (the
runs that used to end in an OverflowError)."""

import json
import math

import pytest

from conftest import run_mpi
from hpcadapt.builtin_training import schedule_factor

TRAIN = ["-m", "hpcadapt.train", "--threads", "1", "--no-progress"]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_falls_of_a_cosine_become_growth_at_the_same_rate(tmp_path):
    """MNIST-1D on 2 ranks, SGD, cosine with a 5% warm-up over 4 epochs of 4,000 samples,
    from batch 16, the default steps of sqrt(2): each growth is the next step of the grid (16
    x sqrt(2)^k: 23, 32, 45 ...), the first one only after the cosine has fallen by
    1/sqrt(2) (never before 40% of the budget), the linear rule's ramp brings the applied rate
    back to batch/16 x the cosine's (the decay it replaced, within 1%), and the run trains to
    the end with its samples all seen."""
    metrics = tmp_path / "m.jsonl"
    samples, epochs, base = 4000, 4, 0.05
    run_mpi(2, TRAIN + ["--dataset", "mnist1d", "--model", "cnn", "--samples", str(samples),
                        "--epochs", str(epochs), "--batch-size", "16", "--lr", str(base),
                        "--lr-schedule", "cosine", "--warmup-fraction", "0.05",
                        "--policy", "decay-growth", "--decay-growth-margin", "4",
                        "--lr-rule", "linear", "--metrics-file", str(metrics)], timeout=600)
    rows = _rows(metrics)
    steps = [r for r in rows if r["event"] == "step"]
    decisions = [r for r in rows if r["event"] == "decision" and r["policy"] == "decay-growth"]
    assert decisions, "the schedule's decay never became growth"
    train = int(samples * 0.8)                  # mnist1d: --samples is train + test
    total = epochs * train
    g = math.sqrt(2.0)
    seen, first_growth, grown, checked = 0, None, 0, 0
    prev_batch = 16
    for r in steps:
        if r["batch_size"] != prev_batch:
            grown += 1
            assert r["batch_size"] == round(16 * 1.4142 ** grown), (r, grown)
            first_growth = seen if first_growth is None else first_growth
            ramp_end = r["step"] + 8
        elif grown and r["step"] == ramp_end + 1:
            floor = 1.0 / (0.05 * total / 16)
            c = schedule_factor(seen / total, "cosine", warmup=0.05, warmup_floor=floor)
            assert r["lr"] == pytest.approx(base * c * r["batch_size"] / 16, rel=0.01), (r, c)
            checked += 1
        prev_batch = r["batch_size"]
        # an epoch's last step takes what is left of it (the batch need not divide it)
        seen += min(r["batch_size"], (r["epoch"] + 1) * train - seen)
    where = 0.05 + 0.95 * math.acos(2 / g - 1) / math.pi      # where c = 1/sqrt(2): 40%
    assert first_growth >= where * total
    assert grown >= 2 and checked == grown == len(decisions)
    assert all("of its peak becomes batch" in d["reason"] for d in decisions)
    assert seen == total


@pytest.mark.parametrize("flags", [
    ["--batch-size", "16", "--policy", "gns-batch", "--lr-rule", "sqrt"],
    ["--batch-size", "32", "--monitor", "gns"],
], ids=["gns-batch", "monitor"])
def test_one_replica_adapts_on_the_noise_scale_to_the_end(tmp_path, flags):
    """The commands that ended in `OverflowError: math range error` on one rank at step 23 and
    44 (the consecutive-steps estimator read 11,468 there): they train to the end, every
    logged noise scale finite and below 1,000, its band ordered."""
    metrics = tmp_path / "m.jsonl"
    proc = run_mpi(1, TRAIN + ["--dataset", "shakespeare", "--model", "charlm", "--optimizer",
                               "adamw", "--lr", "0.012", "--samples", "3200", "--epochs", "1",
                               "--metrics-file", str(metrics)] + flags, timeout=600)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["stopped"] is None and summary["epochs"] == 1
    monitored = [r["monitors"] for r in _rows(metrics)
                 if r["event"] == "step" and "noise_scale" in r["monitors"]]
    assert len(monitored) > 50
    for m in monitored[20:]:
        assert 0 < m["noise_scale"] < 1000 and math.isfinite(m["noise_scale"])
        assert m["noise_scale_lo"] <= m["noise_scale"] <= m["noise_scale_hi"]
