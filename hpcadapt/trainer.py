"""The built-in training behind ``python -m hpcadapt.train``: a client of the public API
(``hpcadapt.Job``) with the built-in models and datasets, exactly as a user's script is."""

from __future__ import annotations

import argparse
import logging
from typing import Any, Dict

import torch
from torch import nn
from torch.utils.data import TensorDataset

from hpcadapt.datasets import load_dataset
from hpcadapt.job import Job
from hpcadapt.data.loader import ElasticDataLoader
from hpcadapt.models import build_model

__all__ = ["run_builtin", "evaluate_accuracy"]

log = logging.getLogger(__name__)


@torch.no_grad()
def evaluate_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                      batch: int = 512) -> float:
    """Test accuracy of this rank's replica on the whole set. The replicas are identical
    after every step, so every rank gets the same number without talking to the others: no
    collective between steps, so a worker dying meanwhile is met (and recovered from) in
    the next step, never here."""
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        correct += int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
    model.train(was_training)
    return float(correct) / float(len(x)) if len(x) else float("nan")


def run_builtin(args: argparse.Namespace) -> Dict[str, Any]:
    """Train a built-in model on a built-in dataset with the job's policies; returns the
    summary (``job.finish`` exits with 75 after a stop signal)."""
    job = Job(args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    sizes = {"num_samples": args.samples} if args.samples is not None else {}
    data = load_dataset(args.dataset, seed=args.seed, **sizes)
    model = build_model(args.model, data.input_shape, data.num_classes, seed=args.seed,
                        hidden=args.hidden, width=args.width)
    device = job.device
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    on_gpu = device.type == "cuda"
    loader = ElasticDataLoader(TensorDataset(data.x_train, data.y_train),
                               batch_size=args.batch_size, seed=args.seed, pin_memory=on_gpu)
    x_test, y_test = data.x_test.to(device), data.y_test.to(device)
    loss_fn = nn.CrossEntropyLoss()
    job.setup(model, optimizer, loader, identity={"model": args.model, "dataset": args.dataset})
    for _ in job.epochs(args.epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=on_gpu), y.to(device, non_blocking=on_gpu)
            job.step(loss_fn(model(x), y))
        job.log_epoch(test_accuracy=evaluate_accuracy(model, x_test, y_test))
    return job.finish()
