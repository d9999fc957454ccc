"""Linear regression at (nearly) fixed weights, where the noise scale is known in closed
form: y = w*.x + e, x ~ N(0, I_d), e ~ N(0, s^2), loss 0.5 (w.x - y)^2 at w = w* + delta:
G and tr(Sigma) are the mean and the covariance's trace of the data set's per-sample
gradients (about delta and (d + 1)|delta|^2 + s^2 d). The learning rate is tiny so the weights
stay put; the job's monitors measure G and Sigma through the real data path. Rank 0 prints
the closed form as JSON before the job's summary."""

import argparse
import json

import torch
from torch.utils.data import TensorDataset

import hpcadapt

D, SIGMA, N = 20, 2.0, 32000

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--sgd-lr", type=float, default=1e-12,
                    help="the weights stay put at the default; larger: a training path")
hpcadapt.add_arguments(parser)
args = parser.parse_args()
job = hpcadapt.Job(args)
g = torch.Generator().manual_seed(0)
w_star = torch.randn(D, generator=g, dtype=torch.float64)
delta = 0.5 * torch.randn(D, generator=g, dtype=torch.float64)
x = torch.randn(N, D, generator=g, dtype=torch.float64)
y = x @ w_star + SIGMA * torch.randn(N, generator=g, dtype=torch.float64)
model = torch.nn.Linear(D, 1, bias=False).double()
with torch.no_grad():
    model.weight.copy_((w_star + delta)[None])
opt = torch.optim.SGD(model.parameters(), lr=args.sgd_lr)
loader = hpcadapt.ElasticDataLoader(TensorDataset(x, y), batch_size=args.batch_size)
job.setup(model, opt, loader)
for epoch in job.epochs(args.epochs):
    for xb, yb in loader:
        job.step(0.5 * ((model(xb)[:, 0] - yb) ** 2).mean())
if job.world.rank == 0:
    # The data set's own moments: the per-sample gradients g_i = x_i (x_i.w - y_i) at the
    # weights the run kept, their mean G and the trace of their covariance. (The population's
    # G = delta, tr = (d+1)|delta|^2 + s^2 d, differ from a sample of 8,000 by a few percent:
    # E[x x^T] is I only on average.)
    w = (w_star + delta)
    per_sample = x * (x @ w - y)[:, None]
    mean = per_sample.mean(0)
    d2 = float(mean @ mean)
    trace = float(((per_sample - mean) ** 2).sum(1).mean())
    print(json.dumps({"closed_form": {"grad_sq": d2, "trace_sigma": trace,
                                      "noise_scale": trace / d2}}), flush=True)
job.finish()
