"""monitor-overhead: training throughput of the ResNet-style model on 2 ranks with gradient
monitoring off, noise scale every step, every 10 steps, and variance every step.

The configurations take turns step by step (off, gns, gns/10, variance, off, ...), so slow
drifts of a noisy machine hit all of them alike; a step's time is the slowest rank's, and each
configuration's mean is taken over the middle 80% of its steps."""

import argparse
import sys
import time
from typing import Iterator, Tuple

import numpy as np
import torch
from mpi4py import MPI
from torch import nn
from torch.utils.data import TensorDataset

import hpcadapt
from hpcadapt.datasets import load_dataset
from hpcadapt.models import build_model
from hpcadapt.adapt.monitors import MonitorConfig
from hpcadapt.train import build_parser
from common import single_thread, write_result
from launch import quick_defaults

OFF = MonitorConfig((), 1)
NAMES = ("off", "gns_every_step", "gns_every_10", "variance_every_step")


def config_for(name: str, nth: int) -> MonitorConfig:
    if name == "gns_every_step":
        return MonitorConfig(("gns",), 1)
    if name == "variance_every_step":
        return MonitorConfig(("variance",), 1)
    if name == "gns_every_10":
        return MonitorConfig(("gns",), 1) if nth % 10 == 0 else OFF
    return OFF


def resnet_job(batch: int, steps: int) -> Tuple[hpcadapt.Job, nn.Module, Iterator]:
    """The built-in entry point's setup (``hpcadapt.builtin_training.run_builtin``) of the ResNet-style
    model (width 32) on 2,048 synthetic samples, and an endless stream of its batches (the
    job stops after ``steps`` steps)."""
    args = build_parser().parse_args([
        "--model", "resnet", "--dataset", "synthetic", "--samples", "2048", "--width", "32",
        "--batch-size", str(batch), "--epochs", "1000", "--max-steps", str(steps),
        "--no-progress"])
    job = hpcadapt.Job(args)
    data = load_dataset("synthetic", seed=args.seed, num_samples=args.samples)
    model = build_model("resnet", data.input_shape, data.num_classes, seed=args.seed,
                        width=args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loader = hpcadapt.ElasticDataLoader(TensorDataset(data.x_train, data.y_train),
                                        batch_size=args.batch_size, seed=args.seed)
    job.setup(model, optimizer, loader)

    def batches() -> Iterator:
        for _ in job.epochs(args.epochs):
            yield from loader

    return job, model, batches()


def trimmed_mean(xs, cut=0.1):
    xs = np.sort(np.asarray(xs))
    k = int(len(xs) * cut)
    return float(xs[k:len(xs) - k].mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=100, help="steps per configuration")
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    quick_defaults(ap, sys.argv[1:], steps=10)  # 10: gns_every_10 monitors once
    args = ap.parse_args()
    single_thread()
    warmup = 8
    total = args.steps * len(NAMES) + warmup
    job, model, batches = resnet_job(args.batch, total)
    loss_fn = nn.CrossEntropyLoss()
    comm = MPI.COMM_WORLD
    times = {n: [] for n in NAMES}
    monitored = {n: 0 for n in NAMES}
    for i in range(total):
        name = NAMES[i % len(NAMES)]
        nth = i // len(NAMES)
        job.monitoring.config = config_for(name, nth)  # read when the loader starts the step
        t0 = time.perf_counter()
        x, y = next(batches)
        job.step(loss_fn(model(x), y))
        dt = time.perf_counter() - t0
        if i >= warmup:
            times[name].append(dt)
            monitored[name] += int(job.steps.monitored)
    noise_scale = job.state.gns.noise_scale
    parameters = sum(p.numel() for p in model.parameters())
    slowest = {n: np.maximum.reduce(comm.allgather(np.array(v))) for n, v in times.items()}
    for _ in batches:  # the job ends at --max-steps: let it close its epoch and finish
        raise SystemExit("monitor-overhead: the job trained past --max-steps")
    job.finish()
    per_step = {n: trimmed_mean(v) for n, v in slowest.items()}
    ratios = {f"{n}_throughput": per_step["off"] / per_step[n] for n in NAMES[1:]}
    rows = {n: {"samples_per_s": args.batch / per_step[n], "step_ms": 1e3 * per_step[n],
                "monitored_steps": monitored[n], "steps": len(times[n])} for n in NAMES}
    if comm.rank == 0:
        write_result(args.out, {"benchmark": "monitor-overhead", "model": "resnet",
                                "parameters": parameters,
                                "world_size": comm.size, "global_batch": args.batch,
                                "noise_scale_seen": noise_scale,
                                "rows": rows, "ratios": ratios})


if __name__ == "__main__":
    main()
