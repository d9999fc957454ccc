"""adaptive: does the adaptive batch policy beat baselines tuned as a careful user would?

Two tasks, 2 MPI ranks per run, a fixed budget in samples (one epoch of a fixed --samples):

* ``mnist1d``: MNIST-1D, the built-in 1-D CNN, SGD with momentum 0.9;
* ``lm``: a character-level transformer LM on Shakespeare (context 64), AdamW.

Every run uses the same learning-rate schedule, cosine over the budget's samples with a
5% warm-up, and is evaluated on the validation set every ~1.5% of the budget (and once at
the end). Families (the grids are ``TASKS``; a configuration's flags are ``method_flags``):

* ``fixed``: one batch size for the whole run, over a range (16 to 512), each with a
  learning-rate grid of 3-4 points;
* ``doubling``: a Merrill-style batch ramp: the batch doubles when 1/8, 1/4 and 1/2 of the
  budget's samples are seen (``--policy schedule --schedule-batch`` at the steps those
  fractions fall on), the rate following the cosine unchanged;
* ``seesaw``: Seesaw (Meterez et al. 2025): where the cosine rate would halve, the rate is
  multiplied by 1/sqrt(2) and the batch doubled instead (a constant base rate after the same
  warm-up, ``--schedule-batch`` at that step and ``--schedule-lr-scale`` one step later, as
  the schedule policy wants); past the largest batch the rate halves there;
* ``adaptive``: ``ADAPTIVE_FLAGS`` from the task's smallest batch to its largest, with the
  fixed family's best rate at that smallest batch; no tuning of its own: the same flags on
  both tasks.

Targets: three validation losses per task, fixed in advance in the tuning record
(``benchmarks/adaptive_tuning.json``), never derived from the runs being judged.

Tuning (``--retune``): every configuration of every family on the tuning seeds (1000,
1001); a configuration's score is the geometric mean over those seeds of its steps to the
middle target (a seed that never reaches it: infinite), ties broken by the mean final loss;
per family the winner by steps, and for ``fixed`` also by samples, modelled time and final
loss (the comparison's "best fixed at that metric"). The record keeps the grid, every
configuration's scores and the seeds.

Comparison (``--seeds N``, default 5; fewer than 2 refused): fresh seeds 0..N-1; for each
seed every method once, the order rotated seed by seed (round-robin, so that the machine's
drift hits all alike). Per target and metric (steps, samples, modelled time, wall time) the
adaptive method against the fixed family's winner at that metric, and against the better of
the two ramps: per-seed ratios, their geometric mean with a 95% t-interval; a win only where
the upper bound is below 1 (see ``adaptive_stats.paired_ratio`` for censored seeds). The
final validation loss at equal samples: adaptive minus best fixed (by final loss), mean and
95% interval. Modelled time: a per-step cost c0 + c1 * batch fitted by least squares to the
median step time at each batch size, over all the task's runs of this comparison, summed
over each run's steps. Wall time is reported with the load average beside it."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import adaptive_stats as st
from common import read_jsonl
from launch import ROOT, env, run_mpi

HERE = Path(__file__).resolve().parent
TUNING_FILE = HERE / "adaptive_tuning.json"

# The adaptive method's flags, the same on every task: gns-batch at its defaults (a one-sided
# 80% lower bound of the noise scale, jumps of at most x4, cooldown 2,048 samples) with a
# monitor memory of 4,096 samples. The task adds --batch-size/--lr (its smallest batch and
# the fixed family's best rate there), the batch range (--gns-batch-min/--gns-batch-max) and
# the rate rule its optimizer calls for (RULES: linear for SGD, the square-root rule for
# Adam). The SGD rule was chosen in 4 trials on mnist1d's tuning seed 1000 (linear or
# AdaScale x --gns-batch-fraction 1 or 0.5; steps to 0.4: linear 397, AdaScale never,
# fraction 0.5 735-737), recorded in adaptive_tuning.json.
ADAPTIVE_FLAGS = ["--policy", "gns-batch", "--monitor-window", "4096"]
RULES = {"sgd": "linear", "adamw": "sqrt"}

SCHEDULE = "cosine"
WARMUP_FRACTION = 0.05
EVALS_PER_BUDGET = 64            # an evaluation every 1/64 (~1.6%) of the budget
QUICK_EVALS_PER_BUDGET = 16      # --quick: every 1/16 (an evaluation of the LM costs ~0.5 s)
DOUBLING_FRACTIONS = (0.125, 0.25, 0.5)
SEESAW_MAX_HALVINGS = 6
TUNING_SEEDS = (1000, 1001)
METRICS = ("steps", "samples", "modelled_s", "wall_s")
REUSE = False   # --from-dir: read a run's metrics file where it exists instead of training

TASKS: Dict[str, dict] = {
    "mnist1d": {
        "what": "MNIST-1D, built-in 1-D CNN, SGD momentum 0.9",
        "flags": ["--dataset", "mnist1d", "--model", "cnn", "--optimizer", "sgd",
                  "--momentum", "0.9"],
        "needs": ["--optimizer", "--lr-schedule", "--warmup-fraction", "--eval-every-samples"],
        "samples": 30000, "train_fraction": 0.8,     # mnist1d: --samples is train + test
        "batches": [16, 32, 64, 128, 256, 512], "lrs": [0.05, 0.1, 0.2, 0.4],
        "ramp_starts": [16], "ramp_lrs": [0.025, 0.05, 0.1, 0.2],
        "quick": {"samples": 4000, "batches": [32, 64], "lrs": [0.1],
                  "ramp_starts": [32], "ramp_lrs": [0.1]},
    },
    "lm": {
        "what": "character-level transformer LM on Shakespeare (context 64), AdamW",
        "flags": ["--dataset", "shakespeare", "--model", "charlm", "--context", "64",
                  "--optimizer", "adamw"],
        "needs": ["--optimizer", "--lr-schedule", "--warmup-fraction", "--eval-every-samples",
                  "--context", "charlm", "shakespeare"],
        "samples": 16000, "train_fraction": 1.0,     # shakespeare: --samples training windows
        "batches": [16, 64, 256], "lrs": [2e-3, 5e-3, 1.2e-2, 3e-2],
        "ramp_starts": [16], "ramp_lrs": [2e-3, 5e-3, 1.2e-2],
        "quick": {"samples": 768, "batches": [32, 64], "lrs": [2e-3],
                  "ramp_starts": [32], "ramp_lrs": [2e-3]},
    },
}


# --------------------------------------------------------------------------- configurations

def budget(task: dict, samples: int) -> int:
    """Training samples in the budget: one epoch of the training split."""
    return int(samples * task["train_fraction"])


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
    if family == "adaptive":
        optimizer = task["flags"][task["flags"].index("--optimizer") + 1]
        return (["--batch-size", str(start), "--lr", lr] + ADAPTIVE_FLAGS
                + ["--lr-rule", RULES[optimizer],
                   "--gns-batch-min", str(start), "--gns-batch-max", str(top)])
    raise ValueError(f"unknown family {family!r}")


def label(family: str, config: dict) -> str:
    if family == "fixed":
        return f"fixed b{config['batch']} lr{config['lr']:g}"
    return f"{family} b{config['start_batch']} lr{config['lr']:g}"


def grid(task: dict, quick: bool = False) -> Dict[str, List[dict]]:
    t = dict(task, **task["quick"]) if quick else task
    return {
        "fixed": [{"batch": b, "lr": lr} for b in t["batches"] for lr in t["lrs"]],
        "doubling": [{"start_batch": b, "lr": lr} for b in t["ramp_starts"]
                     for lr in t["ramp_lrs"]],
        "seesaw": [{"start_batch": b, "lr": lr} for b in t["ramp_starts"]
                   for lr in t["ramp_lrs"]],
    }


# --------------------------------------------------------------------------- running

def trainer_help() -> str:
    proc = subprocess.run([sys.executable, "-m", "hpcadapt.train", "--help"], env=env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc.stdout


def missing_flags(task: dict, help_text: str) -> List[str]:
    return [f for f in task["needs"] if f not in help_text]


def common_flags(name: str, samples: int, seed: int, total: int,
                 evals: int = EVALS_PER_BUDGET) -> List[str]:
    return TASKS[name]["flags"] + [
        "--samples", str(samples), "--epochs", "1", "--seed", str(seed), "--threads", "1",
        "--no-progress", "--lr-schedule", SCHEDULE, "--warmup-fraction", f"{WARMUP_FRACTION:g}",
        "--eval-every-samples", str(max(1, total // evals))]


def _runlength(values: Sequence[int]) -> List[List[int]]:
    out: List[List[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([int(v), 1])
    return out


def parse_run(rows: List[dict]) -> dict:
    """The raw facts of one run from its metrics file: the evaluations, the batch of every
    step (run-length coded), step times per batch (for the cost model), wall time."""
    steps = [r for r in rows if r.get("event") == "step"]
    evals = [r for r in rows if r.get("event") == "eval"]
    if not evals:
        raise SystemExit("a run wrote no eval lines to its metrics file: hpcadapt.train "
                         "needs --eval-every-samples")
    t0 = (steps[0]["time_s"] - steps[0]["step_time_s"]) if steps else evals[0].get("time_s", 0.0)
    times: Dict[int, List[float]] = {}
    for r in steps:
        times.setdefault(int(r["batch_size"]), []).append(float(r["step_time_s"]))
    return {
        "evals": {
            "step": [int(r["step"]) for r in evals],
            "samples": [int(r["samples"]) for r in evals],
            "val_loss": [float(r["val_loss"]) for r in evals],
            "val_accuracy": [r.get("val_accuracy") for r in evals],
            "batch_size": [int(r["batch_size"]) for r in evals],
            "lr": [float(r["lr"]) for r in evals],
            "wall_s": [float(r["time_s"]) - t0 if "time_s" in r else float("nan")
                       for r in evals],
        },
        "step_batches": _runlength([int(r["batch_size"]) for r in steps]),
        "step_times": {str(b): v for b, v in times.items()},   # dropped before the JSON
        "steps": int(steps[-1]["step"]) if steps else int(evals[-1]["step"]),
        "samples": int(evals[-1]["samples"]),
        "final_loss": float(evals[-1]["val_loss"]),
        "train_wall_s": (float(steps[-1]["time_s"]) - t0) if steps else float("nan"),
    }


def run_one(name: str, family: str, config: dict, seed: int, *, samples: int, ranks: int,
            tmp: str, order: int, evals: int = EVALS_PER_BUDGET) -> dict:
    task = TASKS[name]
    total = budget(task, samples)
    path = os.path.join(tmp, f"{name}-{label(family, config).replace(' ', '_')}-s{seed}.jsonl")
    flags = (common_flags(name, samples, seed, total, evals)
             + method_flags(family, config, task, total))
    # a later flag wins in argparse: the method's own --lr-schedule (Seesaw) overrides
    load0 = os.getloadavg()
    started = time.perf_counter()
    if not (REUSE and os.path.exists(path)):
        run_mpi(ranks, ["-m", "hpcadapt.train"] + flags + ["--metrics-file", path])
    launch_s = time.perf_counter() - started
    load1 = os.getloadavg()
    rec = parse_run(read_jsonl(path))
    rec.update({"task": name, "family": family, "config": config, "method": label(family, config),
                "seed": seed, "order": order, "flags": flags, "launch_s": launch_s,
                "loadavg_before": list(load0), "loadavg_after": list(load1)})
    print(f"  {name} seed {seed} {rec['method']:<28} {rec['steps']:5d} steps, final loss "
          f"{rec['final_loss']:.4f}, {launch_s:.1f} s (load {load0[0]:.1f})", flush=True)
    return rec


def run_round_robin(name: str, methods: List[Tuple[str, dict]], seeds: Sequence[int], *,
                    samples: int, ranks: int, tmp: str,
                    evals: int = EVALS_PER_BUDGET) -> List[dict]:
    runs, order = [], 0
    for i, seed in enumerate(seeds):
        k = i % len(methods)
        for family, config in methods[k:] + methods[:k]:
            runs.append(run_one(name, family, config, seed, samples=samples, ranks=ranks,
                                tmp=tmp, order=order, evals=evals))
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
    """The task's per-step cost model over the steps of ``runs`` (all methods, all seeds)."""
    pooled: Dict[int, List[float]] = {}
    for r in runs:
        for batch, times in r["step_times"].items():
            pooled.setdefault(int(batch), []).extend(times)
    keep = {b: t for b, t in pooled.items() if len(t) >= COST_MIN_STEPS} or pooled
    b = [batch for batch, times in keep.items() for _ in times]
    t = [x for times in keep.values() for x in times]
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


def analyse(name: str, runs: List[dict], record: dict, seeds: Sequence[int],
            targets: Sequence[float]) -> Tuple[dict, Dict[str, Optional[float]]]:
    """Per-target, per-metric comparisons for one task; (detail, flat ratios)."""
    model = fit_model(runs)
    add_axes(runs, model)
    add_crossings(runs, targets)
    by = _by_method_seed(runs)
    fams = record["families"]
    adaptive = label("adaptive", fams["adaptive"]["config"])
    # the fixed family's winner at each metric (--quick runs only the one by steps)
    fixed_by = {m: label("fixed", c) for m, c in fams["fixed"]["winner_by"].items()}
    fixed_by = {m: (v if v in by else fixed_by["steps"]) for m, v in fixed_by.items()}
    ramps = [label(f, fams[f]["winner"]) for f in ("doubling", "seesaw")
             if f in fams and label(f, fams[f]["winner"]) in by]
    tkeys = [f"{t:g}" for t in targets]
    detail: dict = {"cost_model": model, "adaptive": adaptive, "best_fixed_by": fixed_by,
                    "ramps": ramps, "targets": list(targets), "seeds": list(seeds),
                    "vs_best_fixed": {}, "vs_best_ramp": {}, "reached": {}}
    for method, per_seed in by.items():
        detail["reached"][method] = {
            t: sum(1 for s in seeds if per_seed[s]["crossings"][t]["steps"] is not None)
            for t in tkeys}
    for t in tkeys:
        detail["vs_best_fixed"][t], detail["vs_best_ramp"][t] = {}, {}
        for m in METRICS:
            base = fixed_by.get(m, fixed_by["steps"])
            detail["vs_best_fixed"][t][m] = dict(compare(by[adaptive], by[base], seeds, t, m),
                                                 baseline=base)
            best = None
            for ramp in ramps:
                c = dict(compare(by[adaptive], by[ramp], seeds, t, m), baseline=ramp)
                # the better ramp is the one the adaptive method compares worst against
                if best is None or (c["ratio"] or 0) > (best["ratio"] or 0):
                    best = c
            if best is not None:
                detail["vs_best_ramp"][t][m] = best
    base = fixed_by.get("final_loss", fixed_by["steps"])
    la, lb, at = [], [], []
    for s in seeds:
        ra, rb = by[adaptive][s], by[base][s]
        x, y, n = st.final_loss_at_equal_samples(
            (ra["evals"]["samples"], ra["evals"]["val_loss"]),
            (rb["evals"]["samples"], rb["evals"]["val_loss"]))
        la.append(x)
        lb.append(y)
        at.append(n)
    detail["final_loss_delta"] = dict(st.paired_delta(la, lb), baseline=base, at_samples=at,
                                      adaptive=la, best_fixed=lb)
    mid = tkeys[len(tkeys) // 2]
    vf, vr = detail["vs_best_fixed"][mid], detail["vs_best_ramp"][mid]
    flat = {
        f"adaptive_steps_vs_best_fixed_{name}": vf["steps"]["ratio"],
        f"adaptive_steps_ci_hi_{name}": vf["steps"]["ci_hi"],
        f"adaptive_samples_vs_best_fixed_{name}": vf["samples"]["ratio"],
        f"adaptive_samples_ci_hi_{name}": vf["samples"]["ci_hi"],
        f"adaptive_modelled_time_vs_best_fixed_{name}": vf["modelled_s"]["ratio"],
        f"adaptive_final_loss_delta_{name}": detail["final_loss_delta"]["delta"],
        f"adaptive_steps_vs_best_ramp_{name}": vr["steps"]["ratio"] if vr else None,
    }
    detail["middle_target"] = float(mid)
    return detail, flat


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
    infinite: none reached the target) go to the lowest mean final loss."""
    best = min(s[key] for s in scores.values())
    tied = [m for m, s in scores.items() if s[key] <= best * (1 + TIE)] if math.isfinite(best) \
        else list(scores)
    return min(tied, key=lambda m: scores[m]["final_loss"])


def retune(name: str, *, samples: int, seeds: Sequence[int], ranks: int, tmp: str,
           target: float, quick: bool) -> dict:
    task = TASKS[name]
    g = grid(task, quick)
    methods = [(f, c) for f, cs in g.items() for c in cs]
    runs = run_round_robin(name, methods, seeds, samples=samples, ranks=ranks, tmp=tmp,
                           evals=QUICK_EVALS_PER_BUDGET if quick else EVALS_PER_BUDGET)
    model = fit_model(runs)
    add_axes(runs, model)
    families: dict = {}
    for fam in g:
        scores = score_configs([r for r in runs if r["family"] == fam], target)
        by = {m: scores[_pick(scores, m)]["config"] for m in ("steps", "samples", "modelled_s")}
        by["final_loss"] = scores[min(scores, key=lambda m: scores[m]["final_loss"])]["config"]
        families[fam] = {
            "winner": by["steps"], "winner_by": by, "tuning_seeds": list(seeds),
            "grid": [{"config": s["config"], "score": {k: (v if not isinstance(v, float)
                                                         or math.isfinite(v) else None)
                                                     for k, v in s.items() if k != "config"}}
                     for s in scores.values()]}
    # The adaptive method: no tuning of its own; the fixed family's best rate (by steps to
    # the middle target) at its starting batch, the task's smallest.
    start = min(task["batches"])
    fixed_scores = score_configs([r for r in runs if r["family"] == "fixed"
                                  and r["config"]["batch"] == start], target)
    lr = fixed_scores[_pick(fixed_scores, "steps")]["config"]["lr"] if fixed_scores else \
        families["fixed"]["winner"]["lr"]
    families["adaptive"] = {"config": {"start_batch": start, "lr": lr},
                            "flags": ADAPTIVE_FLAGS,
                            "lr_from": f"the fixed family's best rate at batch {start}"}
    return {"families": families, "cost_model": model, "tuning_runs": len(runs),
            "tuning_wall_s": sum(r["launch_s"] for r in runs)}


# --------------------------------------------------------------------------- plot

def plot(results: Dict[str, List[dict]], out: str) -> None:
    """Per task: val loss vs steps and vs samples (median over seeds, min-max band), batch
    size and learning rate vs steps (median)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    import numpy as np

    tasks = list(results)
    fig, axes = plt.subplots(len(tasks), 4, figsize=(22, 4.8 * len(tasks)), squeeze=False)
    for row, name in zip(axes, tasks):
        for i, (method, per_seed) in enumerate(_by_method_seed(results[name]).items()):
            colour = f"C{i % 10}"
            rs = list(per_seed.values())
            for ax, xkey in ((row[0], "step"), (row[1], "samples")):
                end = min(r["evals"][xkey][-1] for r in rs)
                grid_x = np.linspace(min(r["evals"][xkey][0] for r in rs), end, 100)
                ys = np.array([np.interp(grid_x, r["evals"][xkey], r["evals"]["val_loss"])
                               for r in rs])
                ax.plot(grid_x, np.median(ys, 0), color=colour, label=method)
                ax.fill_between(grid_x, ys.min(0), ys.max(0), color=colour, alpha=0.2)
            end = min(r["evals"]["step"][-1] for r in rs)
            grid_x = np.linspace(0, end, 200)
            # the batch of every step (run-length coded); the rate at each evaluation
            batches = np.array([np.repeat([b for b, _ in r["step_batches"]],
                                          [n for _, n in r["step_batches"]])
                                [np.minimum(grid_x.astype(int), r["steps"] - 1)] for r in rs])
            row[2].plot(grid_x, np.median(batches, 0), color=colour, label=method)
            ys = np.array([np.interp(grid_x, r["evals"]["step"], r["evals"]["lr"]) for r in rs])
            row[3].plot(grid_x, np.median(ys, 0), color=colour, label=method)
        row[0].set(xlabel="step", ylabel="validation loss", title=f"{name}: val loss vs steps",
                   xscale="log")
        row[1].set(xlabel="samples", ylabel="validation loss",
                   title=f"{name}: val loss vs samples")
        row[2].set(xlabel="step", ylabel="global batch", yscale="log",
                   title=f"{name}: batch size (median)")
        row[2].set_yticks(TASKS[name]["batches"])
        row[2].yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        row[2].yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        row[3].set(xlabel="step", ylabel="learning rate", title=f"{name}: learning rate (median)")
        row[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


# --------------------------------------------------------------------------- entry

def load_record(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_record(path: Path, record: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {v}")
    return v


def run(name: str, extra: List[str]) -> dict:
    ap = argparse.ArgumentParser(prog=f"run.py {name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=_positive, default=5,
                    help="fresh seeds 0..N-1 of the comparison (at least 2)")
    ap.add_argument("--tasks", default=None,
                    help="comma-separated tasks (default: mnist1d,lm; those hpcadapt.train "
                         "cannot run yet are left out with a line saying why)")
    ap.add_argument("--retune", action="store_true",
                    help="redo the sweep on the tuning seeds and rewrite the tuning record, "
                         "then compare")
    ap.add_argument("--tune-only", action="store_true", help="with --retune: no comparison")
    ap.add_argument("--tuning-seeds", default=",".join(map(str, TUNING_SEEDS)))
    ap.add_argument("--tuning-file", default=str(TUNING_FILE),
                    help="the sweep's choices and the targets (read; --retune writes it)")
    ap.add_argument("--ranks", type=_positive, default=2)
    ap.add_argument("--no-repro-check", dest="repro_check", action="store_false",
                    help="skip the rerun of the adaptive method's first seed (reproducibility: "
                         "the same seed must give the same steps to target)")
    ap.add_argument("--plot", default=None, help="draw the comparison here (PNG)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny budgets (mnist1d 4,000 samples, lm 768 windows), "
                         "2 seeds, 2 methods (the fixed winner by steps and the adaptive "
                         "one), the record's quick_targets, evaluations every 1/16, no "
                         "tuning, no reproducibility rerun (with --retune: a "
                         "4-configuration sweep, written to "
                         "--tuning-file, which must not be the shipped record)")
    ap.add_argument("--from-dir", default=None, metavar="DIR",
                    help="re-analyse: runs whose metrics file is in DIR (a --keep-tmp run's "
                         "metrics_dir, same options) are read, not trained again")
    args = ap.parse_args(extra)
    global REUSE
    REUSE = args.from_dir is not None
    if args.quick:
        args.seeds = 2 if "--seeds" not in extra else args.seeds
    if args.seeds < 2:
        raise SystemExit(f"{name}: --seeds {args.seeds}: a paired comparison needs at least "
                         f"2 seeds")
    tuning_path = Path(args.tuning_file)
    if args.quick and args.retune and tuning_path.resolve() == TUNING_FILE.resolve():
        raise SystemExit(f"{name}: --quick --retune would overwrite the shipped record with a "
                         f"toy sweep: give --tuning-file PATH")
    record = load_record(tuning_path if tuning_path.exists() else TUNING_FILE)
    wanted = args.tasks.split(",") if args.tasks else list(TASKS)
    unknown = [t for t in wanted if t not in TASKS]
    if unknown:
        raise SystemExit(f"{name}: unknown task(s) {unknown}; choose from {sorted(TASKS)}")
    help_text = trainer_help()
    tasks, left_out = [], {}
    for t in wanted:
        miss = missing_flags(TASKS[t], help_text)
        if miss:
            left_out[t] = f"hpcadapt.train lacks {', '.join(miss)}"
            print(f"{name}: task {t} left out: {left_out[t]}", flush=True)
        else:
            tasks.append(t)
    if not tasks:
        raise SystemExit(f"{name}: no task can run: " + "; ".join(
            f"{t}: {why}" for t, why in left_out.items()))
    tmp = args.from_dir or tempfile.mkdtemp(prefix="hpcadapt-adaptive-")
    started = time.perf_counter()
    tune_seeds = [int(s) for s in args.tuning_seeds.split(",") if s.strip()]
    all_runs: Dict[str, List[dict]] = {}
    details, ratios, repro = {}, {}, {}
    for t in tasks:
        task = TASKS[t]
        samples = task["quick"]["samples"] if args.quick else task["samples"]
        rec = record["tasks"][t]
        targets = rec["quick_targets"] if args.quick else rec["targets"]
        if args.retune:
            print(f"{name}: {t}: sweep on tuning seeds {tune_seeds}", flush=True)
            tuned = retune(t, samples=samples, seeds=tune_seeds, ranks=args.ranks, tmp=tmp,
                           target=targets[len(targets) // 2], quick=args.quick)
            rec.pop("provisional_note", None)
            rec.update(tuned, tuned=True, samples=samples,
                       tuned_on=time.strftime("%Y-%m-%d"), grid_quick=args.quick)
            record["tasks"][t] = rec
            write_record(tuning_path, record)
            print(f"{name}: {t}: tuning record written to {tuning_path}", flush=True)
        elif not rec.get("tuned"):
            print(f"{name}: WARNING: the tuning record of {t} is PROVISIONAL (not from a "
                  f"sweep: {rec.get('provisional_note', 'chosen by hand')}); run --retune",
                  flush=True)
        if rec.get("samples", samples) != samples and not args.quick:
            print(f"{name}: WARNING: {t} was tuned at --samples {rec['samples']}, compared at "
                  f"{samples}", flush=True)
        if args.tune_only:
            continue
        fams = rec["families"]
        methods: List[Tuple[str, dict]] = []
        wins = ([fams["fixed"]["winner"]] if args.quick
                else list(fams["fixed"]["winner_by"].values()))
        for c in wins:
            if ("fixed", c) not in methods:
                methods.append(("fixed", c))
        if not args.quick:
            methods += [(f, fams[f]["winner"]) for f in ("doubling", "seesaw") if f in fams]
        methods.append(("adaptive", fams["adaptive"]["config"]))
        seeds = list(range(args.seeds))
        print(f"{name}: {t}: {len(methods)} methods x {len(seeds)} seeds, round-robin; "
              f"targets {targets}", flush=True)
        evals = QUICK_EVALS_PER_BUDGET if args.quick else EVALS_PER_BUDGET
        runs = run_round_robin(t, methods, seeds, samples=samples, ranks=args.ranks, tmp=tmp,
                               evals=evals)
        details[t], flat = analyse(t, runs, rec, seeds, targets)
        ratios.update(flat)
        # Reproducible: the adaptive method's seed 0 again gives the same steps to target
        # (not in --quick: CI's time).
        if args.repro_check and not args.quick:
            again_dir = os.path.join(tmp, f"repro-{t}")
            os.makedirs(again_dir, exist_ok=True)
            again = run_one(t, "adaptive", fams["adaptive"]["config"], seeds[0],
                            samples=samples, ranks=args.ranks, tmp=again_dir, order=-1,
                            evals=evals)
            add_axes([again], details[t]["cost_model"])
            add_crossings([again], targets)
            first = next(r for r in runs if r["method"] == details[t]["adaptive"]
                         and r["seed"] == seeds[0])
            repro[t] = {
                "seed": seeds[0],
                "same_steps_to_targets": all(again["crossings"][k]["steps"]
                                             == first["crossings"][k]["steps"]
                                             for k in first["crossings"]),
                "same_step_count": again["steps"] == first["steps"],
                "steps_to_targets": {k: [first["crossings"][k]["steps"],
                                         again["crossings"][k]["steps"]]
                                     for k in first["crossings"]}}
            if not repro[t]["same_steps_to_targets"]:
                print(f"{name}: {t}: NOT reproducible: seed {seeds[0]} of the adaptive "
                      f"method gave other steps to target when run again", flush=True)
        for r in runs:
            r.pop("step_times", None)
        all_runs[t] = runs
        for method, reached in details[t]["reached"].items():
            missed = {k: len(seeds) - v for k, v in reached.items() if v < len(seeds)}
            if missed:
                print(f"{name}: {t}: {method} never reached " + ", ".join(
                    f"loss {k} on {v} of {len(seeds)} seeds" for k, v in missed.items())
                    + " (censored at its budget, kept in the ratios)", flush=True)
    rows = {}
    for t, d in details.items():
        mid = f"{d['middle_target']:g}"
        for m in ("steps", "samples", "modelled_s"):
            c = d["vs_best_fixed"][mid][m]
            rows[f"{t} {m}"] = {"ratio": c["ratio"] if c["ratio"] is not None else "n/a",
                                "ci": (f"{c['ci_lo']:.3f}-{c['ci_hi']:.3f}"
                                       if c["ci_hi"] is not None else "n/a"),
                                "win": c["win"], "bound": c["bound"], "vs": c["baseline"]}
    plot_path = args.plot
    if plot_path is None and args.quick:
        plot_path = os.path.join(tmp, "adaptive.png")
    if plot_path and all_runs:
        plot(all_runs, plot_path)
    return {"benchmark": name, "quick": args.quick, "tasks": tasks, "left_out": left_out,
            "seeds": args.seeds, "ranks": args.ranks, "tuning_file": str(tuning_path),
            "tuned": {t: bool(record["tasks"][t].get("tuned")) for t in tasks},
            "adaptive_flags": ADAPTIVE_FLAGS, "schedule": SCHEDULE,
            "warmup_fraction": WARMUP_FRACTION, "comparison": details,
            "reproducible": repro, "runs": all_runs, "rows": rows,
            "benchmark_wall_s": time.perf_counter() - started,
            "loadavg_end": list(os.getloadavg()),
            "plot": os.path.abspath(plot_path) if plot_path else None, "metrics_dir": tmp,
            "ratios": ratios}
