"""adaptive-batch: time to accuracy on MNIST-1D (the built-in 1-D CNN, 2 ranks, same seed and
epoch budget for every run).

Runs: a small fixed batch; a large fixed batch; a grid of fixed schedules an expert would try
(linear learning-rate scaling at two batches, a step decay, a batch ramp), the best fixed run
chosen by time to target among all fixed runs; gns-batch and goodput from the small run's
start, with the linear rule the grid uses, a 50-step ramp (warm-up and momentum
compensation) and the grid's step decay (x0.1 at 3/4 of the epochs, ``--schedule-lr-scale``,
which multiplies whatever rate the rule has set). Target: 99% of the small run's final test
accuracy.

Each run is repeated ``--repeats`` times, round by round in rotating order so that the
machine's load drifts over all alike; a run's time to target and final accuracy are medians
over its repeats (fixed runs are deterministic; adaptive ones decide on measured times, so
their repeats may differ). The plot and the epochs and steps to target are the first
repeat's.

Wall time counts from the run's first step, so process start-up and data loading stay out."""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Dict, List, Optional

from common import epochs_with_time, read_jsonl, time_to_target
from launch import run_mpi

SMALL_BATCH, SMALL_LR = 32, 0.02
# Steps over which the adaptive runs' learning rate follows a batch change. With 8, two of
# three goodput runs diverged after a 32 -> 512 jump (lr x16 within 8 steps, early in training).
ADAPTIVE_RAMP = 50
# --quick: a fixed schedule (the schedule policy) and both adaptive policies, besides small
QUICK_RUNS = ("b256-decay", "gns-batch", "goodput")


def fixed(batch: int, lr: float) -> List[str]:
    return ["--batch-size", str(batch), "--lr", f"{lr:g}"]


def points(pairs) -> str:
    """``AT:VALUE`` pairs for a schedule flag; of pairs at the same point the last wins."""
    merged = dict(pairs)
    return ",".join(f"{at}:{merged[at]}" for at in sorted(merged))


def adaptive(policy: str, own: List[str], decay_epoch: int, *, interval: int = 10,
             warmup: int = 50, cooldown: int = 100) -> List[str]:
    """An adaptive run from batch 32 (32 to 512, deciding every ``interval`` steps after
    ``warmup``, ``cooldown`` apart), the policy's ``own`` flags, the monitors' EMA, the
    linear rule with its ramp, and the fixed grid's decay (x0.1 at ``decay_epoch``) applied
    to whatever rate the rule has set."""
    p = f"--{policy}-"
    return fixed(SMALL_BATCH, SMALL_LR) + [
        "--policy", policy, p + "min", str(SMALL_BATCH), p + "max", "512",
        p + "interval", str(interval), p + "warmup", str(warmup),
        p + "cooldown", str(cooldown)] + own + [
        "--policy", "schedule", "--schedule-unit", "epoch",
        "--schedule-lr-scale", f"{decay_epoch}:0.1",
        "--monitor-ema", "0.02", "--lr-rule", "linear", "--lr-ramp-steps", str(ADAPTIVE_RAMP)]


def runs(epochs: int) -> Dict[str, Dict]:
    """label -> {"kind": small|large|grid|adaptive, "flags": [...], "what": description}."""
    quarter, half, late = max(1, epochs // 4), max(1, epochs // 2), max(1, (3 * epochs) // 4)
    start = fixed(SMALL_BATCH, SMALL_LR)
    return {
        "small": {"kind": "small", "flags": start,
                  "what": f"batch {SMALL_BATCH}, lr {SMALL_LR}"},
        "large": {"kind": "large", "flags": fixed(1024, 0.11),
                  "what": "batch 1024, lr 0.11 (sqrt scaling)"},
        "b128": {"kind": "grid", "flags": fixed(128, 0.08),
                 "what": "batch 128, lr 0.08 (linear)"},
        "b256": {"kind": "grid", "flags": fixed(256, 0.16),
                 "what": "batch 256, lr 0.16 (linear)"},
        "b256-decay": {"kind": "grid",
                       "flags": fixed(256, 0.16) + [
                           "--policy", "schedule", "--schedule-unit", "epoch",
                           "--schedule-lr", f"0:0.16,{late}:0.016"],
                       "what": f"batch 256, lr 0.16, x0.1 at epoch {late}"},
        "ramp": {"kind": "grid",
                 "flags": start + [
                     "--policy", "schedule", "--schedule-unit", "epoch",
                     "--schedule-batch", points([(0, SMALL_BATCH), (quarter, 128), (half, 512)]),
                     "--lr-rule", "linear", "--lr-ramp-steps", "8"],
                 "what": f"batch 32, 128 at epoch {quarter}, 512 at epoch {half} (linear rule)"},
        # gns-batch decides on the noise scale alone, so it may look every 5 steps from step
        # 20 (the bias-corrected estimate is usable by then); goodput needs 3 timed steps of a
        # configuration before it can fit the model, and jumped 32 -> 512 -> 256 when it
        # decided at step 20 on one measured batch, so it keeps 10/50/100.
        "gns-batch": {"kind": "adaptive",
                      "flags": adaptive("gns-batch", ["--gns-batch-factor", "2"], late,
                                        interval=5, warmup=20, cooldown=30),
                      "what": f"gns-batch from batch 32 (x2 up to 512, linear rule, "
                              f"ramp {ADAPTIVE_RAMP}, x0.1 at epoch {late})"},
        "goodput": {"kind": "adaptive",
                    "flags": adaptive("goodput", ["--goodput-threshold", "0.1"], late),
                    "what": f"goodput from batch 32 (32 to 512, linear rule, "
                            f"ramp {ADAPTIVE_RAMP}, x0.1 at epoch {late})"},
    }








def _plus_one(epoch: Optional[int]) -> Optional[int]:
    return None if epoch is None else epoch + 1


def plot(metrics: Dict[str, List[dict]], specs: Dict[str, Dict], target: float, out: str) -> None:
    """Accuracy against wall time and batch size against steps, every run on both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, bat) = plt.subplots(1, 2, figsize=(14, 5.5))
    for i, (label, rows) in enumerate(metrics.items()):
        kind = specs[label]["kind"]
        style = {"adaptive": "-", "small": "-", "large": ":"}.get(kind, "--")
        width = 2.2 if kind == "adaptive" else 1.3
        colour = f"C{i % 10}"
        ep = epochs_with_time(rows)
        acc.plot([r["wall_s"] for r in ep], [r["test_accuracy"] for r in ep], style,
                 color=colour, lw=width, marker=".", label=label)
        steps = [r for r in rows if r["event"] == "step"]
        bat.step([r["step"] for r in steps], [r["batch_size"] for r in steps], style,
                 where="post", color=colour, lw=width, label=label)
    acc.axhline(target, color="grey", lw=0.8)
    acc.set(xlabel="wall time since the first step (s)", ylabel="test accuracy", xscale="log",
            title="test accuracy (each epoch) against wall time",
            ylim=(max(0.0, target - 0.3), 1.0))
    bat.set(xlabel="step", ylabel="global batch size", yscale="log", xscale="log",
            title="global batch size against steps")
    acc.legend(fontsize=8, loc="lower right")
    bat.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def run(name: str, extra: List[str]) -> dict:
    ap = argparse.ArgumentParser(prog=f"run.py {name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--samples", type=int, default=25000,
                    help="MNIST-1D samples generated (80%% train)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--only", default=None,
                    help="comma-separated labels to run (the small run is always included)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2,000 samples, 2 epochs, 1 repeat, runs "
                         f"{','.join(QUICK_RUNS)} (unless --only), the plot in the "
                         "temporary folder (unless --plot)")
    ap.add_argument("--plot", default=None,
                    help="where to draw all runs (default adaptive-batch.png)")
    ap.add_argument("--from-dir", default=None, metavar="DIR",
                    help="train nothing: analyse the metrics files a run left in DIR "
                         "(its metrics_dir), with the same --epochs, --samples and --repeats")
    args = ap.parse_args(extra)
    if args.quick:
        args.samples, args.epochs, args.repeats = 2000, 2, 1
        args.only = args.only or ",".join(QUICK_RUNS)
    specs = runs(args.epochs)
    if args.only:
        keep = {"small"} | set(args.only.split(","))
        unknown = keep - set(specs)
        if unknown:
            raise SystemExit(f"--only: unknown runs {sorted(unknown)}; choose from {sorted(specs)}")
        specs = {k: v for k, v in specs.items() if k in keep}
    tmp = args.from_dir or tempfile.mkdtemp(prefix="hpcadapt-adaptive-")
    if args.plot is None:
        args.plot = (os.path.join(tmp, "adaptive-batch.png") if args.quick
                     else "adaptive-batch.png")
    labels = list(specs)
    metrics: Dict[str, List[List[dict]]] = {k: [] for k in labels}
    started = time.perf_counter()
    for rep in range(args.repeats):
        order = labels[rep % len(labels):] + labels[:rep % len(labels)]
        for label in order:
            path = os.path.join(tmp, f"{label}-{rep}.jsonl")
            if args.from_dir:
                metrics[label].append(read_jsonl(path))
                continue
            run_mpi(args.ranks, ["-m", "hpcadapt.train", "--model", "cnn", "--dataset", "mnist1d",
                                 "--samples", str(args.samples), "--epochs", str(args.epochs),
                                 "--seed", str(args.seed), "--threads", "1", "--no-progress",
                                 "--metrics-file", path] + specs[label]["flags"])
            metrics[label].append(read_jsonl(path))
    bench_s = time.perf_counter() - started
    epochs = {k: [epochs_with_time(r) for r in v] for k, v in metrics.items()}
    # Adaptive runs decide on measured times, so their repeats may differ: medians.
    final = {k: statistics.median(r[-1]["test_accuracy"] for r in e) for k, e in epochs.items()}
    target = 0.99 * final["small"]

    def median_ttt(label: str) -> Optional[float]:
        times = [time_to_target(e, target) for e in epochs[label]]
        if any(t is None for t in times):   # missed the target in some repeat
            reached = [t for t in times if t is not None]
            return statistics.median(reached) if len(reached) * 2 > len(times) else None
        return statistics.median(times)

    ttt = {k: median_ttt(k) for k in labels}
    rows = {}
    for k in labels:
        last = epochs[k][0][-1]
        rows[k] = {"kind": specs[k]["kind"], "final_accuracy": final[k],
                   "final_accuracy_each": [e[-1]["test_accuracy"] for e in epochs[k]],
                   "best_accuracy": max(r["test_accuracy"] for r in epochs[k][0]),
                   "time_to_target_s": ttt[k],
                   "time_to_target_each_s": [time_to_target(e, target) for e in epochs[k]],
                   # Load-free measures of the same (first repeat): epochs and steps.
                   "epochs_to_target": _plus_one(time_to_target(epochs[k][0], target, "epoch")),
                   "steps_to_target": time_to_target(epochs[k][0], target, "step"),
                   "train_time_s": statistics.median(e[-1]["wall_s"] for e in epochs[k]),
                   "steps": last["step"], "final_batch": last["batch_size"],
                   "decisions": sum(1 for r in metrics[k][0] if r["event"] == "decision"
                                    and not r["policy"].startswith("lr-rule")),
                   "what": specs[k]["what"]}
    fixed_labels = [k for k in labels if specs[k]["kind"] != "adaptive"]
    adaptive_labels = [k for k in labels if specs[k]["kind"] == "adaptive"]

    def best(among: List[str]) -> Optional[str]:
        reached = [k for k in among if ttt[k] is not None]
        return min(reached, key=lambda k: ttt[k]) if reached else None

    best_fixed, best_adaptive = best(fixed_labels), best(adaptive_labels)
    if best_adaptive is None and adaptive_labels:   # none reached the target
        best_adaptive = max(adaptive_labels, key=lambda k: final[k])

    def ratio(a: Optional[str], b: Optional[str]) -> Optional[float]:
        if a is None or b is None or ttt[a] is None or ttt[b] is None:
            return None
        return ttt[a] / ttt[b]

    ratios = {
        "adaptive_time_to_target_vs_best_fixed": ratio(best_adaptive, best_fixed),
        "adaptive_final_acc_minus_small": (final[best_adaptive] - final["small"]
                                           if best_adaptive else None),
        "best_fixed_time_to_target_vs_small": ratio(best_fixed, "small"),
    }
    for k in adaptive_labels:
        key = k.replace("-", "_")
        ratios[f"{key}_time_to_target_vs_best_fixed"] = ratio(k, best_fixed)
        ratios[f"{key}_final_acc_minus_small"] = final[k] - final["small"]
    if "large" in final:
        ratios["large_final_acc_minus_small"] = final["large"] - final["small"]
    plot({k: v[0] for k, v in metrics.items()}, specs, target, args.plot)
    return {"benchmark": "adaptive-batch", "dataset": f"mnist1d ({args.samples} samples)",
            "model": "cnn", "ranks": args.ranks, "epochs": args.epochs, "seed": args.seed,
            "repeats": args.repeats, "target_accuracy": target, "best_fixed": best_fixed,
            "best_adaptive": best_adaptive, "benchmark_wall_s": bench_s, "rows": rows,
            "plot": os.path.abspath(args.plot), "metrics_dir": tmp, "ratios": ratios}
