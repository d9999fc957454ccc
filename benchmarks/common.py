"""Helpers shared by the benchmark workers (run under mpiexec by benchmarks/run.py)."""

from __future__ import annotations

import json
import os
import socket
import statistics
from typing import Callable, Dict, List, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(comm) -> None:
    """torch.distributed with gloo on the same ranks, rendezvous address from MPI rank 0."""
    import torch.distributed as dist

    port = comm.bcast(free_port() if comm.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.rank, world_size=comm.size)


def interleaved(contenders: Dict[str, Callable[[], float]], rounds: int) -> Dict[str, List[float]]:
    """Run each contender once per round, in rotating order, so drift hits all alike."""
    results: Dict[str, List[float]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            results[name].append(contenders[name]())
    return results


def median(xs: List[float]) -> float:
    return float(statistics.median(xs))


def write_result(path: str, result: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2, sort_keys=True)


def single_thread() -> None:
    """One torch thread per rank: the ranks share the machine's cores."""
    import torch

    threads = int(os.environ.get("HPCADAPT_BENCH_THREADS", "1"))
    torch.set_num_threads(threads)


def read_jsonl(path: str) -> List[dict]:
    """The records of a metrics file (none when it does not exist yet)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def epochs_with_time(rows: List[dict]) -> List[dict]:
    """Epoch rows with ``wall_s``: seconds since the run's first step began."""
    steps = [r for r in rows if r["event"] == "step"]
    t0 = steps[0]["time_s"] - steps[0]["step_time_s"] if steps else 0.0
    return [dict(r, wall_s=r["time_s"] - t0) for r in rows if r["event"] == "epoch"]


def time_to_target(epochs: List[dict], target: float, key: str = "wall_s") -> Optional[float]:
    """``key`` (wall_s, step, epoch) of the first epoch whose accuracy reaches ``target``."""
    for r in epochs:
        if r["test_accuracy"] >= target:
            return r[key]
    return None
