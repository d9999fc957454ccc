"""adaptive-batch: time to accuracy on digits for a fixed small batch, a fixed large batch
and gns-batch (with the sqrt learning-rate rule and its ramp), 2 ranks, same seed and epoch
budget. Target: 99% of the small-batch run's final test accuracy."""

import argparse
import json
import os
import tempfile

from launch import run_mpi

RUNS = {
    "small": ["--batch-size", "16", "--lr", "0.02"],
    "large": ["--batch-size", "256", "--lr", "0.32"],  # linear scaling of the small run's lr
    "adaptive": ["--batch-size", "16", "--lr", "0.02", "--policy", "gns-batch",
                 "--gns-batch-max", "128", "--gns-batch-factor", "1.5",
                 "--gns-batch-interval", "5", "--gns-batch-warmup", "10",
                 "--gns-batch-cooldown", "20", "--lr-rule", "sqrt", "--lr-ramp-steps", "8"],
}


def read(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def run(name, extra):
    ap = argparse.ArgumentParser(prog=f"run.py {name}")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--plot", default="adaptive-batch.png", help="where to draw the three runs")
    args = ap.parse_args(extra)
    tmp = tempfile.mkdtemp(prefix="hpcadapt-adaptive-")
    metrics = {}
    for label, flags in RUNS.items():
        path = os.path.join(tmp, f"{label}.jsonl")
        run_mpi(2, ["-m", "hpcadapt.train", "--model", args.model, "--dataset", "digits",
                    "--epochs", str(args.epochs), "--seed", str(args.seed), "--no-progress",
                    "--metrics-file", path] + flags)
        metrics[label] = read(path)
    epochs = {k: [r for r in v if r["event"] == "epoch"] for k, v in metrics.items()}
    final = {k: e[-1]["test_accuracy"] for k, e in epochs.items()}
    target = 0.99 * final["small"]

    def time_to_target(rows):
        for r in rows:
            if r["test_accuracy"] >= target:
                return r["time_s"]
        return float("inf")

    ttt = {k: time_to_target(e) for k, e in epochs.items()}

    def ratio(a, b):
        return a / b if a != float("inf") else None  # None: never reached the target
    rows = {k: {"final_accuracy": final[k],
                "time_to_target_s": ttt[k] if ttt[k] != float("inf") else None,
                "train_time_s": epochs[k][-1]["time_s"],
                "steps": epochs[k][-1]["step"], "final_batch": epochs[k][-1]["batch_size"],
                "decisions": sum(1 for r in metrics[k] if r["event"] == "decision")}
            for k in RUNS}
    from hpcadapt.plot import plot_runs

    plot_runs(metrics, args.plot)
    return {"benchmark": "adaptive-batch", "target_accuracy": target, "epochs": args.epochs,
            "rows": rows, "plot": os.path.abspath(args.plot), "metrics_dir": tmp,
            "ratios": {
                "adaptive_time_to_target_vs_small": ratio(ttt["adaptive"], ttt["small"]),
                "adaptive_final_acc_minus_small": final["adaptive"] - final["small"],
                "large_final_acc_minus_small": final["large"] - final["small"],
                "large_time_to_target_vs_small": ratio(ttt["large"], ttt["small"]),
            }}
