"""A user script that logs its own epoch metrics beside the test accuracy: a float, a numpy
scalar, a 0-d tensor and a NaN; --case names a bad one instead (a string, a list, None, a
name of the epoch line's own)."""

import argparse
import math

import numpy as np
import torch
from torch.utils.data import TensorDataset

import hpcadapt

BAD = {"string": {"note": "fine"}, "list": {"per_class": [0.5, 0.7]},
       "none": {"ema_accuracy": None}, "builtin": {"loss": 0.25}}

parser = argparse.ArgumentParser()
parser.add_argument("--case", default="ok", choices=["ok"] + sorted(BAD))
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--own-only", action="store_true", help="log no test accuracy")
hpcadapt.add_arguments(parser)
args = parser.parse_args()
job = hpcadapt.Job(args)
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
loader = hpcadapt.ElasticDataLoader(TensorDataset(x, y), batch_size=16)
job.setup(model, opt, loader)
for epoch in job.epochs(args.epochs):
    for xb, yb in loader:
        job.step(torch.nn.functional.cross_entropy(model(xb), yb))
    if args.own_only:
        job.log_epoch(ema_accuracy=0.25)
        continue
    if args.case != "ok":
        job.log_epoch(test_accuracy=0.5, **BAD[args.case])
    job.log_epoch(test_accuracy=0.5, ema_accuracy=0.25 + 0.125 * epoch,
                  grad_norm=np.float32(1.5), margin=torch.tensor(2.0 + epoch),
                  steps_seen=np.int64(job.state.step), nothing_yet=math.nan)
job.finish()
