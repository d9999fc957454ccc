"""A user script for the step's fine print: two param groups with different rates, SGD
momentum, a collate function that refuses an empty list, 97 samples in batches of 16 (the
last global batch of each epoch has 1 sample: on 2 ranks one share is empty), and whatever
--max-local-batch the test passes. Rank 0 writes each step's group rates and momentum and
the final parameters as JSON to --out."""

import argparse
import json

import torch
from torch.utils.data import Dataset

import hpcadapt


class Pairs(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def collate(samples):
    if not samples:
        raise RuntimeError("collate called with an empty list")
    xs, ys = zip(*samples)
    return torch.stack(xs), torch.stack(ys)


parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--nan-at", type=int, action="append", default=[],
                    help="rank 1's loss is NaN at these steps")
hpcadapt.add_arguments(parser)
args = parser.parse_args()
job = hpcadapt.Job(args)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                       {"params": model[2].parameters(), "lr": 0.05}], lr=0.1, momentum=0.9)
loader = hpcadapt.ElasticDataLoader(Pairs(97), batch_size=args.batch_size,
                                    num_workers=args.workers, collate_fn=collate)
job.setup(model, opt, loader)
steps = []
for epoch in job.epochs(2):
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if job.world.rank == 1 and job.state.step in args.nan_at:
            loss = loss * float("nan")
        job.step(loss)
        if not steps or steps[-1]["step"] != job.state.step:
            steps.append({"step": job.state.step, "batch": job.state.hyper.batch_size,
                          "lrs": [g["lr"] for g in opt.param_groups],
                          "factor": job.lr_factor,
                          "momentum": [g["momentum"] for g in opt.param_groups]})
summary = job.finish()
if job.world.rank == 0:
    with open(args.out, "w") as f:
        json.dump({"steps": steps, "summary": summary,
                   "params": [p.detach().flatten().tolist() for p in model.parameters()]}, f)
