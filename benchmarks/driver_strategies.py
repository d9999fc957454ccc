"""strategies: time to a target accuracy for each synchronisation strategy and the adaptive
ones, with no slow rank, with one rank's compute slowed 2x and with one rank's link slowed 2x
(4 ranks, the built-in CNN on digits).

Runs (``STRATEGY/CONDITION``): ``ssgd``, ``sma`` (alpha 0.1), ``local-sgd`` (every 8 steps),
``pair-avg`` (a random peer's model each step), ``bounded-delay`` (max delay 1, rounds of 20
batches: rank 0 aggregates, the others train), and three adaptive ones: ``sync-switch`` (sma
for the first third of the steps, then ssgd, by the sync-switch policy's schedule),
``straggler`` (the straggler policy removes a rank whose compute stays above 1.3x the
others' median for 5 checks; the job has an allocator, ``--max-workers``, so it may resize)
and ``straggler-async`` (switches to bounded delay after 5 checks with a rank above 1.3x,
back after 5 rounds without one). Conditions: ``none``; ``compute`` (``--slow-rank`` the
last rank, its forward and backward take about twice as long); ``comm`` (its exchange takes
twice as long, ``--slow-comm 2``).

The compute slow-down is ``--slow-compute 2``: the slowed rank sleeps as long as its own
compute before each forward (the runtime leaves the sleep out of the compute it scales, so
the factor stays put). Each run's measured factor (the slowed rank's
median compute time over the others' median, steps at full size) is in its row.

Target: ``--target-share`` (0.98) of S-SGD's final test accuracy without a slow rank. Every
run is repeated ``--repeats`` times, round by round in rotating order, and its time to target
and final accuracy are medians over the repeats. Wall time counts from the run's first step,
so process start-up and data loading stay out.

A run whose ranks have not all ended ``GRACE_S`` seconds after rank 0 wrote its summary is
stopped (its process group) and marked ``stopped_after_summary``: before a03f567 a rank
removed by the straggler policy stayed blocked in the policies' state broadcast after leaving
(the training itself had finished). Since then such a launch ends with mpiexec's exit 9 (a
rank killed) after the summary; the ending is recorded per run."""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from common import epochs_with_time, read_jsonl, time_to_target
from launch import ROOT, env, mpiexec

STRATEGIES = ("ssgd", "sma", "local-sgd", "pair-avg", "bounded-delay", "sync-switch",
              "straggler", "straggler-async")
ADAPTIVE = ("sync-switch", "straggler", "straggler-async")
CONDITIONS = ("none", "compute", "comm")
GRACE_S = 10.0   # after rank 0's summary, for the ranks to end on their own


def strategy_flags(name: str, total_steps: int) -> List[str]:
    if name == "ssgd":
        return ["--strategy", "ssgd"]
    if name == "sma":
        return ["--strategy", "sma", "--sma-alpha", "0.1"]
    if name == "local-sgd":
        return ["--strategy", "local-sgd", "--local-sgd-period", "8"]
    if name == "sync-switch":
        return ["--strategy", "sma", "--sma-alpha", "0.1", "--policy", "sync-switch",
                "--sync-switch-steps", f"{max(1, total_steps // 3)}:ssgd"]
    if name == "straggler":
        return ["--max-workers", "{ranks}", "--policy", "straggler", "--straggler-action",
                "remove", "--straggler-factor", "1.3", "--straggler-patience", "5"]
    if name == "pair-avg":
        return ["--strategy", "pair-avg"]
    if name == "bounded-delay":
        return ["--strategy", "bounded-delay", "--max-delay", "1", "--async-round-steps", "20"]
    if name == "straggler-async":
        return ["--policy", "straggler-async", "--straggler-async-factor", "1.3",
                "--straggler-async-patience", "5", "--straggler-async-max-delay", "1",
                "--straggler-async-round-steps", "20"]
    raise ValueError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")


def condition_flags(name: str, slow_rank: int, compute_flag: float, comm_flag: float) -> List[str]:
    if name == "none":
        return []
    if name == "compute":
        return ["--slow-rank", str(slow_rank), "--slow-compute", f"{compute_flag:g}"]
    if name == "comm":
        return ["--slow-rank", str(slow_rank), "--slow-comm", f"{comm_flag:g}"]
    raise ValueError(f"unknown condition {name!r}; choose from {', '.join(CONDITIONS)}")








def measured_compute_factor(rows: List[dict], slow_rank: int, ranks: int) -> Optional[float]:
    """The slowed rank's median compute time over the median of the others' (full size)."""
    mine, others = [], []
    for r in rows:
        if r["event"] != "step" or r["world_size"] != ranks:
            continue
        times = r.get("monitors", {}).get("rank_compute_time") or []
        if len(times) != ranks or not any(times):
            continue
        mine.append(times[slow_rank])
        others.extend(t for i, t in enumerate(times) if i != slow_rank)
    if not mine or not others or statistics.median(others) <= 0:
        return None
    return statistics.median(mine) / statistics.median(others)


def launch(ranks: int, args: List[str], summary: str, log: str, *, timeout: float) -> Dict:
    """One ``mpiexec`` in a session of its own, its output to ``log``; stopped GRACE_S after
    rank 0's summary, or at ``timeout``. Returns how it ended."""
    cmd = [mpiexec(), "-n", str(ranks), sys.executable] + args
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, env=env(), cwd=ROOT, start_new_session=True,
                                stdout=out, stderr=subprocess.STDOUT)
    seen: Optional[float] = None
    ended = "exit"
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if seen is None and os.path.exists(summary):
                seen = now
            if (seen is not None and now - seen > GRACE_S) or now - started > timeout:
                ended = "stopped_after_summary" if seen is not None else "timeout"
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                break
            time.sleep(0.2)
    except BaseException:  # Ctrl-C or SIGTERM to the runner: the launch's session goes too
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if ended == "exit" and proc.returncode != 0:
        ended = f"exit {proc.returncode}"
    return {"ended": ended, "launch_s": time.monotonic() - started,
            "summary": os.path.exists(summary)}


def _bounded_delay(stem: str) -> Optional[dict]:
    """The first repeat's bounded-delay totals from its summary (updates applied and
    dropped, the delay histograms), None when it ran no round."""
    import json

    try:
        with open(stem + ".summary.json", encoding="utf-8") as f:
            return json.load(f).get("bounded_delay")
    except (OSError, ValueError):
        return None


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_runs(rows: Dict[str, dict], target: float) -> None:
    print(f"\ntarget accuracy {target:.4f}")
    print(f"{'run':<22} {'time to target (s)':>18} {'final acc.':>10} {'steps':>6} "
          f"{'to target':>9} {'train (s)':>9} {'slow x':>6}  notes")
    for k, r in rows.items():
        bd = r.get("bounded_delay")
        dropped = ([f"{bd['dropped_updates']} of {bd['applied_updates'] + bd['dropped_updates']}"
                    f" updates dropped"] if bd else [])
        notes = ", ".join(r["resizes"] + r["strategy_switches"] + dropped
                          + [e for e in r["ended"] if e != "exit"])
        print(f"{k:<22} {_fmt(r['time_to_target_s']):>18} {_fmt(r['final_accuracy'], '.3f'):>10} "
              f"{_fmt(r['steps'], 'd'):>6} {_fmt(r['steps_to_target'], 'd'):>9} "
              f"{_fmt(r['train_time_s']):>9} {_fmt(r['slow_rank_compute_vs_others']):>6}  {notes}")


def run(name: str, extra: List[str]) -> dict:
    ap = argparse.ArgumentParser(prog=f"run.py {name}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64, help="global batch")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each configuration")
    ap.add_argument("--strategies", default=",".join(STRATEGIES),
                    help="comma-separated, from " + ", ".join(STRATEGIES))
    ap.add_argument("--conditions", default=",".join(CONDITIONS),
                    help="comma-separated, from " + ", ".join(CONDITIONS)
                         + " (ssgd/none always runs: it sets the target)")
    ap.add_argument("--slow-compute-flag", type=float, default=2.0,
                    help="--slow-compute passed to the slowed rank (2: twice as long)")
    ap.add_argument("--slow-comm-flag", type=float, default=2.0)
    ap.add_argument("--target-share", type=float, default=0.98,
                    help="target: this share of ssgd/none's final accuracy")
    ap.add_argument("--run-timeout", type=float, default=300.0, help="seconds per launch")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 ranks, 2 epochs, 1 repeat, ssgd/none and every "
                         "strategy with the compute slow-down")
    args = ap.parse_args(extra)
    strategies = [s for s in args.strategies.split(",") if s]
    conditions = [c for c in args.conditions.split(",") if c]
    if args.quick:
        args.ranks, args.epochs, args.repeats = 2, 2, 1
        conditions = ["compute"]
    for s in strategies:
        strategy_flags(s, 1)
    for c in conditions:
        condition_flags(c, 0, 1.0, 1.0)
    slow_rank = args.ranks - 1
    steps_per_epoch = -(-1438 // args.batch_size)   # digits: 1,438 training samples
    total_steps = steps_per_epoch * args.epochs
    labels = ["ssgd/none"] + [f"{s}/{c}" for s in strategies for c in conditions
                              if f"{s}/{c}" != "ssgd/none"]
    tmp = tempfile.mkdtemp(prefix="hpcadapt-strategies-")
    metrics: Dict[str, List[List[dict]]] = {k: [] for k in labels}
    endings: Dict[str, List[Dict]] = {k: [] for k in labels}
    stem_of: Dict[str, str] = {}   # the first repeat's files
    started = time.perf_counter()
    for rep in range(args.repeats):
        order = labels[rep % len(labels):] + labels[:rep % len(labels)]
        for label in order:
            strategy, condition = label.split("/")
            stem = os.path.join(tmp, f"{strategy}-{condition}-{rep}")
            flags = [f.format(ranks=args.ranks) for f in strategy_flags(strategy, total_steps)]
            flags += condition_flags(condition, slow_rank, args.slow_compute_flag,
                                     args.slow_comm_flag)
            print(f"-- {label} (repeat {rep + 1}/{args.repeats})", flush=True)
            ending = launch(args.ranks, [
                "-m", "hpcadapt.train", "--model", "cnn", "--dataset", "digits",
                "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
                "--lr", f"{args.lr:g}", "--seed", str(args.seed), "--threads", "1",
                "--no-progress", "--metrics-file", stem + ".jsonl",
                "--summary-json", stem + ".summary.json"] + flags,
                stem + ".summary.json", stem + ".log", timeout=args.run_timeout)
            if ending["ended"] != "exit":
                print(f"   {ending['ended']} after {ending['launch_s']:.0f} s "
                      f"(output: {stem}.log)", flush=True)
            metrics[label].append(read_jsonl(stem + ".jsonl"))
            stem_of.setdefault(label, stem)
            endings[label].append(ending)
    bench_s = time.perf_counter() - started

    epochs = {k: [epochs_with_time(r) for r in v] for k, v in metrics.items()}
    final = {k: (statistics.median(e[-1]["test_accuracy"] for e in v if e)
                 if any(v) else None) for k, v in epochs.items()}
    if final["ssgd/none"] is None:
        raise SystemExit("ssgd/none trained no epoch: no target; see the runs' output above")
    target = args.target_share * final["ssgd/none"]

    def median_ttt(label: str) -> Optional[float]:
        times = [time_to_target(e, target) for e in epochs[label]]
        reached = [t for t in times if t is not None]
        return statistics.median(reached) if len(reached) * 2 > len(times) else None

    ttt = {k: median_ttt(k) for k in labels}
    rows = {}
    for k in labels:
        strategy, condition = k.split("/")
        first = metrics[k][0]
        ep = epochs[k][0]
        resizes = [r for r in first if r["event"] == "resize" and r.get("ok")]
        rows[k] = {
            "strategy": strategy, "condition": condition,
            "kind": "adaptive" if strategy in ADAPTIVE else "static",
            "time_to_target_s": ttt[k],
            "time_to_target_each_s": [time_to_target(e, target) for e in epochs[k]],
            "final_accuracy": final[k],
            "final_accuracy_each": [e[-1]["test_accuracy"] if e else None for e in epochs[k]],
            "best_accuracy": max((r["test_accuracy"] for r in ep), default=None),
            "epochs_to_target": (None if time_to_target(ep, target, "epoch") is None
                                 else time_to_target(ep, target, "epoch") + 1),
            "steps_to_target": time_to_target(ep, target, "step"),
            "steps": ep[-1]["step"] if ep else None,
            "train_time_s": (statistics.median(e[-1]["wall_s"] for e in epochs[k] if e)
                             if any(epochs[k]) else None),
            "final_world_size": ep[-1]["world_size"] if ep else None,
            "resizes": [f"{r['old_size']}->{r['new_size']} at step {r['step']}" for r in resizes],
            "strategy_switches": [f"{r['to']['name']} at step {r['step']}" for r in first
                                  if r["event"] == "strategy"],
            "slow_rank_compute_vs_others": (measured_compute_factor(first, slow_rank, args.ranks)
                                            if condition != "none" else None),
            "ended": [e["ended"] for e in endings[k]],
            "bounded_delay": _bounded_delay(stem_of[k]),
        }

    def ratio(a: str, b: str) -> Optional[float]:
        if a not in ttt or b not in ttt or ttt[a] is None or ttt[b] is None:
            return None
        return ttt[a] / ttt[b]

    ratios: Dict[str, Optional[float]] = {}
    best_adaptive: Dict[str, Optional[str]] = {}
    for c in conditions:
        reached = [f"{s}/{c}" for s in strategies if s in ADAPTIVE and ttt.get(f"{s}/{c}")]
        best = min(reached, key=lambda k: ttt[k]) if reached else None
        best_adaptive[c] = best
        suffix = {"none": "", "compute": "_straggler", "comm": "_slow_link"}[c]
        ratios[f"best_adaptive_vs_ssgd_time_to_target{suffix}"] = (
            ratio(best, f"ssgd/{c}") if best else None)
        for s in strategies:
            if s != "ssgd":
                ratios[f"{s.replace('-', '_')}_vs_ssgd_time_to_target{suffix}"] = ratio(
                    f"{s}/{c}", f"ssgd/{c}")
        if c != "none":
            ratios[f"ssgd{suffix}_vs_ssgd_time_to_target"] = ratio(f"ssgd/{c}", "ssgd/none")
    print_runs(rows, target)
    return {"benchmark": "strategies", "dataset": "digits (1438 train, 359 test)",
            "model": "cnn", "ranks": args.ranks, "slow_rank": slow_rank,
            "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
            "seed": args.seed, "repeats": args.repeats,
            "slow_compute_flag": args.slow_compute_flag, "slow_comm_flag": args.slow_comm_flag,
            "target_share": args.target_share, "target_accuracy": target,
            "best_adaptive": best_adaptive, "benchmark_wall_s": bench_s, "rows": rows,
            "metrics_dir": tmp, "ratios": ratios}
