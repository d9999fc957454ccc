#!/usr/bin/env python3
"""hpcadapt's benchmark suite: ``python benchmarks/run.py NAME [--json PATH] [options]``.

Each benchmark is a driver (``driver_<name>.py`` with ``run(argv) -> dict``) that starts
its own MPI ranks; its result's top level has a "ratios" object. The runner prints a table
and writes the JSON where asked."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

BENCHMARKS = {
    "allreduce": ("driver_simple", "allreduce throughput: hpcadapt vs mpi4py vs gloo"),
    "ddp": ("driver_simple", "training throughput: hpcadapt vs torch DDP (gloo)"),
    "monitor-overhead": ("driver_simple", "throughput with gradient monitors on vs off"),
    "adaptive-batch": ("driver_adaptive", "time to accuracy on MNIST-1D: fixed batches and "
                                          "schedules vs gns-batch and goodput"),
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="benchmarks: " + "; ".join(
                                     f"{k}: {v[1]}" for k, v in BENCHMARKS.items()))
    ap.add_argument("name", choices=sorted(BENCHMARKS) + ["all"])
    ap.add_argument("--json", default=None, help="write the result JSON here")
    args, extra = ap.parse_known_args(argv)
    names = list(BENCHMARKS) if args.name == "all" else [args.name]
    if args.name == "all":
        from hpcadapt.cuda.device import gpu_problems

        missing = gpu_problems()
        if missing:
            print(f"gpu benchmark left out of 'all': {'; '.join(missing)}", flush=True)
            names.remove("gpu")
    results = {}
    for name in names:
        driver = importlib.import_module(BENCHMARKS[name][0])
        result = driver.run(name, extra)
        print_table(result)
        results[name] = result
        sys.stdout.flush()
    if args.json:
        payload = results[names[0]] if len(names) == 1 else {
            "benchmarks": results,
            "ratios": {f"{n}.{k}": v for n, r in results.items() for k, v in r["ratios"].items()}}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
