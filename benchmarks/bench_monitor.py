"""monitor-overhead: training throughput of the ResNet-style model on 2 ranks with gradient
monitoring off, noise scale every step, every 10 steps, and variance every step.

The configurations take turns step by step (off, gns, gns/10, variance, off, ...), so slow
drifts of a noisy machine hit all of them alike; a step's time is the slowest rank's, and each
configuration's mean is taken over the middle 80% of its steps."""

import argparse
import time

import numpy as np
from mpi4py import MPI

import hpcadapt
from hpcadapt.monitor import MonitorConfig
from hpcadapt.trainer import TrainConfig, Trainer
from common import single_thread, write_result

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


def trimmed_mean(xs, cut=0.1):
    xs = np.sort(np.asarray(xs))
    k = int(len(xs) * cut)
    return float(xs[k:len(xs) - k].mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=100, help="steps per configuration")
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    args = ap.parse_args()
    single_thread()
    w = hpcadapt.init()
    cfg = TrainConfig(model="resnet", dataset="synthetic", batch_size=args.batch, epochs=1000,
                      progress=False, samples=2048, width=32)
    trainer = Trainer(cfg, w)
    comm = MPI.COMM_WORLD
    times = {n: [] for n in NAMES}
    monitored = {n: 0 for n in NAMES}
    for i in range(args.steps * len(NAMES) + 8):
        name = NAMES[i % len(NAMES)]
        nth = i // len(NAMES)
        trainer.monitor_cfg = config_for(name, nth)
        if trainer.sampler.epoch_done:
            trainer.sampler.set_epoch(trainer.sampler.epoch + 1)
        t0 = time.perf_counter()
        trainer.train_step()
        dt = time.perf_counter() - t0
        if i >= 8:  # warm-up
            times[name].append(dt)
            monitored[name] += int(trainer.monitored)
    slowest = {n: np.maximum.reduce(comm.allgather(np.array(v))) for n, v in times.items()}
    per_step = {n: trimmed_mean(v) for n, v in slowest.items()}
    ratios = {f"{n}_throughput": per_step["off"] / per_step[n] for n in NAMES[1:]}
    rows = {n: {"samples_per_s": args.batch / per_step[n], "step_ms": 1e3 * per_step[n],
                "monitored_steps": monitored[n], "steps": len(times[n])} for n in NAMES}
    if w.rank == 0:
        write_result(args.out, {"benchmark": "monitor-overhead", "model": "resnet",
                                "parameters": sum(p.numel() for p in trainer.model.parameters()),
                                "world_size": w.size, "global_batch": args.batch,
                                "noise_scale_seen": trainer.gns.noise_scale,
                                "rows": rows, "ratios": ratios})


if __name__ == "__main__":
    main()
