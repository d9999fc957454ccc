"""A user's scheduler under the job's learning-rate rule: a tiny regression trained with one
of LambdaLR, OneCycleLR, CosineAnnealingLR or ProgressLR(LambdaLR), the scheduler stepped
after every committed ``job.step`` as the own-script guide says, and a schedule policy that
quadruples the batch at step 12. Rank 0 prints, per step, the rate the scheduler had set (what
``param_groups`` holds between steps) as JSON lines; the metrics file has the rate the update
used."""

import argparse
import json
import math

import torch
from torch.utils.data import TensorDataset

import hpcadapt

parser = argparse.ArgumentParser()
parser.add_argument("--scheduler", choices=["lambda", "onecycle", "cosine", "progress",
                                            "progress-gain"])
hpcadapt.add_arguments(parser)
args = parser.parse_args()
job = hpcadapt.Job(args)
g = torch.Generator().manual_seed(0)
x = torch.randn(4096, 8, generator=g)
y = x @ torch.randn(8, generator=g) + 0.5 * torch.randn(4096, generator=g)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.005}],
                      lr=0.01, momentum=0.9)
T = args.max_steps
if args.scheduler == "lambda":
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
elif args.scheduler == "onecycle":
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.01], total_steps=T + 5,
                                                cycle_momentum=False)
elif args.scheduler == "cosine":
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=T, eta_min=0.001)
loader = hpcadapt.ElasticDataLoader(TensorDataset(x, y), batch_size=16)
if args.scheduler.startswith("progress"):
    sched = hpcadapt.ProgressLR(torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 1.0 / (1 + 0.05 * s)), job,
        key="gain" if args.scheduler == "progress-gain" else "samples")
job.setup(model, opt, loader, extra={"scheduler": sched})
for epoch in job.epochs(1):
    for xb, yb in loader:
        before = [grp["lr"] for grp in opt.param_groups]
        step = job.step_count
        if job.step(((model(xb)[:, 0] - yb) ** 2).mean()):
            sched.step()
            if job.rank == 0:
                print(json.dumps({"step": step, "scheduler_lr": before,
                                  "batch": job.global_batch_size,
                                  "si_steps": job.scale_invariant_steps,
                                  "gain_steps": job.gain_steps}), flush=True)
job.finish()
