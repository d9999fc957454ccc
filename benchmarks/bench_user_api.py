"""Worker of the user-api benchmark (run by ``driver_user_api.py`` under mpiexec): in one
launch of N ranks, the built-in entry point (``hpcadapt.train.main(argv)``, what
``python -m hpcadapt.train`` and ``hpcadapt-train`` call) and the user's script
(``user_api_train.main(argv)``) train the same model on the same data, one after the other,
the order flipping every repetition. Each is a whole job (``hpcadapt.Job`` to ``finish``);
running both in one process keeps process start-up and imports out of the comparison and
puts the two runs of a pair a second apart, so that they see the same load from other work
on a shared machine. Rank 0 writes the runs' throughputs to ``--out``."""

import argparse
import gc
import json
import os
import sys
import tempfile
import time

from mpi4py import MPI

import user_api_train
from driver_user_api import run_record
from hpcadapt import train as builtin_train


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=1, help="pairs run first and not counted")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    tmp = comm.bcast(tempfile.mkdtemp(prefix="hpcadapt-user-api-") if comm.rank == 0 else None)
    common = ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
              "--lr", "0.05", "--momentum", "0.9", "--seed", "0",
              "--threads", str(args.threads), "--no-progress"]
    runners = {
        "builtin": lambda extra: builtin_train.main(["--model", "mlp", "--dataset", "digits"]
                                                    + common + extra),
        "user_api": lambda extra: user_api_train.main(common + extra),
    }
    runs = {k: [] for k in runners}
    for rep in range(args.warmup + args.reps):
        order = list(runners) if rep % 2 == 0 else list(reversed(runners))
        for kind in order:
            metrics = os.path.join(tmp, f"{kind}-{rep}.jsonl")
            summary = os.path.join(tmp, f"{kind}-{rep}.json")
            gc.collect()  # the previous job's garbage, not during this one
            comm.Barrier()
            t0 = time.perf_counter()
            code = runners[kind](["--metrics-file", metrics, "--summary-json", summary])
            wall = time.perf_counter() - t0
            if code not in (None, 0):
                raise SystemExit(f"{kind} exited with {code}")
            if comm.rank == 0 and rep >= args.warmup:
                runs[kind].append(run_record(metrics, summary, wall))
    if comm.rank == 0:
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
        os.rmdir(tmp)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"runs": runs, "ranks": comm.size}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
