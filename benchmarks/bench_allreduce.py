"""Allreduce throughput: hpcadapt vs raw mpi4py Allreduce vs torch.distributed (gloo)."""

import argparse

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import hpcadapt
from common import init_gloo, interleaved, median, single_thread, timed, write_result

SIZES = {"4KB": 4 << 10, "1MB": 1 << 20, "16MB": 16 << 20, "64MB": 64 << 20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    single_thread()
    w = hpcadapt.init()
    raw = MPI.COMM_WORLD.Dup()
    init_gloo(raw)
    rows = {}
    for label, nbytes in SIZES.items():
        n = nbytes // 4
        iters = max(3, min(2000, (256 << 20) // nbytes // 4))
        # Both MPI contenders get numpy-allocated memory (hpcadapt sees it as a torch tensor,
        # as its gradient buckets are): the allocator, not the library, would differ otherwise.
        t_hpc = torch.from_numpy(np.ones(n, dtype=np.float32))
        a_raw = np.ones(n, dtype=np.float32)
        t_gloo = torch.ones(n)
        contenders = {
            "hpcadapt": lambda: timed(lambda: hpcadapt.allreduce(t_hpc), iters, raw),
            "mpi4py": lambda: timed(lambda: raw.Allreduce(MPI.IN_PLACE, a_raw), iters, raw),
            "gloo": lambda: timed(lambda: dist.all_reduce(t_gloo), iters, raw),
        }
        for fn in contenders.values():  # warm-up
            fn()
        times = interleaved(contenders, args.rounds)
        rows[label] = {k: {"seconds": median(v), "GB_per_s": nbytes / median(v) / 1e9}
                       for k, v in times.items()}
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
