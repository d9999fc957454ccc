"""Benchmarks that are one MPI job of a worker script."""

from launch import run_worker

WORKERS = {"allreduce": "bench_allreduce.py", "ddp": "bench_ddp.py",
           "monitor-overhead": "bench_monitor.py",
           "step-overhead": "bench_step_overhead.py"}


def run(name, extra):
    # step-overhead on a GPU: one rank (NCCL takes one rank per GPU; the lent machine has one)
    on_gpu = name == "step-overhead" and any(a.startswith("cuda") or a.startswith("--device=cuda")
                                             for a in extra)
    return run_worker(WORKERS[name], 1 if on_gpu else 2, extra)
