"""Where the GPU benchmark's time goes: hpcadapt's step (statistics off and on) against DDP's.

Builds the same contenders as ``run.py gpu`` (driver_gpu.training's MLP, batch and
optimizers), warms them up, then records ``--steps`` steps of each under torch's profiler
(CPU and CUDA activity) and under cProfile (Python time), and appends the tables to
``--out``/profile.txt. A tool for a lent GPU machine; it asserts nothing.

    python3 benchmarks/profile_gpu.py --out gpu-check-out --steps 20
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import free_port  # noqa: E402
from driver_gpu import build_mlp, sgd, sync, training_step, INPUT_SHAPE, CLASSES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="gpu-check-out")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile

    import hpcadapt

    hpcadapt.init()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    x = torch.randn(args.batch_size, *INPUT_SHAPE, device=device)
    y = torch.randint(0, CLASSES, (args.batch_size,), device=device)
    ours = build_mlp(torch, device)
    opt = hpcadapt.DistributedOptimizer(sgd(torch, ours), ours.named_parameters(),
                                        data_plane="nccl")
    ours_step = training_step(torch, ours, opt, x, y)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    ddp = DistributedDataParallel(build_mlp(torch, device), device_ids=[0])
    ddp_step = training_step(torch, ddp, sgd(torch, ddp), x, y)

    def with_gns(on: bool):
        def step():
            opt.track_grad_norms = on
            ours_step()
        return step

    contenders = {"hpcadapt": with_gns(False), "hpcadapt_gns": with_gns(True), "ddp": ddp_step}
    for step in contenders.values():
        for _ in range(5):
            step()
    sync(torch, device)
    for name, step in contenders.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step()
            sync(torch, device)
        averages = prof.key_averages()
        with open(os.path.join(args.out, "profile.txt"), "a") as f:
            f.write(f"===== {name}: {args.steps} steps =====\n")
            f.write(averages.table(sort_by="self_cpu_time_total", row_limit=30))
            f.write("\n\n")
            f.write(averages.table(sort_by="self_cuda_time_total", row_limit=20))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.steps):
            step()
        sync(torch, device)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        with open(os.path.join(args.out, "profile.txt"), "a") as f:
            f.write("\n\ncProfile (tottime)\n" + s.getvalue())
        print(name, "profiled", flush=True)
    opt.remove_hooks()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
