"""Counts the data plane's host transfers of tensors per step (issue 44): every call of
``Tensor.item``, ``float(tensor)``, ``Tensor.cpu`` and ``Tensor.tolist`` made while the
gradient hooks, a bucket's launch or ``synchronize`` run. On a GPU each is a wait for the
device; on the CPU the count is the same, so CI counts them. Writes one JSON line per step:
{"monitored": bool, "transfers": n}."""

import argparse
import collections
import json

import torch

import hpcadapt
from hpcadapt.parallel import optimizer as plane

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
hpcadapt.add_arguments(parser)
args = parser.parse_args()

counts = collections.Counter()
inside = [0]


def counted(name, original):
    def method(self, *a, **k):
        if inside[0]:
            counts[name] += 1
        return original(self, *a, **k)
    return method


for name in ("item", "__float__", "cpu", "tolist"):
    setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))

steps = []


def watched(original, at_sync=False):
    def method(self, *a, **k):
        if at_sync:
            monitored = self.track_grad_norms
        inside[0] += 1
        try:
            return original(self, *a, **k)
        finally:
            inside[0] -= 1
            if at_sync:
                steps.append({"monitored": monitored, "transfers": sum(counts.values()),
                              "calls": dict(counts)})
                counts.clear()
    return method


D = plane.DistributedOptimizer
D._on_grad_ready = watched(D._on_grad_ready)
D._launch = watched(D._launch)
D.synchronize = watched(D.synchronize, at_sync=True)

job = hpcadapt.Job(args)
torch.manual_seed(0)
x = torch.randn(512, 16)
y = (x[:, :4].sum(1) > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
loader = hpcadapt.ElasticDataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
job.setup(model, opt, loader)
for epoch in job.epochs(2):
    for xb, yb in loader:
        job.step(torch.nn.functional.cross_entropy(model(xb), yb))
if job.world.rank == 0:
    with open(args.out, "w") as f:
        for s in steps:
            f.write(json.dumps(s) + "\n")
job.finish()
