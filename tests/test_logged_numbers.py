"""The numbers logged are the optimizer's own: the rate each update used (a user's LambdaLR
moving it), per param group when the groups differ, and AdamW's betas instead of a
momentum it does not have."""

import json
import sys

import pytest

from conftest import ROOT, run_mpi

pytestmark = pytest.mark.slow


def test_each_step_logs_the_rates_and_betas_the_optimizer_used(tmp_path):
    out, metrics = tmp_path / "used.json", tmp_path / "m.jsonl"
    run_mpi(2, [str(ROOT / "tests" / "scripts" / "adamw_lambda.py"), "--out", str(out),
                "--metrics-file", str(metrics)])
    used = json.loads(out.read_text())
    steps = [json.loads(line) for line in metrics.read_text().splitlines()
             if json.loads(line)["event"] == "step"]
    assert len(steps) == len(used) > 10
    for row, rates in zip(steps, used):
        assert row["lr"] == rates[0] and row["lr_groups"] == rates
        assert row["momentum"] is None and row["betas"] == [0.8, 0.99]
    assert steps[0]["lr"] == pytest.approx(0.003 / 50)  # the warm-up's, not --lr's
