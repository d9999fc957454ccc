"""A user's scheduler composes with ``--lr-rule`` (AdaptDL's convention): the rule's factor
multiplies whatever rate the scheduler set, during the update only, so the scheduler's own
arithmetic (LambdaLR, OneCycleLR, the chained CosineAnnealingLR, ProgressLR) is untouched and
the update uses scheduler rate x rule factor. Before, a LambdaLR stepped after each step wrote
its own rate over the rule's (the factor was lost on the next step)."""

import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import FULL, ROOT

SCRIPT = str(ROOT / "tests" / "scripts" / "lr_compose.py")
STEPS, GROW_AT, SCALE = 40, 12, 4   # the batch goes 16 -> 64 at step 12
RULE_FACTOR = {"none": 1.0, "linear": 4.0, "sqrt": 2.0}


def _reference(scheduler: str, lambdas_at):
    """The rates the same scheduler gives on a plain optimizer, by the count of its steps."""
    p1, p2 = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p1]}, {"params": [p2], "lr": 0.005}], lr=0.01)
    if scheduler == "lambda":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    elif scheduler == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.01],
                                                    total_steps=STEPS + 5, cycle_momentum=False)
    elif scheduler == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=0.001)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    rates = []
    for k in range(lambdas_at):
        rates.append([g["lr"] for g in opt.param_groups])
        opt.step()   # no gradients: changes nothing, keeps torch's order check quiet
        sched.step()
    return rates


def _run(tmp_path, scheduler, rule):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--scheduler", scheduler, "--max-steps", str(STEPS),
         "--policy", "schedule", "--schedule-batch", f"{GROW_AT}:{16 * SCALE}",
         "--lr-rule", rule, "--lr-ramp-steps", "0", "--monitor-interval", "1",
         "--no-progress", "--metrics-file", str(metrics)],
        capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    mine = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith('{"step"')]
    used = {r["step"] - 1: r for r in map(json.loads, metrics.read_text().splitlines())
            if r["event"] == "step"}
    return mine, used


RULES = ["none", "linear", "sqrt", "adascale"]
SCHEDULERS = ["lambda", "onecycle", "cosine", "progress"]
# make test: each scheduler under two rules and each rule under two schedulers (two diagonals
# of the 4 x 4 square); make test-long: all 16.
PAIRS = [(sch, rule) for i, sch in enumerate(SCHEDULERS) for j, rule in enumerate(RULES)
         if FULL or (j - i) % 4 in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("scheduler,rule", PAIRS)
def test_the_rule_multiplies_what_the_users_scheduler_set(tmp_path, scheduler, rule):
    _check(tmp_path, scheduler, rule)


@pytest.mark.slow
def test_a_schedule_keyed_on_adascales_gain(tmp_path):
    """ProgressLR(key="gain") steps the schedule by AdaScale's accumulated gain."""
    _check(tmp_path, "progress-gain", "adascale")


def _check(tmp_path, scheduler, rule):
    mine, used = _run(tmp_path, scheduler, rule)
    assert [r["step"] for r in mine] == list(range(STEPS))
    # The scheduler's own rates are what it gives on a plain optimizer: the rule never leaks
    # into them (a chained CosineAnnealingLR would compound it).
    if scheduler.startswith("progress"):
        key = "gain_steps" if scheduler == "progress-gain" else "si_steps"
        counts = [0] + [math.floor(r[key] + 1e-9) for r in mine[:-1]]
        ref = _reference(scheduler, max(counts) + 1)
        want = [ref[c] for c in counts]
    else:
        want = _reference(scheduler, STEPS)
    for r, w in zip(mine, want):
        assert r["scheduler_lr"] == pytest.approx(w, rel=1e-9), (r, w)
    factors = []
    for r in mine:
        line = used[r["step"]]
        groups = line["lr_groups"] or [line["lr"]] * 2
        f = [u / s for u, s in zip(groups, r["scheduler_lr"])]
        assert f[0] == pytest.approx(f[1], rel=1e-9)   # the groups keep their ratio
        factors.append(f[0])
    before, after = factors[:GROW_AT], factors[GROW_AT + 1:]
    assert before == pytest.approx([1.0] * len(before), rel=1e-9)
    if rule in RULE_FACTOR:
        assert after == pytest.approx([RULE_FACTOR[rule]] * len(after), rel=1e-9)
    else:
        # AdaScale's gain at a batch 4x the base lies in [1, 4] and moves with the estimates.
        assert all(1.0 <= f <= SCALE + 1e-9 for f in after)
        assert max(after) > 1.05
    # Each step's progress in gain_steps: AdaScale's gain (the factor the update used) under
    # the adascale rule, else the step's batch over the starting one (scale-invariant steps).
    gains = [b["gain_steps"] - a["gain_steps"] for a, b in zip([{"gain_steps": 0.0}] + mine, mine)]
    for r, gain, f in zip(mine, gains, factors):
        want = f if rule == "adascale" else used[r["step"]]["batch_size"] / 16
        assert gain == pytest.approx(want, rel=1e-9), (r["step"], gain, want)
