"""A torchrun-style loop: `for epoch in range(3)` around the loader, as torch users write it
(issue 43 item 1). hpcadapt keeps the epoch (for resume and joins): the second pass must
fail at once in one line naming job.epochs, never train one epoch and then nothing."""

import argparse

import torch

import hpcadapt

parser = argparse.ArgumentParser()
parser.add_argument("--iter-outside", action="store_true",
                    help="iterate the loader before any job.epochs()")
hpcadapt.add_arguments(parser)
args = parser.parse_args()
job = hpcadapt.Job(args)
torch.manual_seed(0)
x = torch.randn(256, 8)
y = (x.sum(1) > 0).long()
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = hpcadapt.ElasticDataLoader(torch.utils.data.TensorDataset(x, y), 32)
job.setup(model, optimizer, loader)
if args.iter_outside:
    next(iter(loader))
for epoch in range(3):
    batches = 0
    for xb, yb in loader:
        job.step(torch.nn.functional.cross_entropy(model(xb), yb))
        batches += 1
    print(f"epoch {epoch}: {batches} batches", flush=True)
job.finish()
