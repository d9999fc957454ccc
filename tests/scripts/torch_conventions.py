"""torch's DataLoader conventions on an ElasticDataLoader, on every rank: ``len(loader)`` as
torch's (steps per epoch), a OneCycleLR sized ``epochs * len(loader)`` that ends at the last
step, ``sampler.set_epoch(epoch)`` (the epoch job.epochs() yields: a no-op; another:
refused), ``iter(loader)`` twice in an epoch (the second goes on where the first stopped),
``loader.batch_size`` (the global batch). Prints one JSON line per rank."""

import argparse
import json

import torch
from torch.utils.data import DataLoader, TensorDataset

import hpcadapt

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
hpcadapt.add_arguments(parser)
args = parser.parse_args()
job = hpcadapt.Job(args)
torch.manual_seed(0)
x, y = torch.randn(100, 4), torch.randint(0, 2, (100,))
dataset = TensorDataset(x, y)
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = hpcadapt.ElasticDataLoader(dataset, batch_size=16)
lengths = [len(loader), len(DataLoader(dataset, batch_size=16))]
total = args.epochs * len(loader)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)
job.setup(model, optimizer, loader, extra={"seen": 0, "scheduler": scheduler})
refusal = ""
for epoch in job.epochs(args.epochs):
    loader.sampler.set_epoch(epoch)  # the DistributedSampler habit: harmless here
    for i, (xb, yb) in enumerate(loader):
        job.step(torch.nn.functional.cross_entropy(model(xb), yb))
        scheduler.step()
        job.extra["seen"] += 1
        if i == 1:
            break  # leave the epoch early ...
    for xb, yb in loader:  # ... and iterate again: the rest of the same epoch
        job.step(torch.nn.functional.cross_entropy(model(xb), yb))
        scheduler.step()
        job.extra["seen"] += 1
try:
    loader.sampler.set_epoch(7)
except hpcadapt.ConfigurationError as exc:
    refusal = str(exc)
summary = job.finish(exit=False)
print(json.dumps({"rank": job.rank, "len": lengths, "total": total, "steps": job.step_count,
                  "body": job.extra["seen"], "samples": job.samples_seen,
                  "last_epoch": scheduler.last_epoch, "last_lr": summary["lr"],
                  "batch_size": loader.batch_size, "refusal": refusal}), flush=True)
