"""Benchmarks that are one MPI job of a worker script."""

from launch import run_worker

WORKERS = {"allreduce": "bench_allreduce.py", "ddp": "bench_ddp.py",
           "monitor-overhead": "bench_monitor.py",
           "step-overhead": "bench_step_overhead.py"}


def run(name, extra):
    return run_worker(WORKERS[name], 2, extra)
