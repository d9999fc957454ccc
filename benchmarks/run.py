#!/usr/bin/env python3
"""hpcadapt's benchmark suite: ``python benchmarks/run.py NAME [--json PATH] [options]``.

Each benchmark is a driver (``driver_<name>.py`` with ``run(argv) -> dict``) that starts
its own MPI ranks; its result's top level has a "ratios" object. The runner prints a table
and writes the JSON where asked. ``--quick`` runs each benchmark's quick mode (the same
code, smaller sizes, fewer steps and repeats); ``all`` goes on after a benchmark fails and
exits 1 at the end. Everything the run writes to the temporary directory (its ranks' files
too, through TMPDIR) lands in one folder, removed at the end, after a failure and on
Ctrl-C or SIGTERM (``--keep-tmp`` keeps it)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from launch import Skipped, TempSession  # noqa: E402  (benchmarks/ is on the path now)

BENCHMARKS = {
    "allreduce": ("driver_simple", "allreduce throughput: hpcadapt vs mpi4py vs gloo"),
    "ddp": ("driver_simple", "training throughput: hpcadapt vs torch DDP (gloo)"),
    "monitor-overhead": ("driver_simple", "throughput with gradient monitors on vs off"),
    "step-overhead": ("driver_simple", "what the data plane adds to a step on 202 small "
                                       "parameters: aten ops and host transfers counted, "
                                       "step times, vs torch DDP (gloo)"),
    "adaptive": ("driver_adaptive", "steps to target val losses and final loss, MNIST-1D CNN "
                                    "and a char-level LM: growth instead of decay (and gns-batch) "
                                    "vs tuned fixed batches, a doubling ramp and Seesaw, paired "
                                    "over seeds; resumable"),
    "resize": ("driver_resize", "pause of grow/shrink vs a torchrun restart"),
    "failure": ("driver_failure", "a killed worker: detection and recovery vs a torchrun restart"),
    "user-api": ("driver_user_api", "training throughput: a user's own script on the public "
                                    "API vs the built-in entry point"),
    "slurm-resize": ("driver_slurm", "Slurm test cluster: decision to new nodes training, "
                                     "and to released nodes idle; vs resubmitting"),
    "topology": ("driver_topology", "allreduce topologies side by side: flat, hierarchical, "
                                    "ring, tree on 4 ranks in 2 emulated nodes"),
    "strategies": ("driver_strategies", "time to accuracy on 4 ranks: ssgd, sma, local-sgd, "
                                        "sync-switch, straggler removal; a rank slowed 2x"),
    "gpu": ("driver_gpu", "one GPU: hpcadapt vs DDP over NCCL, monitoring overhead, NCCL vs "
                          "host-staged allreduce bandwidth"),
    "sim-scale": ("driver_sim", "policies at 8 to 1,024 workers by simulation: decisions, "
                                "reversals, decision time, simulated time vs fixed runs"),
}


def print_table(result: dict) -> None:
    print(f"\n== {result['benchmark']} ==")
    for label, row in result.get("rows", {}).items():
        cells = []
        for k, v in row.items():
            if isinstance(v, dict):
                cells.append(f"{k}: " + ", ".join(
                    f"{m}={x:.4g}" if isinstance(x, (int, float)) else f"{m}={x}"
                    for m, x in v.items()))
            else:
                cells.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
        print(f"  {label:>12}  " + " | ".join(cells))
    print("  ratios:")
    for k, v in result["ratios"].items():
        print(f"    {k:<45} {v:10.4f}" if v is not None else f"    {k:<45}        n/a")


def run_one(name: str, extra: List[str], *, go_on: bool) -> Tuple[str, dict, float]:
    """(status, result, seconds): ``ok`` and the driver's result; with ``go_on`` (``all``),
    ``skipped`` or ``failed`` and a result that says why (no ratios); without, a failure
    ends the runner as the driver ends it (one line, exit 1)."""
    started = time.perf_counter()
    try:
        driver = importlib.import_module(BENCHMARKS[name][0])
        result = driver.run(name, extra)
        status = "ok"
    except Skipped as e:
        if not go_on:
            raise SystemExit(f"{name}: skipped: {e}") from None
        status, result = "skipped", {"benchmark": name, "skipped": str(e), "ratios": {}}
    except (Exception, SystemExit) as e:  # a driver fails with SystemExit(message)
        if not go_on:
            raise
        if not isinstance(e, SystemExit):
            traceback.print_exc()
        status, result = "failed", {"benchmark": name, "failed": str(e) or repr(e),
                                    "ratios": {}}
    return status, result, time.perf_counter() - started


def choose(name: str, quick: bool) -> Tuple[List[str], Dict[str, str]]:
    """The benchmarks to run and those left out (name -> why)."""
    if name != "all":
        return [name], {}
    names, left_out = list(BENCHMARKS), {}
    if not quick:   # --quick runs the gpu benchmark's CPU fallback where no GPU is usable
        from hpcadapt.cuda.device import gpu_problems

        missing = gpu_problems()
        if missing:
            print(f"gpu benchmark left out of 'all': {'; '.join(missing)}", flush=True)
            names.remove("gpu")
            left_out["gpu"] = "; ".join(missing)
    return names, left_out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="benchmarks: " + "; ".join(
                                     f"{k}: {v[1]}" for k, v in BENCHMARKS.items()))
    ap.add_argument("name", choices=sorted(BENCHMARKS) + ["all"])
    ap.add_argument("--json", default=None, help="write the result JSON here")
    ap.add_argument("--quick", action="store_true",
                    help="every benchmark's quick mode: the same code, smaller sizes, fewer "
                         "steps and repeats (seconds to a minute each; CI runs 'all --quick')")
    ap.add_argument("--keep-tmp", action="store_true",
                    help="keep the temporary folder of the run (metrics files, logs); "
                         "removed by default")
    args, extra = ap.parse_known_args(argv)
    if args.quick:
        extra = extra + ["--quick"]
    names, left_out = choose(args.name, args.quick)
    results, seconds, status = {}, {}, {}
    session = TempSession(keep=args.keep_tmp)
    try:
        for name in names:
            status[name], results[name], seconds[name] = run_one(
                name, extra, go_on=args.name == "all")
            if status[name] == "ok":
                print_table(results[name])
            if args.name == "all":
                print(f"  {name}: {status[name]} in {seconds[name]:.1f} s"
                      + "".join(f" ({results[name][k]})" for k in ("skipped", "failed")
                                if k in results[name]), flush=True)
    finally:
        session.close()
    for name, why in left_out.items():
        status[name], results[name] = "skipped", {"benchmark": name, "skipped": why, "ratios": {}}
    if args.name == "all":
        print("\n" + ", ".join(f"{n} {status[n]}" + (f" {seconds[n]:.0f} s" if n in seconds
                                                        else "") for n in status)
              + f"; total {sum(seconds.values()):.0f} s", flush=True)
    if args.json:
        payload = results[names[0]] if args.name != "all" else {
            "benchmarks": results, "quick": args.quick, "status": status, "seconds": seconds,
            "ratios": {f"{n}.{k}": v for n, r in results.items() for k, v in r["ratios"].items()}}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
    failed = [n for n in names if status[n] == "failed"]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
