"""Pair averaging's exchange against an allreduce of the same bytes (2 ranks or more).

A model of ``--params`` float32 parameters (25.7M, ResNet-50's count, by default). Rank 0
fetches rank 1's published model ``--repeats`` times while rank 1 computes in pure Python
(no MPI call: the fetch gets no help from it); then every rank publishes (the per-step
copy into the window) and all allreduce the same bytes (MPI's own Allreduce, SUM). Medians
printed, nothing asserted. Run: ``mpiexec -n 2 python benchmarks/bench_pairavg.py``."""

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np
import torch
from mpi4py import MPI

import hpcadapt
from hpcadapt.parallel.pairavg import PairExchange


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=25_700_000)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    w = hpcadapt.init()
    comm = w.comm
    model = [torch.full((args.params,), float(w.rank))]
    pairs = PairExchange(w, model)
    pairs.publish(model)
    folder = tempfile.mkdtemp(prefix="hpcadapt-pairavg-") if w.rank == 0 else None
    try:
        measure(args, w, comm, model, pairs, os.path.join(comm.bcast(folder), "done"))
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def measure(args, w, comm, model, pairs, flag: str) -> None:
    """Fetch from a busy peer, publish, allreduce; rank 0 prints the medians."""
    comm.Barrier()
    fetch = []
    if w.rank == 0:
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            pairs.start_fetch(1)
            theirs = pairs.finish_fetch()
            fetch.append(time.perf_counter() - t0)
        assert bool((theirs[0].view(torch.float32)[::4096] == 1.0).all())
        with open(flag, "w") as f:
            f.write("done")
    elif w.rank == 1:
        spins = 0
        while not os.path.exists(flag):  # busy, and no MPI call
            spins += 1
    comm.Barrier()
    publish = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        pairs.publish(model)
        publish.append(time.perf_counter() - t0)
    flat = model[0].numpy()
    out = np.empty_like(flat)
    allreduce = []
    for _ in range(args.repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(flat, out, op=MPI.SUM)
        allreduce.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    pairs.free()
    if w.rank == 0:
        print(json.dumps({"params": args.params, "bytes": flat.nbytes, "ranks": w.size,
                          "fetch_from_busy_peer_s": float(np.median(fetch)),
                          "publish_s": float(np.median(publish)),
                          "allreduce_s": float(np.median(allreduce))}))


if __name__ == "__main__":
    main()
