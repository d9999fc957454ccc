"""user-api: training throughput of a user's own script on the public API
(``benchmarks/user_api_train.py``: its own loop with ``hpcadapt.Job``) against the built-in
entry point (``hpcadapt.train.main``, what ``python -m hpcadapt.train`` runs) on the same model
and data (the MLP 64-256-256-10 on digits, SGD with momentum), 2 ranks.

By default both run as whole jobs, alternately, in one launch of the ranks
(``bench_user_api.py``; the order flips every repetition, the first pair is warm-up), so
process start-up stays out and the two runs of a pair are a second apart. ``--separate``
launches every run on its own (``mpiexec -n 2 python -m hpcadapt.train ...`` and ``mpiexec -n 2
python benchmarks/user_api_train.py ...``), as a user starts them, still alternating.
Throughput is the training loop's: the samples of all epochs over the epochs' time, from
each run's metrics file. The ratio is the median over repetitions of the pair's ratio (a
pair saw about the same load from other work on the machine); the JSON adds a bootstrap 95%
interval of that median and the ratio of the medians. The final model digests must all be
equal: both did the same computation."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from launch import HERE, ROOT, env, mpiexec, quick_defaults, run_worker

def read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def loop_throughput(rows):
    """Samples of all epochs over the epochs' time (each epoch's loop and evaluation)."""
    epochs = [r for r in rows if r["event"] == "epoch"]
    seconds = sum(r["epoch_time_s"] for r in epochs)
    return sum(r["samples_per_s"] * r["epoch_time_s"] for r in epochs) / seconds


def run_record(metrics: str, summary: str, wall: float) -> dict:
    """One measured run: throughput, wall time, final weights' digest and accuracy."""
    rows = read(metrics)
    with open(summary, encoding="utf-8") as f:
        digest = json.load(f)["model_digest"]
    return {"samples_per_s": loop_throughput(rows), "wall_s": wall, "digest": digest,
            "final_accuracy": [r for r in rows if r["event"] == "epoch"][-1]["test_accuracy"]}


SEPARATE = {
    "builtin": ["-m", "hpcadapt.train", "--model", "mlp", "--dataset", "digits"],
    "user_api": [str(HERE / "user_api_train.py")],
}


def separate_runs(args):
    """Each run its own mpiexec launch; the order flips every repetition."""
    runs = {k: [] for k in SEPARATE}
    with tempfile.TemporaryDirectory(prefix="hpcadapt-user-api-") as tmp:
        for rep in range(args.reps):
            for kind in (list(SEPARATE) if rep % 2 == 0 else list(reversed(SEPARATE))):
                metrics = os.path.join(tmp, f"{kind}-{rep}.jsonl")
                summary = os.path.join(tmp, f"{kind}-{rep}.json")
                cmd = [mpiexec(), "-n", str(args.ranks), sys.executable] + SEPARATE[kind] + [
                    "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
                    "--lr", "0.05", "--momentum", "0.9", "--seed", "0",
                    "--threads", str(args.threads), "--no-progress",
                    "--metrics-file", metrics, "--summary-json", summary]
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, env=env(), cwd=ROOT, capture_output=True, text=True,
                                      timeout=1800)
                wall = time.perf_counter() - t0
                if proc.returncode != 0:
                    raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                                     f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
                runs[kind].append(run_record(metrics, summary, wall))
    return runs


def median_ci(values, level=0.95, resamples=2000):
    """Bootstrap interval of the median (fixed seed: the same data give the same interval)."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values)))
                  for _ in range(resamples))
    cut = int(resamples * (1 - level) / 2)
    return [meds[cut], meds[-cut - 1]]


def run(name, extra):
    ap = argparse.ArgumentParser(prog=f"run.py {name}")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--reps", type=int, default=40, help="pairs of runs measured")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--separate", action="store_true",
                    help="launch every run on its own (mpiexec per run) instead of in one launch")
    quick_defaults(ap, extra, epochs=1, reps=3)
    args = ap.parse_args(extra)
    load_before = os.getloadavg()[0]
    if args.separate:
        runs = separate_runs(args)
    else:
        os.environ.setdefault("HPCADAPT_LOG_LEVEL", "WARNING")  # 2 x reps jobs' epoch lines
        runs = run_worker("bench_user_api.py", args.ranks,
                          ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
                           "--reps", str(args.reps), "--threads", str(args.threads)])["runs"]
    med = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in runs.items()}
    pairs = [u["samples_per_s"] / b["samples_per_s"]
             for u, b in zip(runs["user_api"], runs["builtin"])]
    digests = {r["digest"] for v in runs.values() for r in v}
    rows = {k: {"median_samples_per_s": med[k],
                "min_samples_per_s": min(r["samples_per_s"] for r in v),
                "max_samples_per_s": max(r["samples_per_s"] for r in v),
                "median_job_s": statistics.median(r["wall_s"] for r in v),
                "final_accuracy": v[-1]["final_accuracy"]}
            for k, v in runs.items()}
    return {"benchmark": "user-api", "ranks": args.ranks, "epochs": args.epochs,
            "reps": args.reps, "launch": "separate" if args.separate else "one",
            "workload": "MLP 64-256-256-10 on digits, SGD momentum 0.9, global batch "
                        f"{args.batch_size}, {args.threads} torch thread(s) per rank",
            "same_model_digest": len(digests) == 1,
            "load_average_before_after": [load_before, os.getloadavg()[0]],
            "rows": rows,
            "runs": {k: [round(r["samples_per_s"], 1) for r in v] for k, v in runs.items()},
            "pair_ratios": [round(x, 4) for x in pairs],
            "pair_ratio_median_ci95": [round(x, 4) for x in median_ci(pairs)],
            "ratio_of_medians": med["user_api"] / med["builtin"],
            "ratios": {"user_api_vs_builtin_throughput": statistics.median(pairs)}}
