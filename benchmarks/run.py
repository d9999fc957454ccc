#!/usr/bin/env python3
"""hpcadapt's benchmark suite: ``python benchmarks/run.py NAME [--json PATH]``.

The runner starts the MPI ranks itself, collects the worker's JSON (whose top level has a
"ratios" object), prints a table and writes the JSON where asked."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent

# name -> (worker script, ranks, extra args, what it measures)
BENCHMARKS: Dict[str, dict] = {
    "allreduce": {"script": "bench_allreduce.py", "ranks": 2,
                  "about": "allreduce throughput: hpcadapt vs mpi4py vs gloo"},
    "ddp": {"script": "bench_ddp.py", "ranks": 2,
            "about": "training throughput: hpcadapt vs torch DDP (gloo)"},
}


def mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else (shutil.which("mpiexec") or "mpiexec")


def run_one(name: str, extra: List[str]) -> dict:
    spec = BENCHMARKS[name]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [mpiexec(), "-n", str(spec["ranks"]), sys.executable, str(HERE / spec["script"]),
               "--out", out] + extra
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(cmd, env=env, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"benchmark {name} failed (exit {proc.returncode}): {' '.join(cmd)}")
        with open(out, encoding="utf-8") as f:
            return json.load(f)


def print_table(result: dict) -> None:
    print(f"\n== {result['benchmark']} ==")
    rows = result.get("rows", {})
    for label, row in rows.items():
        cells = []
        for k, v in row.items():
            if isinstance(v, dict):
                cells.append(f"{k}: " + ", ".join(f"{m}={x:.4g}" for m, x in v.items()))
            else:
                cells.append(f"{k}={v}")
        print(f"  {label:>10}  " + " | ".join(cells))
    print("  ratios:")
    for k, v in result["ratios"].items():
        print(f"    {k:<45} {v:8.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=sorted(BENCHMARKS) + ["all"])
    ap.add_argument("--json", default=None, help="write the result JSON here")
    args, extra = ap.parse_known_args(argv)
    names = sorted(BENCHMARKS) if args.name == "all" else [args.name]
    results = {}
    for name in names:
        result = run_one(name, extra)
        print_table(result)
        results[name] = result
    if args.json:
        payload = results[names[0]] if len(names) == 1 else {
            "benchmarks": results,
            "ratios": {f"{n}.{k}": v for n, r in results.items() for k, v in r["ratios"].items()}}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=2, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
