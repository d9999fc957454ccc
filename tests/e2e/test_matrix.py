"""Every flag combination a user would try works (or is refused at start with one line):
each policy under each launch mode (a plain launch, --initial-workers joining before the
first step, --warm-spares started beside the job), through the entry point and through a
user's own script. Each cell trains a few steps on real MPI ranks; a hang fails the cell
at its deadline (the run is waited for, never slept on)."""

import json
import subprocess
import sys

import pytest

from conftest import FULL, ROOT, mpiexec, reap_on_teardown

pytestmark = pytest.mark.slow

STEPS = 4

# Flags that make each policy decide within the few steps a cell trains.
POLICIES = {
    "autoscale": ["--autoscale-interval", "1", "--autoscale-settle", "1"],
    "gns-batch": ["--gns-batch-warmup", "1", "--gns-batch-interval", "1",
                  "--gns-batch-cooldown", "1", "--gns-batch-max", "128"],
    "goodput": ["--goodput-interval", "1", "--goodput-warmup", "1", "--goodput-cooldown", "1"],
    "resize-schedule": ["--resize-schedule-steps", "1:3,2:2", "--resize-schedule-hold", "1"],
    "schedule": ["--schedule-batch", "0:32,2:64", "--schedule-lr", "0:0.05,3:0.02"],
    "straggler": ["--straggler-patience", "1"],
    "straggler-async": ["--straggler-async-patience", "1"],
    "sync-switch": ["--sync-switch-steps", "1:sma,3:ssgd"],
    "topology-auto": ["--topology-auto-window", "1"],
}

# (ranks mpiexec starts, flags): every mode has room for 3 workers.
LAUNCHES = {
    "plain": (2, ["--max-workers", "3"]),
    "initial-workers": (1, ["--max-workers", "3", "--initial-workers", "2"]),
    "warm-spares": (2, ["--max-workers", "3", "--warm-spares", "1"]),
}

PROGRAMS = {
    "entry-point": ["-m", "hpcadapt.train"],
    "user-script": [str(ROOT / "tests" / "scripts" / "matrix_user.py")],
}


def _cells():
    """Every policy under every launch mode. Under make test each (policy, launch) cell runs
    once, through the entry point or a user's script in turn (each policy and each launch
    mode meets both programs); make test-long runs all three dimensions in full."""
    cells = []
    for i, policy in enumerate(sorted(POLICIES)):
        for j, launch in enumerate(sorted(LAUNCHES)):
            programs = sorted(PROGRAMS) if FULL else [sorted(PROGRAMS)[(i + j) % 2]]
            cells += [(policy, launch, program) for program in programs]
    return cells


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy,launch,program", _cells())
def test_every_policy_under_every_launch_trains(tmp_path, policy, launch, program):
    ranks, launch_flags = LAUNCHES[launch]
    metrics = tmp_path / "m.jsonl"
    cmd = ([mpiexec(), "-n", str(ranks), sys.executable] + PROGRAMS[program] +
           ["--epochs", "1", "--max-steps", str(STEPS), "--allocator", "local",
            "--launcher", "process", "--metrics-file", str(metrics), "--policy", policy] +
           POLICIES[policy] + launch_flags)
    if program == "entry-point":
        cmd += ["--no-progress", "--batch-size", "32"]
    proc = reap_on_teardown(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True,
                                             start_new_session=True), str(metrics))
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"{policy} under {launch} ({program}) hung:\n{err[-3000:]}")
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{err[-3000:]}"
    summary = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert summary["steps"] == STEPS, summary
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    # one line a step (a bounded-delay round, which straggler-async and sync-switch may
    # switch to, writes one line for its steps)
    steps = [r["step"] for r in rows if r["event"] == "step"]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS, steps
    if launch == "initial-workers":
        assert any(r["event"] == "resize" and r["reason"] == "initial workers" and r["ok"]
                   for r in rows), rows
