"""Allreduce throughput: hpcadapt vs raw mpi4py Allreduce vs torch.distributed (gloo).

hpcadapt and mpi4py take turns call by call, each call timed alone after a barrier; gloo
follows in a phase of its own. A call's time is the slowest rank's; each contender's median
is reported. Turn-taking keeps a noisy machine's drifts from favouring one contender."""

import argparse
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import hpcadapt
from common import init_gloo, single_thread, write_result
from launch import quick_defaults

SIZES = {"4KB": 4 << 10, "1MB": 1 << 20, "16MB": 16 << 20, "64MB": 64 << 20}


def turns(calls, comm, seconds, min_rounds):
    """Time each call alone, the contenders taking turns in a rotating order."""
    comm.Barrier()
    t0 = time.perf_counter()
    for fn in calls.values():
        fn()
    per_round = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    rounds = int(max(min_rounds, min(3000, seconds / max(per_round, 1e-6))))
    names = list(calls)
    times = {k: np.empty(rounds) for k in names}
    for i in range(rounds):
        for k in names[i % len(names):] + names[:i % len(names)]:
            comm.Barrier()  # line the ranks up, so no call pays for the previous one's skew
            t0 = time.perf_counter()
            calls[k]()
            times[k][i] = time.perf_counter() - t0
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=6.0, help="budget per size, roughly")
    ap.add_argument("--min-rounds", type=int, default=15, help="calls per contender, at least")
    quick_defaults(ap, sys.argv[1:], seconds=0.5, min_rounds=5)
    args = ap.parse_args()
    single_thread()
    w = hpcadapt.init()
    raw = MPI.COMM_WORLD.Dup()
    init_gloo(raw)
    rows = {}
    for label, nbytes in SIZES.items():
        n = nbytes // 4
        # Both MPI contenders get numpy-allocated memory (hpcadapt sees it as a torch tensor,
        # as its gradient buckets are): the allocator, not the library, would differ otherwise.
        t_hpc = torch.from_numpy(np.ones(n, dtype=np.float32))
        a_raw = np.ones(n, dtype=np.float32)
        t_gloo = torch.ones(n)
        # gloo runs in its own phase: its background threads keep spinning for a while after
        # a call returns and would slow whichever MPI call came next on these small machines.
        phases = [{"hpcadapt": lambda: hpcadapt.allreduce(t_hpc),
                   "mpi4py": lambda: raw.Allreduce(MPI.IN_PLACE, a_raw)},
                  {"gloo": lambda: dist.all_reduce(t_gloo)}]
        times = {}
        for calls in phases:
            times.update(turns(calls, raw, args.seconds / 2, args.min_rounds))
        slowest = {k: np.maximum.reduce(raw.allgather(v)) for k, v in times.items()}
        rows[label] = {k: {"seconds": float(np.median(v)),
                           "GB_per_s": nbytes / float(np.median(v)) / 1e9, "calls": len(v)}
                       for k, v in slowest.items()}
    ratios = {}
    for label, row in rows.items():
        ratios[f"hpcadapt_vs_mpi4py_{label}"] = row["mpi4py"]["seconds"] / row["hpcadapt"]["seconds"]
        ratios[f"hpcadapt_vs_gloo_{label}"] = row["gloo"]["seconds"] / row["hpcadapt"]["seconds"]
    if w.rank == 0:
        write_result(args.out, {"benchmark": "allreduce", "world_size": w.size,
                                "rows": rows, "ratios": ratios})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
