"""adaptive: do adaptive batch policies beat baselines tuned as a careful user would?

Two tasks, 2 MPI ranks per run, a fixed budget in samples (one epoch of a fixed --samples):

* ``mnist1d``: MNIST-1D (30,000 samples, 24,000 to train), the built-in 1-D CNN, SGD with
  momentum 0.9: a budget over which the measured noise scale keeps growing at a steady rate;
* ``lm``: a character-level transformer LM on Shakespeare (context 64), AdamW, 64,000
  windows: one pass, each window seen once.

Every run uses the same learning-rate schedule, cosine over the budget's samples with a
5% warm-up, measures the gradient noise scale inside its steps (``MONITOR_FLAGS``: the same
small cost for every method; the noise scale at each evaluation is part of each run's
record), and is evaluated on the validation set every ~1.6% of the budget (and at the end).

Families (the grids are ``TASKS``; a configuration's flags are ``method_flags``):

* ``fixed``: one batch size for the whole run (mnist1d 16 to 512, lm 16 to 96), each with 3
  rates: the task's ``base_lrs`` at batch 16 times sqrt(batch / 16). A careful user moves
  the rate with the batch, and the square root is what the earlier sweeps support on both
  tasks: mnist1d's best SGD rate rose linearly only to batch 64 and stayed at 0.2-0.4 from
  128 to 512, the LM's best AdamW rate rose more slowly than the batch; a x2-spaced grid of
  3 around the square-root rate held every earlier optimum;
* ``doubling``: a Merrill-style batch ramp: the batch doubles when 1/8, 1/4 and 1/2 of the
  budget's samples are seen (``--policy schedule --schedule-batch`` at the steps those
  fractions fall on), the rate following the cosine unchanged;
* ``seesaw``: Seesaw (Meterez et al. 2025): where the cosine rate would halve, the rate is
  multiplied by 1/sqrt(2) and the batch doubled instead (a constant base rate after the same
  warm-up, ``--schedule-batch`` at that step and ``--schedule-lr-scale`` one step later, as
  the schedule policy wants); past the largest batch the rate halves there. Both ramps start
  from the fixed family's best batch (by final loss on the tuning seeds) with that batch's 3
  rates, so the sweep has two stages: the fixed family (and growth) first, then the ramps;
* ``growth`` (the headline): ``--policy decay-growth``, the schedule's decay turned into
  batch growth while the measured critical batch allows, from batch 16 up to the grid's
  largest, with the rate rule of its optimizer (``RULES``) and ``GROWTH_FLAGS``; 3 rate
  trials (batch 16's rates) on the tuning seeds, counted as tuning. Left out, with a line
  saying why, while hpcadapt.train lacks ``FAMILY_NEEDS["growth"]``;
* ``adaptive``: the comparison method of earlier rounds, ``ADAPTIVE_FLAGS`` (gns-batch) from
  batch 16 to the largest, with the fixed family's best rate at 16; no tuning of its own.

Targets: three validation losses per task in the tuning record
(``benchmarks/adaptive_tuning.json``), never derived from the runs being judged: set by
``--retune`` from the sweep's runs on the first tuning seed when the record has none for the
budget (the fixed configuration with the lowest final loss: its loss at 40% and 70% of the
budget and its final loss x 1.02), kept otherwise.

Tuning (``--retune``): every configuration on the tuning seeds (1000, 1001); a
configuration's scores are geometric means over those seeds (steps, samples, modelled and
wall time to the middle target; a seed that never reaches it: infinite) and its mean final
loss. Per family the winner is the configuration with the lowest final loss (what a user
would keep); for ``fixed`` also the winners by steps, samples and modelled time (ties within
0.5% go to the lower final loss), for the adaptive_* comparisons at each metric. The record
keeps the grid, every configuration's scores, the seeds and each family's tuning compute.

Comparison (``--seeds N``, default 10; fewer than 2 refused): fresh seeds 0..N-1; for each
seed every method once, the order rotated seed by seed (round-robin, so that the machine's
drift hits all alike). The headline, per task, growth against the fixed configuration with
the lowest final loss: its steps over the whole budget (both train the same samples: "the
same data in fewer steps"; per-seed ratios, their geometric mean with a 95% t-interval) beside
the final validation loss at equal samples (growth minus best fixed, mean and 95% interval:
"the same loss"), and growth minus Seesaw; also the steps to the middle target
(``growth_steps_to_middle_target_*``; see ``adaptive_stats.paired_ratio`` for censored seeds),
less favourable to growth, which grows the batch in the budget's second half. The adaptive_* keys compare gns-batch with the fixed winner by final loss, at
every metric. Modelled time: a per-step cost c0 + c1 * batch fitted by least squares to the median
step time at each batch size over all the task's runs of the comparison, summed over each
run's steps. Wall time is reported with the load average beside it.

Results (``--results DIR``): each run, once it has trained its whole budget, leaves a small
record (``DIR/TASK/METHOD-sSEED-nSAMPLES.json``, written atomically); a later invocation
reuses every record and trains only the missing runs, so a killed sweep resumes. A run that
ends early is not saved and stops the benchmark. ``DIR/meta.json`` names the format version,
the budgets and the quick mode: a folder from another setting is refused. Each record names
the commit and a digest of the library's sources; a task whose records come from several
versions of the code is reported with a warning."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

import adaptive_stats as st
from common import read_jsonl
from launch import ROOT, env, run_mpi

HERE = Path(__file__).resolve().parent
TUNING_FILE = HERE / "adaptive_tuning.json"
RESULTS_DIR = HERE / "results" / "adaptive"
RESULTS_VERSION = 2     # the records' format: a results folder of another version is refused

# The adaptive (gns-batch) method's flags, the same on every task: gns-batch at its defaults
# (a one-sided 80% lower bound of the noise scale, jumps of at most x4, cooldown 2,048
# samples) with a monitor memory of 4,096 samples. The task adds --batch-size/--lr (its
# smallest batch and the fixed family's best rate there), the batch range and the rate rule
# its optimizer calls for (RULES: linear for SGD, the square-root rule for Adam). The SGD
# rule was chosen in 4 trials on mnist1d's tuning seed 1000, recorded in adaptive_tuning.json.
ADAPTIVE_FLAGS = ["--policy", "gns-batch", "--monitor-window", "4096"]
# The growth method's flags beyond --batch-size/--lr/--lr-rule/--policy decay-growth and
# --decay-growth-max: none, the policy's defaults, no per-task flags.
GROWTH_FLAGS: List[str] = []
RULES = {"sgd": "linear", "adamw": "sqrt"}
# Every run measures the noise scale (same cost for all methods; it does not change training).
MONITOR_FLAGS = ["--monitor", "gns", "--monitor-window", "4096"]
# Flags hpcadapt.train must offer for a family to run; without them it is left out.
FAMILY_NEEDS = {"growth": ["--decay-growth-max"]}

SCHEDULE = "cosine"
WARMUP_FRACTION = 0.05
EVALS_PER_BUDGET = 64            # an evaluation every 1/64 (~1.6%) of the budget
QUICK_EVALS_PER_BUDGET = 16      # --quick: every 1/16 (an evaluation of the LM costs ~0.5 s)
DOUBLING_FRACTIONS = (0.125, 0.25, 0.5)
SEESAW_MAX_HALVINGS = 6
TUNING_SEEDS = (1000, 1001)
BASE_BATCH = 16                  # base_lrs are the rates at this batch
METRICS = ("steps", "samples", "modelled_s", "wall_s")
FAMILIES = ("fixed", "doubling", "seesaw", "growth", "adaptive")
SIGNIFICANT = 6                  # digits kept of a float in a record (small files)

TASKS: Dict[str, dict] = {
    "mnist1d": {
        "what": "MNIST-1D, built-in 1-D CNN, SGD momentum 0.9",
        "flags": ["--dataset", "mnist1d", "--model", "cnn", "--optimizer", "sgd",
                  "--momentum", "0.9"],
        "needs": ["--optimizer", "--lr-schedule", "--warmup-fraction", "--eval-every-samples"],
        "samples": 30000, "train_fraction": 0.8,     # mnist1d: --samples is train + test
        "batches": [16, 24, 32, 48, 64, 96, 128, 256, 512],
        "base_lrs": [0.025, 0.05, 0.1],              # around the earlier sweep's best at 16
        "quick": {"samples": 4000, "batches": [32, 64], "base_lrs": [0.05]},
    },
    "lm": {
        "what": "character-level transformer LM on Shakespeare (context 64), AdamW",
        "flags": ["--dataset", "shakespeare", "--model", "charlm", "--context", "64",
                  "--optimizer", "adamw"],
        "needs": ["--optimizer", "--lr-schedule", "--warmup-fraction", "--eval-every-samples",
                  "--context", "charlm", "shakespeare"],
        "samples": 64000, "train_fraction": 1.0,     # shakespeare: --samples training windows
        "batches": [16, 24, 32, 48, 64, 96],
        "base_lrs": [5e-3, 1e-2, 2e-2],              # around the earlier sweeps' best, 0.012
        "quick": {"samples": 768, "batches": [32, 64], "base_lrs": [2e-3]},
    },
}


# --------------------------------------------------------------------------- configurations

def budget(task: dict, samples: int) -> int:
    """Training samples in the budget: one epoch of the training split."""
    return int(samples * task["train_fraction"])


def settings(task: dict, quick: bool) -> dict:
    """The task with its quick grid and budget in place under --quick."""
    return dict(task, **task["quick"]) if quick else task


def lr_grid(task: dict, batch: int) -> List[float]:
    """The 3 rates tried at ``batch``: base_lrs x sqrt(batch / 16), to 3 digits."""
    return [float(f"{lr * math.sqrt(batch / BASE_BATCH):.3g}") for lr in task["base_lrs"]]


def steps_at(total: int, start_batch: int, changes: Sequence[Tuple[float, int]]) -> List[int]:
    """The steps at which a run that starts at ``start_batch`` has seen each fraction of
    ``total`` samples, the batch becoming each change's value there: ``changes`` is
    [(fraction, new batch)] in increasing fraction. Strictly increasing, at least 2 apart
    (a Seesaw scale goes one step after its batch change)."""
    out: List[int] = []
    exact, frac, batch = 0.0, 0.0, start_batch
    for f, new in changes:
        exact += (f - frac) * total / batch   # the first step at which that many are seen
        out.append(max(int(math.ceil(exact - 1e-9)), (out[-1] + 2) if out else 1))
        frac, batch = f, new
    return out


def doubling_points(total: int, start: int, max_batch: int) -> List[Tuple[int, int]]:
    """(step, batch) of the doubling ramp: x2 at each of DOUBLING_FRACTIONS, up to max."""
    changes, b = [], start
    for f in DOUBLING_FRACTIONS:
        if b * 2 > max_batch:
            break
        b *= 2
        changes.append((f, b))
    return list(zip(steps_at(total, start, changes), [c[1] for c in changes]))


def cosine_halvings(warmup: float = WARMUP_FRACTION, k_max: int = SEESAW_MAX_HALVINGS
                    ) -> List[float]:
    """Fractions of the budget at which the warm-up + cosine rate falls to 1/2, 1/4, ... of
    its peak: w + (1 - w) * arccos(2^(1-k) - 1) / pi."""
    return [warmup + (1 - warmup) * math.acos(2.0 ** (1 - k) - 1) / math.pi
            for k in range(1, k_max + 1)]


def seesaw_points(total: int, start: int, max_batch: int
                  ) -> Tuple[List[Tuple[int, int]], List[Tuple[int, float]]]:
    """(batch points, lr-scale points) of Seesaw: at each cosine halving, batch x2 and rate
    x 1/sqrt(2) (the scale one step after the batch change); once the batch is at its
    largest, rate x 1/2 at the halving."""
    fracs = cosine_halvings()
    changes, b = [], start
    for f in fracs:
        b2 = b * 2 if b * 2 <= max_batch else b
        changes.append((f, b2))
        b = b2
    steps = steps_at(total, start, changes)
    batch_pts, scale_pts, b = [], [], start
    for s, (_, nb) in zip(steps, changes):
        if nb != b:
            batch_pts.append((s, nb))
            scale_pts.append((s + 1, round(1 / math.sqrt(2), 6)))
        else:
            scale_pts.append((s, 0.5))
        b = nb
    return batch_pts, scale_pts


def _pts(pairs) -> str:
    return ",".join(f"{a}:{v:g}" for a, v in pairs)


def _optimizer(task: dict) -> str:
    return task["flags"][task["flags"].index("--optimizer") + 1]


def method_flags(family: str, config: dict, task: dict, total: int) -> List[str]:
    """The training flags of one configuration of a family (besides the common ones)."""
    lr = f"{config['lr']:g}"
    if family == "fixed":
        return ["--batch-size", str(config["batch"]), "--lr", lr]
    start, top = config.get("start_batch", 0), max(task["batches"])
    if family == "doubling":
        pts = doubling_points(total, start, top)
        return ["--batch-size", str(start), "--lr", lr] + (
            ["--policy", "schedule", "--schedule-batch", _pts(pts)] if pts else [])
    if family == "seesaw":
        bpts, spts = seesaw_points(total, start, top)
        flags = ["--batch-size", str(start), "--lr", lr, "--lr-schedule", "constant",
                 "--policy", "schedule", "--schedule-lr-scale", _pts(spts)]
        return flags + (["--schedule-batch", _pts(bpts)] if bpts else [])
    if family == "growth":
        return (["--batch-size", str(start), "--lr", lr, "--lr-rule", RULES[_optimizer(task)],
                 "--policy", "decay-growth", "--decay-growth-max", str(top)] + GROWTH_FLAGS)
    if family == "adaptive":
        return (["--batch-size", str(start), "--lr", lr] + ADAPTIVE_FLAGS
                + ["--lr-rule", RULES[_optimizer(task)],
                   "--gns-batch-min", str(start), "--gns-batch-max", str(top)])
    raise ValueError(f"unknown family {family!r}")


def label(family: str, config: dict) -> str:
    if family == "fixed":
        return f"fixed b{config['batch']} lr{config['lr']:g}"
    return f"{family} b{config['start_batch']} lr{config['lr']:g}"


def fixed_grid(task: dict) -> List[dict]:
    return [{"batch": b, "lr": lr} for b in task["batches"] for lr in lr_grid(task, b)]


def start_grid(task: dict, start: int) -> List[dict]:
    """The configurations of a family that starts at ``start``: that batch's rates."""
    return [{"start_batch": start, "lr": lr} for lr in lr_grid(task, start)]


# --------------------------------------------------------------------------- results folder

def _json_bytes(obj) -> bytes:
    return (json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)
            + "\n").encode("utf-8")


def write_atomic(path: Path, obj) -> None:
    """``obj`` as JSON at ``path``, whole or not at all: written to NAME.tmp beside it
    (never through a symlink: O_NOFOLLOW), fsynced, then renamed over NAME.json."""
    tmp = path.with_suffix(".tmp")
    data = _json_bytes(obj)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)   # replaces a symlink at NAME.json itself, never its target
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)       # the rename itself survives a crash
    finally:
        os.close(dfd)


def make_folder(path: Path) -> None:
    """Create ``path`` (0o755); refuse a symlink there: records are never written through one."""
    if path.is_symlink():
        raise SystemExit(f"adaptive: {path} is a symlink: records are not written through "
                         f"one; pass another --results")
    path.mkdir(mode=0o755, parents=True, exist_ok=True)


def results_meta(quick: bool) -> dict:
    """What a results folder's records depend on: the format, every task's budget, --quick."""
    return {"version": RESULTS_VERSION, "quick": quick,
            "budgets": {t: settings(task, quick)["samples"] for t, task in TASKS.items()}}


def open_results(folder: Path, quick: bool) -> None:
    """Check (or, on first use, write) ``folder/meta.json``; a foreign folder is refused in
    one line."""
    meta, path = results_meta(quick), folder / "meta.json"
    again = "pass another --results or remove it"
    if not path.exists():
        if folder.is_dir() and any(not p.name.endswith(".tmp") for p in folder.iterdir()):
            raise SystemExit(f"adaptive: results folder {folder} holds files but no "
                             f"meta.json: not this benchmark's; {again}")
        make_folder(folder)
        write_atomic(path, meta)
        return
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SystemExit(f"adaptive: results folder {folder}: unreadable meta.json ({e}); "
                         f"{again}") from None
    diffs = [f"{k} {old.get(k)!r} there, {v!r} here" for k, v in meta.items()
             if old.get(k) != v]
    if diffs:
        raise SystemExit(f"adaptive: results folder {folder} is from another setting ("
                         + "; ".join(diffs) + f"); {again}")


def record_path(folder: Path, name: str, family: str, config: dict, seed: int, samples: int,
                tag: str = "") -> Path:
    """The run's record: deterministic in (task, family, configuration, seed, budget)."""
    stem = f"{label(family, config).replace(' ', '_')}-s{seed}-n{samples}{tag}"
    return folder / name / f"{stem}.json"


def load_record(path: Path, name: str, samples: int, flags: List[str]) -> dict:
    """A completed run's record, checked against what is asked (one line when it differs)."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SystemExit(f"adaptive: unreadable record {path} ({e}); remove it to rerun "
                         f"that run") from None
    if rec.get("task") != name or rec.get("budget_samples") != samples:
        raise SystemExit(f"adaptive: record {path} is of task {rec.get('task')!r} at "
                         f"{rec.get('budget_samples')} samples, not {name!r} at {samples}; "
                         f"pass another --results or remove it")
    if rec.get("flags") != flags:
        raise SystemExit(f"adaptive: record {path} was trained with other flags than asked "
                         f"now; pass another --results or remove it")
    return _restore(rec)


def _compact(x):
    """Floats to SIGNIFICANT digits, NaN and infinities to None: small, strict JSON."""
    if isinstance(x, float):
        return float(f"{x:.{SIGNIFICANT}g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _compact(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_compact(v) for v in x]
    return x


def _restore(rec: dict) -> dict:
    """A record as the analysis wants it: a missing loss or time is NaN again."""
    e = rec["evals"]
    for k in ("val_loss", "wall_s"):
        e[k] = [math.nan if v is None else v for v in e[k]]
    for k in ("final_loss", "train_wall_s"):
        rec[k] = math.nan if rec.get(k) is None else rec[k]
    return rec


# --------------------------------------------------------------------------- running

def trainer_help() -> str:
    proc = subprocess.run([sys.executable, "-m", "hpcadapt.train", "--help"], env=env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc.stdout


def missing_flags(needs: Sequence[str], help_text: str) -> List[str]:
    return [f for f in needs if f not in help_text]


def common_flags(name: str, samples: int, seed: int, total: int,
                 evals: int = EVALS_PER_BUDGET) -> List[str]:
    return TASKS[name]["flags"] + [
        "--samples", str(samples), "--epochs", "1", "--seed", str(seed), "--threads", "1",
        "--no-progress", "--lr-schedule", SCHEDULE, "--warmup-fraction", f"{WARMUP_FRACTION:g}",
        "--eval-every-samples", str(max(1, total // evals))] + MONITOR_FLAGS


def _runlength(values: Sequence[int]) -> List[List[int]]:
    out: List[List[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([int(v), 1])
    return out


def _monitors(row: dict) -> dict:
    """Where a step line keeps its noise scale: its ``monitors`` object (or the line)."""
    m = row.get("monitors") or {}
    return m if "noise_scale" in m else row


def _finite(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def noise_at_evals(steps: List[dict], evals: List[dict]) -> Dict[str, list]:
    """The latest step line's noise scale (and its band, where logged) at or before each
    evaluation's step; None where no step had one yet."""
    keys = ["noise_scale"] + [k for k in ("noise_scale_lo", "noise_scale_hi")
                              if any(k in _monitors(r) for r in steps)]
    out: Dict[str, list] = {k: [] for k in keys}
    i, last = 0, {}
    for e in evals:
        while i < len(steps) and int(steps[i]["step"]) <= int(e["step"]):
            if "noise_scale" in _monitors(steps[i]):
                last = _monitors(steps[i])
            i += 1
        for k in keys:
            out[k].append(_finite(last.get(k)))
    return out


def step_time_summary(steps: List[dict]) -> Dict[str, dict]:
    """Per batch size: how many steps and their median time (what the cost model fits)."""
    times: Dict[int, List[float]] = {}
    for r in steps:
        times.setdefault(int(r["batch_size"]), []).append(float(r["step_time_s"]))
    return {str(b): {"count": len(v), "median_s": float(np.median(v))} for b, v in times.items()}


def diverged_at(rows: List[dict]) -> Optional[dict]:
    """The trainer's stop line for a loss that stayed non-finite (the run diverged), or None."""
    return next((r for r in rows if r.get("event") == "stop"
                 and "non-finite" in str(r.get("reason", ""))), None)


def parse_run(rows: List[dict], diverged: bool = False) -> dict:
    """The facts of one run from its metrics file, small enough to keep: the evaluations
    (with the noise scale at each), the batch of every step (run-length coded), the step
    times per batch (count, median), final loss, steps, samples, wall time. A run that
    diverged ends with an evaluation of no loss at its last step (``diverged``: True)."""
    steps = [r for r in rows if r.get("event") == "step"]
    evals = [r for r in rows if r.get("event") == "eval"]
    if diverged and steps:
        last = steps[-1]
        seen = sum(int(r["batch_size"]) for r in steps)
        evals = evals + [{"step": last["step"], "samples": seen, "val_loss": None,
                          "batch_size": last["batch_size"], "lr": last["lr"],
                          "time_s": last.get("time_s")}]
    if not evals:
        raise SystemExit("a run wrote no eval lines to its metrics file: hpcadapt.train "
                         "needs --eval-every-samples")
    t0 = (steps[0]["time_s"] - steps[0]["step_time_s"]) if steps else evals[0].get("time_s", 0.0)
    return {
        "evals": dict({
            "step": [int(r["step"]) for r in evals],
            "samples": [int(r["samples"]) for r in evals],
            "val_loss": [_finite(r.get("val_loss")) for r in evals],
            "val_accuracy": [r.get("val_accuracy") for r in evals],
            "batch_size": [int(r["batch_size"]) for r in evals],
            "lr": [float(r["lr"]) for r in evals],
            "wall_s": [float(r["time_s"]) - t0 if "time_s" in r else None for r in evals],
        }, **noise_at_evals(steps, evals)),
        "step_batches": _runlength([int(r["batch_size"]) for r in steps]),
        "step_time_summary": step_time_summary(steps),
        "steps": int(steps[-1]["step"]) if steps else int(evals[-1]["step"]),
        "samples": int(evals[-1]["samples"]),
        "final_loss": _finite(evals[-1].get("val_loss")),
        "train_wall_s": (float(steps[-1]["time_s"]) - t0) if steps else None,
        "diverged": diverged,
    }


def git_commit() -> Optional[str]:
    """The checkout's commit (read only), kept in each record."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, timeout=30,
                             capture_output=True, text=True)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def code_digest() -> str:
    """A digest of the library's Python sources (hpcadapt/, policies/), kept in each record:
    the commit alone misses uncommitted edits."""
    h = hashlib.sha256()
    for path in sorted(p for d in ("hpcadapt", "policies") for p in (ROOT / d).rglob("*.py")):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


class Runner:
    """Runs (or reuses) the runs of one invocation: records in ``folder``, metrics files in
    a temporary folder, counts of what was reused and trained."""

    def __init__(self, folder: Path, ranks: int, quick: bool) -> None:
        self.folder, self.ranks = folder, ranks
        self.evals = QUICK_EVALS_PER_BUDGET if quick else EVALS_PER_BUDGET
        self.tmp = tempfile.mkdtemp(prefix="hpcadapt-adaptive-")
        self.reused = self.trained = 0
        self.commit, self.code = git_commit(), code_digest()

    def plan(self, name: str, family: str, config: dict, seed: int, samples: int,
             tag: str = "") -> Tuple[Path, List[str]]:
        task = TASKS[name]
        total = budget(task, samples)
        # a later flag wins in argparse: the method's own --lr-schedule (Seesaw) overrides
        flags = (common_flags(name, samples, seed, total, self.evals)
                 + method_flags(family, config, task, total))
        return record_path(self.folder, name, family, config, seed, samples, tag), flags

    def done(self, name: str, family: str, config: dict, seed: int, samples: int) -> bool:
        return self.plan(name, family, config, seed, samples)[0].exists()

    def run(self, name: str, family: str, config: dict, seed: int, *, samples: int,
            order: int, tag: str = "") -> dict:
        path, flags = self.plan(name, family, config, seed, samples, tag)
        if path.exists():
            rec = load_record(path, name, samples, flags)
            self.reused += 1
        else:
            rec = self.train(path, name, family, config, seed, samples, flags)
            self.trained += 1
        rec.update(order=order, record=str(path.relative_to(self.folder)))
        return rec

    def train(self, path: Path, name: str, family: str, config: dict, seed: int,
              samples: int, flags: List[str]) -> dict:
        what = f"{name} seed {seed} {label(family, config)}"
        metrics = os.path.join(self.tmp, path.stem + ".jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        load0, started = os.getloadavg(), time.perf_counter()
        diverged = False
        try:
            run_mpi(self.ranks, ["-m", "hpcadapt.train"] + flags + ["--metrics-file", metrics])
        except SystemExit as e:
            if not isinstance(e.code, str):
                raise   # SIGTERM and the like: stop as asked
            diverged = os.path.exists(metrics) and diverged_at(read_jsonl(metrics)) is not None
            if not diverged:
                raise SystemExit(f"adaptive: {what}: the trainer {e.code.split(':')[0]}; not "
                                 f"saved, the benchmark stops (run again to resume)") from None
        launch_s, load1 = time.perf_counter() - started, os.getloadavg()
        rows = read_jsonl(metrics)
        # A configuration that diverges is an outcome, not a crash: recorded as never
        # reaching a target, with no final loss (it ranks last), so the sweep goes on.
        rec = parse_run(rows, diverged=diverged)
        total = budget(TASKS[name], samples)
        if rec["samples"] < total and not diverged:
            raise SystemExit(f"adaptive: {what} ended at {rec['samples']} of its {total} "
                             f"samples; not saved, the benchmark stops")
        rec.update({"version": RESULTS_VERSION, "task": name, "family": family,
                    "config": config, "method": label(family, config), "seed": seed,
                    "budget_samples": samples, "flags": flags, "launch_s": launch_s,
                    "loadavg_before": list(load0), "loadavg_after": list(load1),
                    "commit": self.commit, "code": self.code})
        rec = dict(_compact(rec), finished_unix=int(time.time()))
        make_folder(path.parent)
        write_atomic(path, rec)
        os.remove(metrics)   # the record holds what the analysis needs
        print(f"  {what:<40} {rec['steps']:5d} steps, final loss {rec['final_loss']}, "
              f"{launch_s:.1f} s (load {load0[0]:.1f})", flush=True)
        return _restore(rec)

    def round_robin(self, name: str, methods: List[Tuple[str, dict]], seeds: Sequence[int],
                    samples: int) -> List[dict]:
        """Every method on every seed, the order rotated seed by seed."""
        todo = [(f, c, s) for s in seeds for f, c in methods]
        have = sum(1 for f, c, s in todo if self.done(name, f, c, s, samples))
        print(f"adaptive: {name}: {len(methods)} methods x {len(seeds)} seeds, round-robin; "
              f"{have} of {len(todo)} already recorded in {self.folder}", flush=True)
        runs, order = [], 0
        for i, seed in enumerate(seeds):
            k = i % len(methods)
            for family, config in methods[k:] + methods[:k]:
                runs.append(self.run(name, family, config, seed, samples=samples, order=order))
                order += 1
        return runs


# --------------------------------------------------------------------------- analysis

def add_axes(runs: List[dict], model: dict) -> None:
    """Each run's modelled seconds at each evaluation, from the fitted cost model."""
    for r in runs:
        batches = [b for b, n in r["step_batches"] for _ in range(n)]
        cum = st.cumulative_cost(batches, model)
        r["evals"]["modelled_s"] = [float(cum[min(s, len(cum) - 1)]) for s in r["evals"]["step"]]
        r["modelled_s"] = float(cum[-1])


COST_MIN_STEPS = 5   # batch sizes with fewer steps in all (an epoch's last, partial batch)
                     # are left out of the cost model's fit: one noisy step each


def fit_model(runs: List[dict]) -> dict:
    """The task's per-step cost model over the steps of ``runs`` (all methods, all seeds):
    each run's median step time at a batch counts as many times as it has steps there."""
    pooled: Dict[int, List[Tuple[float, int]]] = {}
    for r in runs:
        for batch, s in r["step_time_summary"].items():
            pooled.setdefault(int(batch), []).append((s["median_s"], s["count"]))
    keep = {b: v for b, v in pooled.items() if sum(n for _, n in v) >= COST_MIN_STEPS} \
        or pooled
    counts = [n for v in keep.values() for _, n in v]
    b = np.repeat([batch for batch, v in keep.items() for _ in v], counts)
    t = np.repeat([m for v in keep.values() for m, _ in v], counts)
    return st.fit_cost_model(b, t)


def add_crossings(runs: List[dict], targets: Sequence[float]) -> None:
    for r in runs:
        e = r["evals"]
        axes = {m: e["step" if m == "steps" else m] for m in METRICS}
        r["crossings"] = {f"{t:g}": st.crossings(axes, e["val_loss"], t) for t in targets}
        r["ends"] = {m: axes[m][-1] for m in METRICS}


def _by_method_seed(runs: List[dict]) -> Dict[str, Dict[int, dict]]:
    out: Dict[str, Dict[int, dict]] = {}
    for r in runs:
        out.setdefault(r["method"], {})[r["seed"]] = r
    return out


def compare(a_runs: Dict[int, dict], b_runs: Dict[int, dict], seeds: Sequence[int],
            target: str, metric: str) -> dict:
    a = [(a_runs[s]["crossings"][target][metric], a_runs[s]["ends"][metric]) for s in seeds]
    b = [(b_runs[s]["crossings"][target][metric], b_runs[s]["ends"][metric]) for s in seeds]
    return st.paired_ratio(a, b)


def loss_delta(a_runs: Dict[int, dict], b_runs: Dict[int, dict], seeds: Sequence[int],
               baseline: str) -> dict:
    """Final validation loss at equal samples, a minus b, over seeds."""
    la, lb, at = [], [], []
    for s in seeds:
        ra, rb = a_runs[s], b_runs[s]
        x, y, n = st.final_loss_at_equal_samples(
            (ra["evals"]["samples"], ra["evals"]["val_loss"]),
            (rb["evals"]["samples"], rb["evals"]["val_loss"]))
        la.append(x)
        lb.append(y)
        at.append(n)
    return dict(st.paired_delta(la, lb), baseline=baseline, at_samples=at, method=la,
                baseline_loss=lb)


def judge(by: Dict[str, Dict[int, dict]], method: str, fixed_by: Dict[str, str],
          ramps: Dict[str, str], seeds: Sequence[int], tkeys: Sequence[str]) -> dict:
    """One method against the baselines: per target and metric, the ratio to the fixed
    winner at that metric (``vs_best_fixed``), to the fixed configuration with the lowest
    final loss (``vs_best_loss_fixed``) and to the better ramp; final losses at equal
    samples against the best fixed and each ramp."""
    best_loss = fixed_by["final_loss"]
    out: dict = {"method": method, "vs_best_fixed": {}, "vs_best_loss_fixed": {},
                 "vs_best_ramp": {}}
    for t in tkeys:
        out["vs_best_fixed"][t], out["vs_best_loss_fixed"][t], out["vs_best_ramp"][t] = {}, {}, {}
        for m in METRICS:
            base = fixed_by.get(m, best_loss)
            out["vs_best_fixed"][t][m] = dict(compare(by[method], by[base], seeds, t, m),
                                              baseline=base)
            out["vs_best_loss_fixed"][t][m] = dict(
                compare(by[method], by[best_loss], seeds, t, m), baseline=best_loss)
            best = None
            for ramp in ramps.values():
                c = dict(compare(by[method], by[ramp], seeds, t, m), baseline=ramp)
                # the better ramp is the one the method compares worst against
                if best is None or (c["ratio"] or 0) > (best["ratio"] or 0):
                    best = c
            if best is not None:
                out["vs_best_ramp"][t][m] = best
    # The whole budget: both runs train the same samples, so the ratio of their step counts
    # is "the same data in fewer steps"; with the final-loss delta below, "the same loss".
    out["steps_whole_budget"] = dict(st.paired_ratio(
        [(by[method][s]["steps"], by[method][s]["steps"]) for s in seeds],
        [(by[best_loss][s]["steps"], by[best_loss][s]["steps"]) for s in seeds]),
        baseline=best_loss)
    out["final_loss_delta"] = loss_delta(by[method], by[best_loss], seeds, best_loss)
    out["final_loss_delta_vs"] = {f: loss_delta(by[method], by[r], seeds, r)
                                  for f, r in ramps.items()}
    return out


def _get(d: Optional[dict], *keys):
    for k in keys:
        if d is None:
            return None
        d = d.get(k)
    return d


def flat_ratios(name: str, mid: str, growth: Optional[dict], adaptive: Optional[dict]
                ) -> Dict[str, Optional[float]]:
    """The result's "ratios": growth's headline keys and the adaptive method's, None where
    the method (or its baseline) did not run."""
    g, a = growth, adaptive
    return {
        # the headline: steps over the whole budget (equal samples), beside the final loss
        f"growth_steps_vs_best_fixed_{name}": _get(g, "steps_whole_budget", "ratio"),
        f"growth_steps_ci_hi_{name}": _get(g, "steps_whole_budget", "ci_hi"),
        f"growth_steps_to_middle_target_vs_best_fixed_{name}":
            _get(g, "vs_best_loss_fixed", mid, "steps", "ratio"),
        f"growth_steps_to_middle_target_ci_hi_{name}":
            _get(g, "vs_best_loss_fixed", mid, "steps", "ci_hi"),
        f"growth_samples_vs_best_fixed_{name}":
            _get(g, "vs_best_loss_fixed", mid, "samples", "ratio"),
        f"growth_modelled_time_vs_best_fixed_{name}":
            _get(g, "vs_best_loss_fixed", mid, "modelled_s", "ratio"),
        f"growth_final_loss_delta_{name}": _get(g, "final_loss_delta", "delta"),
        f"growth_final_loss_delta_hi_{name}": _get(g, "final_loss_delta", "ci_hi"),
        f"growth_vs_seesaw_final_loss_delta_{name}":
            _get(g, "final_loss_delta_vs", "seesaw", "delta"),
        f"adaptive_steps_vs_best_fixed_{name}": _get(a, "vs_best_fixed", mid, "steps", "ratio"),
        f"adaptive_steps_ci_hi_{name}": _get(a, "vs_best_fixed", mid, "steps", "ci_hi"),
        f"adaptive_samples_vs_best_fixed_{name}":
            _get(a, "vs_best_fixed", mid, "samples", "ratio"),
        f"adaptive_samples_ci_hi_{name}": _get(a, "vs_best_fixed", mid, "samples", "ci_hi"),
        f"adaptive_modelled_time_vs_best_fixed_{name}":
            _get(a, "vs_best_fixed", mid, "modelled_s", "ratio"),
        f"adaptive_final_loss_delta_{name}": _get(a, "final_loss_delta", "delta"),
        f"adaptive_steps_vs_best_ramp_{name}": _get(a, "vs_best_ramp", mid, "steps", "ratio"),
    }


def analyse(name: str, runs: List[dict], fams: dict, seeds: Sequence[int],
            targets: Sequence[float]) -> Tuple[dict, Dict[str, Optional[float]]]:
    """Per-target, per-metric comparisons of growth and the adaptive method for one task;
    (detail, flat ratios). ``fams`` is the tuning record's families."""
    model = fit_model(runs)
    add_axes(runs, model)
    add_crossings(runs, targets)
    by = _by_method_seed(runs)
    # the fixed family's winner at each metric (--quick runs only the one by final loss)
    fixed_by = {m: label("fixed", c) for m, c in fams["fixed"]["winner_by"].items()}
    fixed_by = {m: (v if v in by else fixed_by["final_loss"]) for m, v in fixed_by.items()}
    ramps = {f: label(f, fams[f]["winner"]) for f in ("doubling", "seesaw")
             if f in fams and label(f, fams[f]["winner"]) in by}
    tkeys = [f"{t:g}" for t in targets]
    mid = tkeys[len(tkeys) // 2]
    detail: dict = {"cost_model": model, "best_fixed_by": fixed_by, "ramps": ramps,
                    "targets": list(targets), "middle_target": float(mid),
                    "seeds": list(seeds), "reached": {}}
    for method, per_seed in by.items():
        detail["reached"][method] = {
            t: sum(1 for s in seeds if per_seed[s]["crossings"][t]["steps"] is not None)
            for t in tkeys}
    judged = {}
    for fam in ("growth", "adaptive"):
        config = _get(fams, fam, "winner") or _get(fams, fam, "config")
        if config is not None and label(fam, config) in by:
            judged[fam] = detail[fam] = judge(by, label(fam, config), fixed_by, ramps, seeds,
                                              tkeys)
    return detail, flat_ratios(name, mid, judged.get("growth"), judged.get("adaptive"))


# --------------------------------------------------------------------------- tuning

def score_configs(runs: List[dict], target: float) -> Dict[str, dict]:
    """method -> scores over its tuning seeds (geometric means; inf: a seed never reached)."""
    add_crossings(runs, [target])
    t = f"{target:g}"
    out: Dict[str, dict] = {}
    for method, per_seed in _by_method_seed(runs).items():
        rs = list(per_seed.values())
        out[method] = {m: st.geomean_score([r["crossings"][t][m] for r in rs]) for m in METRICS}
        out[method]["final_loss"] = float(sum(r["final_loss"] for r in rs) / len(rs))
        out[method]["config"] = rs[0]["config"]
    return out


TIE = 0.005   # scores within 0.5% of the best are a tie, broken by the final loss


def _pick(scores: Dict[str, dict], key: str) -> str:
    """The configuration with the lowest ``key`` score; ties (within TIE of the best, or all
    infinite: none reached the target) go to the lowest mean final loss. A NaN final loss
    (a diverged run) ranks last."""
    def loss(m: str) -> float:
        v = scores[m]["final_loss"]
        return v if math.isfinite(v) else math.inf

    if key == "final_loss":
        return min(scores, key=loss)
    best = min(s[key] for s in scores.values())
    tied = [m for m, s in scores.items() if s[key] <= best * (1 + TIE)] if math.isfinite(best) \
        else list(scores)
    return min(tied, key=loss)


def family_record(runs: List[dict], target: float, seeds: Sequence[int], samples: int) -> dict:
    """A family's tuning result: its winner (by final loss), winners at each metric, every
    configuration's scores, and the compute spent on it."""
    scores = score_configs(runs, target)
    by = {m: scores[_pick(scores, m)]["config"] for m in ("final_loss",) + METRICS[:3]}
    return {
        "winner": by["final_loss"], "winner_by": by, "tuning_seeds": list(seeds),
        "tuning_compute": {"runs": len(runs), "samples": len(runs) * samples},
        "grid": [{"config": s["config"], "score": {k: (v if not isinstance(v, float)
                                                     or math.isfinite(v) else None)
                                                 for k, v in s.items() if k != "config"}}
                 for s in scores.values()]}


def targets_by_rule(fixed_runs: List[dict], seed: int) -> Tuple[List[float], str]:
    """The targets from the sweep's fixed runs on ``seed``, by the rule set before the first
    sweep: the configuration with the lowest final loss; its loss at 40% and 70% of the budget
    and its final loss x 1.02 (3 decimals)."""
    best = min((r for r in fixed_runs if r["seed"] == seed and math.isfinite(r["final_loss"])),
               key=lambda r: r["final_loss"])
    e = best["evals"]
    total = e["samples"][-1]
    targets = [round(st.loss_at(e["samples"], e["val_loss"], f * total), 3) for f in (0.4, 0.7)]
    targets.append(round(best["final_loss"] * 1.02, 3))
    note = (f"set by --retune from the sweep's runs on tuning seed {seed} (never from a judged "
            f"run), by the rule set before the first sweep: the fixed configuration with the "
            f"lowest final validation loss ({best['method']}, final {best['final_loss']:.4f}): "
            f"its loss at 40% and 70% of the budget and its final loss x 1.02")
    return targets, note


def best_by_loss(runs: List[dict]) -> dict:
    """The configuration of ``runs`` with the lowest mean final loss over its seeds."""
    losses: Dict[str, List[float]] = {}
    for r in runs:
        losses.setdefault(r["method"], []).append(r["final_loss"])
    mean = {m: float(np.mean(v)) for m, v in losses.items()}
    best = min(mean, key=lambda m: mean[m] if math.isfinite(mean[m]) else math.inf)
    return next(r["config"] for r in runs if r["method"] == best)


def retune(runner: Runner, name: str, rec: dict, *, samples: int, seeds: Sequence[int],
           quick: bool, families: Sequence[str]) -> dict:
    """The two-stage sweep on the tuning seeds: the fixed family and growth, then the ramps
    from the fixed family's best batch (by final loss); then every family scored on the
    middle target with one cost model. Updates and returns the task's record."""
    task = settings(TASKS[name], quick)
    start = min(task["batches"])
    stage1 = [("fixed", c) for c in fixed_grid(task)]
    if "growth" in families:
        stage1 += [("growth", c) for c in start_grid(task, start)]
    runs = runner.round_robin(name, stage1, seeds, samples)
    fixed_runs = [r for r in runs if r["family"] == "fixed"]
    best_batch = best_by_loss(fixed_runs)["batch"]
    stage2 = [(f, c) for f in ("doubling", "seesaw") for c in start_grid(task, best_batch)]
    runs += runner.round_robin(name, stage2, seeds, samples)
    if not quick and rec.get("targets_samples") != samples:
        rec["targets"], rec["targets_from"] = targets_by_rule(fixed_runs, seeds[0])
        rec["targets_samples"] = samples
        print(f"adaptive: {name}: targets {rec['targets']} ({rec['targets_from']})", flush=True)
    targets = rec["quick_targets"] if quick else rec["targets"]
    target = targets[len(targets) // 2]
    model = fit_model(runs)
    add_axes(runs, model)
    fams = {f: family_record([r for r in runs if r["family"] == f], target, seeds, samples)
            for f in ("fixed", "growth", "doubling", "seesaw") if f in families}
    # The adaptive method: no tuning of its own; the fixed family's best rate (by steps to
    # the middle target) at its starting batch, the task's smallest.
    at_start = score_configs([r for r in fixed_runs if r["config"]["batch"] == start], target)
    lr = at_start[_pick(at_start, "steps")]["config"]["lr"]
    fams["adaptive"] = dict(_get(rec, "families", "adaptive") or {},   # its rule_trials stay
                            config={"start_batch": start, "lr": lr}, flags=ADAPTIVE_FLAGS,
                            lr_from=f"the fixed family's best rate at batch {start}",
                            tuning_compute={"runs": 0, "samples": 0})
    rec.pop("provisional_note", None)
    rec.update(families=fams, cost_model=model, tuning_runs=len(runs),
               tuning_wall_s=sum(r["launch_s"] for r in runs), tuned=True,
               samples=samples, tuned_on=time.strftime("%Y-%m-%d"), grid_quick=quick,
               grid={"batches": task["batches"], "base_lrs": task["base_lrs"],
                     "rates": "base_lrs x sqrt(batch / 16)"})
    return rec


def tuning_compute(fams: dict, samples: int) -> Dict[str, dict]:
    """Runs and samples each family's tuning cost (older records: from its grid)."""
    out = {}
    for f, fam in fams.items():
        c = fam.get("tuning_compute")
        if c is None:
            runs = len(fam.get("grid", [])) * len(fam.get("tuning_seeds", []))
            c = {"runs": runs, "samples": runs * samples}
        out[f] = c
    return out


def record_problems(rec: dict, task: dict, samples: int, families: Sequence[str]) -> List[str]:
    """Why a task's tuning record cannot serve a full comparison (run --retune)."""
    out = []
    if rec.get("targets_samples") != samples:
        out.append(f"its targets were set at {rec.get('targets_samples')} samples, not {samples}")
    fams = rec.get("families", {})
    tried = [g["config"] for g in _get(fams, "fixed", "grid") or []]
    if any(c not in tried for c in fixed_grid(task)):
        out.append("the fixed family was tuned on another grid")
    missing = [f for f in families if f != "adaptive"
               and (f not in fams or fams[f].get("provisional"))]
    if missing:
        out.append(f"{', '.join(missing)} not tuned")
    return out


# --------------------------------------------------------------------------- plot

def _step_samples(r: dict) -> Tuple[np.ndarray, np.ndarray]:
    """(samples seen after each step, that step's batch), from the run-length code."""
    batches = np.repeat([b for b, _ in r["step_batches"]], [n for _, n in r["step_batches"]])
    return np.cumsum(batches), batches


def noise_on(x: np.ndarray, r: dict) -> Optional[np.ndarray]:
    """A run's noise scale at the evaluations where it was known and positive, interpolated
    on ``x`` (samples); None when it never was."""
    s = np.asarray(r["evals"]["samples"], dtype=float)
    v = np.asarray(r["evals"]["noise_scale"], dtype=float)   # None -> NaN
    ok = v > 0
    return np.interp(x, s[ok], v[ok]) if ok.any() else None


def plot(runs: List[dict], name: str, out: str) -> None:
    """One task: val loss vs steps and vs samples (median over seeds, min-max band); batch
    size, learning rate and noise scale vs samples (median; the noise scale with its band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(1, 5, figsize=(27, 4.8))
    for i, (method, per_seed) in enumerate(_by_method_seed(runs).items()):
        colour, rs = f"C{i % 10}", list(per_seed.values())
        for a, xkey in ((ax[0], "step"), (ax[1], "samples")):
            x = np.linspace(max(r["evals"][xkey][0] for r in rs),
                            min(r["evals"][xkey][-1] for r in rs), 100)
            ys = np.array([np.interp(x, r["evals"][xkey], r["evals"]["val_loss"]) for r in rs])
            a.plot(x, np.median(ys, 0), color=colour, label=method)
            a.fill_between(x, ys.min(0), ys.max(0), color=colour, alpha=0.2)
        x = np.linspace(0, min(r["samples"] for r in rs), 200)
        batches = []
        for r in rs:
            seen, b = _step_samples(r)
            batches.append(b[np.minimum(np.searchsorted(seen, x), len(b) - 1)])
        ax[2].plot(x, np.median(batches, 0), color=colour, label=method)
        ys = np.array([np.interp(x, r["evals"]["samples"], r["evals"]["lr"]) for r in rs])
        ax[3].plot(x, np.median(ys, 0), color=colour, label=method)
        ns = [noise_on(x, r) for r in rs]
        ns = np.array([v for v in ns if v is not None])
        if ns.size:
            ax[4].plot(x, np.median(ns, 0), color=colour, label=method)
            ax[4].fill_between(x, ns.min(0), ns.max(0), color=colour, alpha=0.15)
    ax[0].set(xlabel="step", ylabel="validation loss", title=f"{name}: val loss vs steps",
              xscale="log")
    ax[1].set(xlabel="samples", ylabel="validation loss", title=f"{name}: val loss vs samples")
    ax[2].set(xlabel="samples", ylabel="global batch", yscale="log",
              title=f"{name}: batch size (median)")
    ax[2].set_yticks(TASKS[name]["batches"])
    ax[2].yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax[2].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax[3].set(xlabel="samples", ylabel="learning rate", title=f"{name}: learning rate (median)")
    ax[4].set(xlabel="samples", ylabel="noise scale (samples)", yscale="log",
              title=f"{name}: noise scale (median, min-max)")
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def plot_path(base: str, name: str) -> str:
    """``base`` with the task's name before its suffix: one plot per task."""
    root, ext = os.path.splitext(base)
    return f"{root}-{name}{ext or '.png'}"


# --------------------------------------------------------------------------- entry

def read_tuning(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_tuning(path: Path, record: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {v}")
    return v


def parse_args(name: str, extra: List[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"run.py {name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=_positive, default=10,
                    help="fresh seeds 0..N-1 of the comparison (at least 2)")
    ap.add_argument("--tasks", default=None,
                    help="comma-separated tasks (default: mnist1d,lm; those hpcadapt.train "
                         "cannot run yet are left out with a line saying why)")
    ap.add_argument("--results", default=None, metavar="DIR",
                    help=f"where each completed run's record is kept and reused from (default "
                         f"{RESULTS_DIR.relative_to(ROOT)}; with --quick a temporary folder)")
    ap.add_argument("--retune", action="store_true",
                    help="redo the sweep on the tuning seeds (reusing its recorded runs) and "
                         "rewrite the tuning record, then compare")
    ap.add_argument("--tune-only", action="store_true", help="with --retune: no comparison")
    ap.add_argument("--tuning-seeds", default=",".join(map(str, TUNING_SEEDS)))
    ap.add_argument("--tuning-file", default=str(TUNING_FILE),
                    help="the sweep's choices and the targets (read; --retune writes it)")
    ap.add_argument("--ranks", type=_positive, default=2)
    ap.add_argument("--no-repro-check", dest="repro_check", action="store_false",
                    help="skip the rerun of the headline method's first seed (reproducibility: "
                         "the same seed must give the same steps to target)")
    ap.add_argument("--plot", default=None,
                    help="draw the comparison here, one PNG per task (PATH-TASK.png)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny budgets (mnist1d 4,000 samples, lm 768 windows), "
                         "2 seeds, 2 methods (the fixed winner by final loss and growth, or "
                         "gns-batch while growth cannot run), the record's quick_targets, "
                         "evaluations every 1/16, no tuning, no reproducibility rerun (with "
                         "--retune: a 2-stage sweep of 4 configurations and growth's 1, "
                         "written to --tuning-file, which must not be the shipped record)")
    args = ap.parse_args(extra)
    if args.quick and "--seeds" not in extra:
        args.seeds = 2
    return args


def available(wanted: List[str], help_text: str) -> Tuple[List[str], List[str], Dict[str, str]]:
    """(tasks, families, left out -> why): what hpcadapt.train can run; one line each."""
    tasks, families, left_out = [], [], {}
    for t in wanted:
        miss = missing_flags(TASKS[t]["needs"], help_text)
        if miss:
            left_out[t] = f"hpcadapt.train lacks {', '.join(miss)}"
            print(f"adaptive: task {t} left out: {left_out[t]}", flush=True)
        else:
            tasks.append(t)
    for f in FAMILIES:
        miss = missing_flags(FAMILY_NEEDS.get(f, []), help_text)
        if miss:
            left_out[f] = f"hpcadapt.train lacks {', '.join(miss)}"
            print(f"adaptive: family {f} left out: {left_out[f]}", flush=True)
        else:
            families.append(f)
    return tasks, families, left_out


def comparison_methods(fams: dict, families: Sequence[str], quick: bool
                       ) -> List[Tuple[str, dict]]:
    """The methods of the comparison: the fixed winner by final loss (the baseline a user
    would keep; the adaptive_* keys compare with it at every metric, which keeps the
    comparison at 5 methods x 10 seeds), the ramps' and growth's winners, the adaptive method;
    --quick: the fixed winner by final loss and growth (the adaptive method while growth
    cannot run)."""
    fixed = fams["fixed"]["winner_by"]
    wins = [fixed["final_loss"]]
    methods: List[Tuple[str, dict]] = []
    for c in wins:
        if ("fixed", c) not in methods:
            methods.append(("fixed", c))
    if not quick:
        methods += [(f, fams[f]["winner"]) for f in ("doubling", "seesaw") if f in fams]
    if "growth" in families and "growth" in fams:
        methods.append(("growth", fams["growth"]["winner"]))
    if not quick or len(methods) == 1:
        methods.append(("adaptive", fams["adaptive"]["config"]))
    return methods


def repro_check(runner: Runner, name: str, runs: List[dict], method: Tuple[str, dict],
                seed: int, samples: int, model: dict, targets: Sequence[float]) -> dict:
    """The headline method's first seed again (its own record): the same steps to target?"""
    family, config = method
    again = runner.run(name, family, config, seed, samples=samples, order=-1, tag="-repro")
    add_axes([again], model)
    add_crossings([again], targets)
    first = next(r for r in runs if r["method"] == label(family, config) and r["seed"] == seed)
    out = {"method": label(family, config), "seed": seed,
           "same_steps_to_targets": all(again["crossings"][k]["steps"]
                                        == first["crossings"][k]["steps"]
                                        for k in first["crossings"]),
           "same_step_count": again["steps"] == first["steps"],
           "steps_to_targets": {k: [first["crossings"][k]["steps"],
                                    again["crossings"][k]["steps"]]
                                for k in first["crossings"]}}
    if not out["same_steps_to_targets"]:
        print(f"adaptive: {name}: NOT reproducible: seed {seed} of {out['method']} gave other "
              f"steps to target when run again", flush=True)
    return out


def results_folder(args: argparse.Namespace) -> Path:
    if args.results is not None:
        return Path(args.results).absolute()
    if args.quick:   # inside the runner's temporary folder, removed at the end
        return Path(tempfile.mkdtemp(prefix="hpcadapt-adaptive-results-"))
    return RESULTS_DIR


def check_record(name: str, record: dict, tasks: Sequence[str], families: Sequence[str],
                 path: Path) -> None:
    """Before any run: each task's tuning record must serve a full comparison."""
    problems = [f"{t}: {', '.join(p)}" for t in tasks
                for p in [record_problems(record["tasks"][t], TASKS[t], TASKS[t]["samples"],
                                          families)] if p]
    if problems:
        raise SystemExit(f"{name}: the tuning record {path} cannot serve this comparison ("
                         + "; ".join(problems) + "): run --retune")


def say_mixed_code(name: str, t: str, runs: List[dict]) -> List[str]:
    """The library versions the task's records come from; a line when there are several."""
    codes = sorted({str(r.get("code")) for r in runs})
    if len(codes) > 1:
        print(f"{name}: {t}: WARNING: the records come from {len(codes)} versions of the "
              f"library's code ({', '.join(codes)}); a fresh --results gives one", flush=True)
    return codes


def say_missed(name: str, t: str, detail: dict, seeds: Sequence[int]) -> None:
    for method, reached in detail["reached"].items():
        missed = {k: len(seeds) - v for k, v in reached.items() if v < len(seeds)}
        if missed:
            print(f"{name}: {t}: {method} never reached " + ", ".join(
                f"loss {k} on {v} of {len(seeds)} seeds" for k, v in missed.items())
                + " (censored at its budget)", flush=True)


def table_rows(details: Dict[str, dict]) -> Dict[str, dict]:
    """The printed table: growth (vs the best fixed by loss) and the adaptive method (vs the
    fixed winner at each metric) at the middle target."""
    rows = {}
    for t, d in details.items():
        mid = f"{d['middle_target']:g}"
        for fam, key in (("growth", "vs_best_loss_fixed"), ("adaptive", "vs_best_fixed")):
            for m in ("steps", "samples", "modelled_s"):
                c = _get(d, fam, key, mid, m)
                if c is None:
                    continue
                rows[f"{t} {fam} {m}"] = {
                    "ratio": c["ratio"] if c["ratio"] is not None else "n/a",
                    "ci": (f"{c['ci_lo']:.3f}-{c['ci_hi']:.3f}" if c["ci_hi"] is not None
                           else "n/a"),
                    "win": c["win"], "bound": c["bound"], "both_censored": c["both_censored"],
                    "vs": c["baseline"]}
    return rows


def run(name: str, extra: List[str]) -> dict:
    args = parse_args(name, extra)
    if args.seeds < 2:
        raise SystemExit(f"{name}: --seeds {args.seeds}: a paired comparison needs at least "
                         f"2 seeds")
    tuning_path = Path(args.tuning_file)
    if args.quick and args.retune and tuning_path.resolve() == TUNING_FILE.resolve():
        raise SystemExit(f"{name}: --quick --retune would overwrite the shipped record with a "
                         f"toy sweep: give --tuning-file PATH")
    wanted = args.tasks.split(",") if args.tasks else list(TASKS)
    unknown = [t for t in wanted if t not in TASKS]
    if unknown:
        raise SystemExit(f"{name}: unknown task(s) {unknown}; choose from {sorted(TASKS)}")
    folder = results_folder(args)
    record = read_tuning(tuning_path if tuning_path.exists() else TUNING_FILE)
    tasks, families, left_out = available(wanted, trainer_help())
    if not tasks:
        raise SystemExit(f"{name}: no task can run: " + "; ".join(
            f"{t}: {why}" for t, why in left_out.items() if t in TASKS))
    if not (args.quick or args.retune):
        check_record(name, record, tasks, families, tuning_path)
    open_results(folder, args.quick)
    runner = Runner(folder, args.ranks, args.quick)
    started = time.perf_counter()
    tune_seeds = [int(s) for s in args.tuning_seeds.split(",") if s.strip()]
    seeds = list(range(args.seeds))
    all_runs: Dict[str, List[dict]] = {}
    details, ratios, repro, plots, compute = {}, {}, {}, {}, {}
    for t in tasks:
        samples = settings(TASKS[t], args.quick)["samples"]
        if args.retune:
            print(f"{name}: {t}: sweep on tuning seeds {tune_seeds}", flush=True)
            record["tasks"][t] = retune(runner, t, record["tasks"][t], samples=samples,
                                        seeds=tune_seeds, quick=args.quick, families=families)
            write_tuning(tuning_path, record)
            print(f"{name}: {t}: tuning record written to {tuning_path}", flush=True)
        rec = record["tasks"][t]
        compute[t] = tuning_compute(rec["families"], rec.get("samples", samples))
        if args.tune_only:
            continue
        targets = rec["quick_targets"] if args.quick else rec["targets"]
        methods = comparison_methods(rec["families"], families, args.quick)
        print(f"{name}: {t}: targets {targets}", flush=True)
        all_runs[t] = runs = runner.round_robin(t, methods, seeds, samples)
        details[t], flat = analyse(t, runs, rec["families"], seeds, targets)
        ratios.update(flat)
        if args.repro_check and not args.quick:
            headline = next(m for f in ("growth", "adaptive") for m in methods if m[0] == f)
            repro[t] = repro_check(runner, t, runs, headline, seeds[0], samples,
                                   details[t]["cost_model"], targets)
        say_missed(name, t, details[t], seeds)
        details[t]["code_versions"] = say_mixed_code(name, t, runs)
    print(f"{name}: reused {runner.reused} runs, trained {runner.trained} (records in "
          f"{folder})", flush=True)
    plot_base = args.plot or (os.path.join(runner.tmp, "adaptive.png") if args.quick else None)
    if plot_base:
        for t, runs in all_runs.items():
            plots[t] = os.path.abspath(plot_path(plot_base, t))
            plot(runs, t, plots[t])
    return {"benchmark": name, "quick": args.quick, "tasks": tasks, "left_out": left_out,
            "families": families, "seeds": args.seeds, "ranks": args.ranks,
            "tuning_file": str(tuning_path), "results": str(folder),
            "reused_runs": runner.reused, "trained_runs": runner.trained,
            "tuned": {t: bool(record["tasks"][t].get("tuned")) for t in tasks},
            "tuning_compute": compute, "adaptive_flags": ADAPTIVE_FLAGS,
            "growth_flags": GROWTH_FLAGS, "monitor_flags": MONITOR_FLAGS, "schedule": SCHEDULE,
            "warmup_fraction": WARMUP_FRACTION, "comparison": details,
            "reproducible": repro, "runs": all_runs, "rows": table_rows(details),
            "benchmark_wall_s": time.perf_counter() - started,
            "loadavg_end": list(os.getloadavg()), "plots": plots, "ratios": ratios}
