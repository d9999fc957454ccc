"""A user script whose rank 1 raises at step 3: the whole job must end, not hang (nor wait
for its loader's worker processes: --loader-workers)."""

import argparse

import torch
from torch.utils.data import TensorDataset

import hpcadapt

parser = argparse.ArgumentParser()
parser.add_argument("--loader-workers", type=int, default=0)
hpcadapt.add_arguments(parser)
args = parser.parse_args()
job = hpcadapt.Job(args)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
loader = hpcadapt.ElasticDataLoader(data, batch_size=16, num_workers=args.loader_workers)
job.setup(model, opt, loader)
for epoch in job.epochs(1000):
    for x, y in loader:
        if job.world.rank == 1 and job.state.step == 3:
            raise RuntimeError("user code failed on purpose at step 3")
        job.step(torch.nn.functional.cross_entropy(model(x), y))
job.finish()
