"""topology: the allreduce topologies side by side (``hpcadapt.comm.topology``), by default on 4
ranks in 2 emulated nodes of 2 (``--ranks-per-node 2``), measured in one run.

What is measured, and how: float32 arrays of 4 KB to 64 MB (``--sizes``), reduced with
``ReduceOp.AVERAGE`` in place (as gradients are) by each topology: flat (MPI's own
Iallreduce), hierarchical (reduce to each node's leader, allreduce among the leaders,
broadcast in the node), ring (reduce-scatter + allgather over Isend/Irecv) and tree
(binomial reduce + broadcast). Each topology is built once. Per size, after one warm-up
call each, ``common.interleaved`` runs one call of every topology per round in rotating
order, each call timed alone after a barrier; a call's time is the slowest rank's, and
each topology's median over the rounds is reported with its bandwidth (GB/s: 10^9 bytes
of the array per second; algorithm bandwidth, not bus bandwidth). Rounds per size follow
``--seconds`` (at least 7). Ratios: ``<topology>_vs_flat_<size>`` = flat's median time /
the topology's, so above 1 means the topology is faster than flat.

Emulated nodes are ranks of one host: traffic "across nodes" here is the same shared memory
as traffic inside one, so the benchmark shows the algorithms' own costs (messages, rounds,
copies), not a network's. No timed assertions: the numbers are reported, not judged.

The file is both the driver (``run``: starts the MPI job) and the worker (run under
mpiexec with ``--out``)."""

from __future__ import annotations

import argparse
import re
import time
from typing import Dict, List, Optional

DEFAULT_SIZES = "4KB,64KB,256KB,1MB,4MB,16MB,64MB"
_SIZE = re.compile(r"^(\d+)(KB|MB)$")


def parse_sizes(text: str) -> Dict[str, int]:
    """``"4KB,1MB"`` -> {"4KB": 4096, "1MB": 1048576}; whole float32 arrays only."""
    out = {}
    for part in text.split(","):
        m = _SIZE.match(part.strip().upper())
        if m is None or int(m.group(1)) < 1:
            raise SystemExit(f"topology benchmark: size {part!r} is not like 4KB or 16MB "
                             f"(a whole number of KB or MB, >= 1)")
        out[f"{m.group(1)}{m.group(2)}"] = int(m.group(1)) << (10 if m.group(2) == "KB" else 20)
    return out


def parse_args(name: str, extra: List[str]) -> argparse.Namespace:
    from hpcadapt.base.errors import ConfigurationError
    from hpcadapt.comm.topology import parse_ranks_per_node
    from launch import quick_defaults

    ap = argparse.ArgumentParser(prog=f"run.py {name}")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)  # the worker's result file
    ap.add_argument("--ranks", type=int, default=4, help="MPI ranks (4)")
    ap.add_argument("--ranks-per-node", default="2",
                    help="consecutive ranks per emulated node, or 'auto' for the real nodes (2)")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help=f"array sizes ({DEFAULT_SIZES})")
    ap.add_argument("--seconds", type=float, default=3.0,
                    help="time budget per size, roughly (3)")
    quick_defaults(ap, extra, sizes="4KB,1MB,16MB", seconds=0.2)
    args = ap.parse_args(extra)
    if args.ranks < 2:
        raise SystemExit(f"topology benchmark: --ranks {args.ranks}: needs at least 2")
    try:
        args.ranks_per_node = parse_ranks_per_node(args.ranks_per_node)
    except ConfigurationError as e:
        raise SystemExit(f"topology benchmark: --ranks-per-node: {e}") from None
    args.sizes = parse_sizes(args.sizes)
    return args


def run(name: str, extra: List[str]) -> dict:
    """Start the worker on ``--ranks`` ranks and return its result."""
    from launch import run_worker

    args = parse_args(name, extra)
    return run_worker("driver_topology.py", args.ranks, extra)


# -- the worker -----------------------------------------------------------------------------
def _timed(comm, topo, buf, op):
    def call() -> float:
        comm.Barrier()  # line the ranks up, so no call pays for the previous one's skew
        t0 = time.perf_counter()
        topo.allreduce(buf, op)
        return time.perf_counter() - t0

    return call


def _print_table(result: dict) -> None:
    names = result["topologies"]
    print(f"\ntopology: {result['world_size']} ranks, {result['layout']}; median ms "
          f"(GB/s) of the slowest rank per call", flush=True)
    print(f"  {'size':>6}  " + "  ".join(f"{n:>19}" for n in names) + "  fastest")
    for label, row in result["rows"].items():
        cells = [f"{row[n]['seconds'] * 1e3:9.3f} ({row[n]['GB_per_s']:6.2f})" for n in names]
        print(f"  {label:>6}  " + "  ".join(f"{c:>19}" for c in cells) + f"  {row['fastest']}")
    print(flush=True)


def worker(argv: Optional[List[str]] = None) -> None:
    import sys

    import numpy as np
    from mpi4py import MPI

    import hpcadapt
    from common import interleaved, median, single_thread, write_result
    from hpcadapt import ReduceOp
    from hpcadapt.comm.topology import Topology, build_topology

    args = parse_args("topology", sys.argv[1:] if argv is None else argv)
    if args.out is None:
        raise SystemExit("the topology worker writes its result to --out; "
                         "run it as: python benchmarks/run.py topology")
    single_thread()
    w = hpcadapt.init()
    raw = MPI.COMM_WORLD.Dup()
    topos = {t.value: build_topology(t, w, ranks_per_node=args.ranks_per_node)
             for t in Topology}
    names = list(topos)
    rows: Dict[str, dict] = {}
    for label, nbytes in args.sizes.items():
        # one array for all: AVERAGE of equal values keeps them, so every call sees the
        # same numbers in the same memory
        buf = np.ones(nbytes // 4, dtype=np.float32)
        calls = {n: _timed(raw, topos[n], buf, ReduceOp.AVERAGE) for n in names}
        warm = sum(calls[n]() for n in names)
        per_round = raw.allreduce(warm, op=MPI.MAX)
        rounds = int(raw.bcast(max(7, min(2000, args.seconds / max(per_round, 1e-6))), root=0))
        times = interleaved(calls, rounds)
        slowest = {n: np.maximum.reduce(raw.allgather(np.array(v))) for n, v in times.items()}
        row = {n: {"seconds": median(list(v)), "GB_per_s": nbytes / median(list(v)) / 1e9,
                   "calls": rounds} for n, v in slowest.items()}
        row["fastest"] = min(names, key=lambda n: row[n]["seconds"])
        rows[label] = row
        del buf
    ratios = {f"{n}_vs_flat_{label}": row["flat"]["seconds"] / row[n]["seconds"]
              for label, row in rows.items() for n in names if n != "flat"}
    layout = topos["hierarchical"].layout
    hier = topos["hierarchical"]
    result = {"benchmark": "topology", "world_size": w.size,
              "ranks_per_node": args.ranks_per_node, "layout": layout.describe(),
              "hierarchical_fallback": hier.fallback_reason, "topologies": names,
              "rows": rows, "ratios": ratios, "date": time.strftime("%Y-%m-%d")}
    for topo in topos.values():
        topo.free()
    raw.Free()
    if w.rank == 0:
        _print_table(result)
        if hier.fallback_reason:
            print(f"  (hierarchical ran as flat: {hier.fallback_reason})", flush=True)
        write_result(args.out, result)


if __name__ == "__main__":
    worker()
