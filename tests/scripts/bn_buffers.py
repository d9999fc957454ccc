"""A user script with a BatchNorm CNN on digits (each rank's batches differ, so do its running
statistics unless they are kept consistent). Every rank still in the job at the end writes
to --out/rank<R>.json the digests of its parameters and of its buffers, and what
``job.replicas_identical()`` says."""

import argparse
import hashlib
import json
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import hpcadapt
from hpcadapt.datasets import load_dataset
from hpcadapt.models import build_model


def digest(tensors) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=1)
hpcadapt.add_arguments(parser)
args = parser.parse_args()
job = hpcadapt.Job(args)
data = load_dataset("digits")
model = build_model("cnn", data.input_shape, data.num_classes, seed=0, width=8, batch_norm=True)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loader = hpcadapt.ElasticDataLoader(TensorDataset(data.x_train, data.y_train), batch_size=48)
job.setup(model, opt, loader)
for epoch in job.epochs(args.epochs):
    for x, y in loader:
        job.step(torch.nn.functional.cross_entropy(model(x), y))
identical = job.replicas_identical()
rank = job.world.rank
Path(args.out, f"rank{rank}.json").write_text(json.dumps({
    "rank": rank, "size": job.world.size, "steps": job.state.step,
    "params": digest(model.parameters()), "buffers": digest(model.buffers()),
    "num_batches_tracked": [int(b) for n, b in model.named_buffers()
                            if n.endswith("num_batches_tracked")],
    "replicas_identical": identical}))
job.finish(exit=False)
