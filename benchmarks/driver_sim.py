"""sim-scale: the policies at 8 to 1,024 workers, by simulation (``hpcadapt.policies.simulate``);
no MPI, no training, one process.

For each scale W_max (``--scales``) it replays a noise scale that rises from 100 to 10,000
over ``--budget`` small-batch-equivalent samples through three runs: gns-batch on W_max
workers and goodput (from W_max/8 workers), both fed by the job's monitor (noisy
single-step estimates, EMA 0.1 weighted by batch), and goodput fed the exact statistics
(the control: what the policy does without estimate noise). Per run: final batch and
workers, decisions, direction reversals of batch and workers (the largest over
``--seeds`` seeds), simulated time against the start configuration held fixed and against
the best fixed configuration in hindsight (powers of 2), and the wall time the policies
take per call (median and max over the calls, microseconds, on this machine).

Ratios: ``<run>_w<W>_time_vs_fixed_start`` and ``..._vs_best_fixed`` (below 1: the
adaptive run reaches the same progress in less simulated time). The simulated times are
those of the throughput model, not of a cluster (docs/development/benchmarks.md, "Scale by
simulation")."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Dict, List

RUNS = {"gns-batch": ("gns-batch", "noisy"), "goodput": ("goodput", "noisy"),
        "goodput-exact": ("goodput", "exact")}


def parse_args(name: str, extra: List[str]) -> argparse.Namespace:
    from launch import quick_defaults

    ap = argparse.ArgumentParser(prog=f"run.py {name}")
    ap.add_argument("--scales", default="8,64,1024", help="W_max values (8,64,1024)")
    ap.add_argument("--budget", type=float, default=2e6,
                    help="training to simulate, in small-batch-equivalent samples (2e6)")
    ap.add_argument("--seeds", type=int, default=3,
                    help="seeds per run; reversals are the largest over them (3)")
    ap.add_argument("--gns-window", type=float, default=65_536.0,
                    help="the monitor's window in samples for gns-batch (--monitor-window; "
                         "0: from the EMA at the first batch) (65536)")
    quick_defaults(ap, extra, budget=3e5, seeds=1)
    args = ap.parse_args(extra)
    try:
        args.scales = [int(s) for s in args.scales.split(",")]
    except ValueError:
        raise SystemExit(f"sim-scale: --scales {args.scales!r}: comma-separated integers") from None
    if any(w < 1 for w in args.scales) or args.seeds < 1 or not args.budget > 0:
        raise SystemExit("sim-scale: --scales and --seeds must be >= 1, --budget > 0")
    return args


def run(name: str, extra: List[str]) -> dict:
    from hpcadapt.policies.simulate import (NoiseTrajectory, ThroughputModel, best_fixed,
                                            draw_estimate, exact_estimate, fixed_time,
                                            run_scenario)

    args = parse_args(name, extra)
    estimators = {"noisy": draw_estimate, "exact": exact_estimate}
    trajectory, model = NoiseTrajectory.rising(args.budget), ThroughputModel()
    rows: Dict[str, dict] = {}
    ratios: Dict[str, float] = {}
    for w in args.scales:
        for label, (policy, est) in RUNS.items():
            results = [run_scenario(policy, w, budget_samples=args.budget, seed=seed,
                                    estimator=estimators[est], trajectory=trajectory,
                                    throughput=model, window=args.gns_window
                                    if policy == "gns-batch" else 0.0) for seed in range(args.seeds)]
            result, settings = results[0]
            s = result.summary()
            start = fixed_time(trajectory, model, settings["start_batch"],
                               settings["start_workers"], args.budget)
            best = best_fixed(trajectory, model, batch_min=settings["batch_min"],
                              batch_max=settings["batch_max"],
                              workers_min=settings["workers_min"], workers_max=w,
                              budget_samples=args.budget)
            times = [r.sim_time for r, _ in results]
            row = {"final_batch": s["final_batch"], "final_workers": s["final_workers"],
                   "true_bnoise_end": round(s["true_noise_scale_end"]),
                   "decisions": s["decisions"],
                   "batch_reversals": max(r.summary()["batch_reversals"] for r, _ in results),
                   "worker_reversals": max(r.summary()["worker_reversals"] for r, _ in results),
                   "sim_time_s": statistics.median(times),
                   "fixed_start_s": start, "best_fixed_s": best[0],
                   "best_fixed": f"{best[1]}x{best[2]}",
                   "decide_median_us": s["decide_median_us"], "decide_max_us": s["decide_max_us"],
                   "decide_per_step_us": s["decide_per_step_us"], "steps": s["steps"]}
            rows[f"{label} W{w}"] = row
            ratios[f"{label}_w{w}_time_vs_fixed_start"] = row["sim_time_s"] / start
            ratios[f"{label}_w{w}_time_vs_best_fixed"] = row["sim_time_s"] / best[0]
    return {"benchmark": name, "rows": rows, "ratios": ratios,
            "budget_samples": args.budget, "seeds": args.seeds, "scales": args.scales,
            "throughput_model": dataclasses.asdict(model),
            "quick": "--quick" in extra}
