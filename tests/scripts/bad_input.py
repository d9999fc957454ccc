"""A user script that sets up one piece of bad input, named by --case."""

import argparse
import threading

import torch
from torch.utils.data import TensorDataset

import hpcadapt

parser = argparse.ArgumentParser()
parser.add_argument("--case", required=True)
parser.add_argument("--width", type=int, default=4)
parser.add_argument("--save-to", default=None)
hpcadapt.add_arguments(parser)
args = parser.parse_args()
job = hpcadapt.Job(args)
width = args.width
if args.case == "params-differ" and job.world.rank == 1:
    width = 5
model = torch.nn.Linear(width, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(64, width), torch.randint(0, 2, (64,)))
batch = 1 if args.case == "small-batch" else 16
loader = hpcadapt.ElasticDataLoader(data, batch_size=batch)
extra = {"lock": threading.Lock()} if args.case == "unserialisable" else {"n": 0}
if args.case == "step-scheduler":   # counts steps: refused by a schedule-reading policy
    extra = {"scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)}
onecycle = None
if args.case in ("onecycle", "onecycle-progress"):  # stepped by the script after job.step
    onecycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=8)
    if args.case == "onecycle-progress":
        onecycle = extra["scheduler"] = hpcadapt.ProgressLR(onecycle, job)
if args.case == "no-setup":         # job.setup forgotten
    for epoch in job.epochs(2):
        pass
job.setup(model, opt, loader, extra=extra)
if args.case == "step-first":       # job.step before job.epochs and the loader
    job.step(torch.nn.functional.cross_entropy(model(data.tensors[0][:8]), data.tensors[1][:8]))
if args.case == "range-loop":       # torch's habit: hpcadapt keeps the epoch itself
    epochs = range(2)
else:
    epochs = job.epochs(2)
for epoch in epochs:
    for x, y in loader:
        if job.step(torch.nn.functional.cross_entropy(model(x), y)) and onecycle is not None:
            onecycle.step()
if args.save_to and job.world.rank == 0:
    job.save_checkpoint(args.save_to)
job.finish()
