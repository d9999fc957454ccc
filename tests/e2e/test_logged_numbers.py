"""The numbers logged are the optimizer's own: the rate each update used (a user's LambdaLR
moving it), per param group when the groups differ, and AdamW's betas instead of a
momentum it does not have. The job's progress values (global and local batch, accumulation
steps, samples seen, epochs as a float, scale-invariant steps) say where training stands."""

import json

import pytest

from conftest import ROOT, run_mpi

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("cap", [None, 16])
def test_each_step_logs_the_optimizers_numbers_and_the_progress_is_right(tmp_path, cap):
    out, metrics = tmp_path / "used.json", tmp_path / "m.jsonl"
    run_mpi(2, [str(ROOT / "tests" / "scripts" / "adamw_lambda.py"), "--out", str(out),
                "--metrics-file", str(metrics)] +
            (["--max-local-batch", str(cap)] if cap else []))
    batches = json.loads(out.read_text())
    per_step = 1 if cap is None else 2  # rank 0's share of 64 is 32: two micro-batches of 16
    used = batches[::per_step]
    steps = [json.loads(line) for line in metrics.read_text().splitlines()
             if json.loads(line)["event"] == "step"]
    assert len(steps) == len(used) > 10
    for row, b in zip(steps, used):
        assert row["lr"] == b["lrs"][0] and row["lr_groups"] == b["lrs"]
        assert row["momentum"] is None and row["betas"] == [0.8, 0.99]
    assert steps[0]["lr"] == pytest.approx(0.003 / 50)  # the warm-up's, not --lr's
    size = batches[0]["size"]
    for i, b in enumerate(used[:-1]):  # the last step of the epoch may be short
        assert b["global"] == 64 and b["local"] == 32 and b["accumulation"] == per_step
        assert b["loader_batch"] == b["global"]
        assert b["seen"] == 64 * i
        assert b["epochs"] == pytest.approx(64 * i / size)
        assert b["steps"] == pytest.approx(i)  # the batch never changed: steps are steps


def test_decisions_and_resizes_log_the_rate_the_updates_use(tmp_path):
    """Issue 43: a decision line said the rule's reference rate (`{'lr': 0.00742}` while the
    updates used 9.86e-07). Now a rate decision's "lr" is the rate the updates use once its
    ramp is done (the user's rate times the policies' factor, "lr_factor"), equal to the step
    lines' rate there; the log line says the factor, named as one."""
    metrics = tmp_path / "m.jsonl"
    proc = run_mpi(2, [str(ROOT / "examples" / "mnist1d_adamw.py"), "--epochs", "2",
                       "--policy", "gns-batch", "--gns-batch-max", "256", "--lr-rule", "sqrt",
                       "--workers", "0", "--no-progress", "--metrics-file", str(metrics)])
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rate_at = {r["step"]: r["lr"] for r in rows if r["event"] == "step"}
    rated = [r for r in rows if r["event"] == "decision" and "lr" in r["changes"]]
    assert rated, "no rate decision to check"
    checked = 0
    for r in rated:
        assert r["lr"] == r["changes"]["lr"] == pytest.approx(0.003 * r["lr_factor"])
        after_ramp = rate_at.get(r["step"] + 9)  # the sqrt rule ramps over 8 steps
        if after_ramp is not None:
            assert after_ramp == pytest.approx(r["lr"], rel=1e-9)
            checked += 1
    assert checked
    assert f"(factor x{rated[0]['lr_factor']:.3g} on your rate)" in proc.stderr
