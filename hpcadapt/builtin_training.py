"""The built-in training behind ``python -m hpcadapt.train``: a client of the public API
(``hpcadapt.Job``) with the built-in models and datasets, exactly as a user's script is."""

from __future__ import annotations

import argparse
import logging
import math
import os
from typing import Any, Dict, Optional

import torch
from torch import nn
from torch.utils.data import TensorDataset

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.datasets import load_dataset
from hpcadapt.job import Job
from hpcadapt.data.loader import ElasticDataLoader
from hpcadapt.loop.progress import ProgressLR
from hpcadapt.loop.setup_checks import agree
from hpcadapt.models import build_model
from hpcadapt.saved_model import SavedModel, save_model

__all__ = ["run_builtin", "evaluate_accuracy", "evaluate", "schedule_factor", "SCHEDULES"]

log = logging.getLogger(__name__)

SCHEDULES = ("constant", "cosine", "wsd")


@torch.no_grad()
def evaluate_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                      batch: int = 512) -> float:
    """Test accuracy of this rank's replica on the whole set. The replicas are identical
    after every step, so every rank gets the same number without talking to the others: no
    collective between steps, so a worker dying meanwhile is met (and recovered from) in
    the next step, never here. For a sequence model (logits ``[B, classes, T]``, targets
    ``[B, T]``) it is the accuracy over every position."""
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, len(x), batch):
        correct += int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
    model.train(was_training)
    return float(correct) / float(y.numel()) if len(x) else float("nan")


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
             batch: int = 128) -> Dict[str, float]:
    """``{"loss": ..., "accuracy": ...}`` of this rank's replica on a whole set, in one pass:
    the mean cross-entropy (nats) and accuracy over every target (every position of a
    sequence model's ``[B, T]`` targets: per character for the language model). Rank-local
    like ``evaluate_accuracy`` (no collective)."""
    was_training = model.training
    model.eval()
    total, correct = 0.0, 0
    for i in range(0, len(x), batch):
        out, target = model(x[i:i + batch]), y[i:i + batch]
        total += float(nn.functional.cross_entropy(out.float(), target, reduction="sum"))
        correct += int((out.argmax(1) == target).sum())
    model.train(was_training)
    n = y.numel()
    return {"loss": total / n if n else float("nan"),
            "accuracy": float(correct) / n if n else float("nan")}


def schedule_factor(progress: float, schedule: str = "constant", *, warmup: float = 0.0,
                    decay: float = 0.2, warmup_floor: float = 0.0) -> float:
    """The learning-rate factor at ``progress`` (the fraction of training done, 0 to 1):
    a linear warm-up over the first ``warmup`` (from ``warmup_floor``), then constant,
    cosine (to 0 at the end) or wsd (warm-up, stable, then the last ``decay`` linearly to
    0)."""
    f = min(max(progress, 0.0), 1.0)
    if schedule == "cosine":
        body = 0.5 * (1.0 + math.cos(math.pi * min(1.0, (f - warmup) / (1.0 - warmup))))  \
            if f > warmup else 1.0
    elif schedule == "wsd":
        body = min(1.0, (1.0 - f) / decay) if decay > 0 else 1.0
    else:
        body = 1.0
    if warmup > 0 and f < warmup:
        body *= max(warmup_floor, f / warmup)
    return body


def _scheduler(args: argparse.Namespace, job: Job, optimizer: torch.optim.Optimizer,
               train_samples: int) -> Optional[ProgressLR]:
    """``--lr-schedule``, ``--warmup-fraction``, ``--decay-fraction`` as a user writes them:
    a LambdaLR in steps at the starting global batch, wrapped in ProgressLR (stepped by
    samples seen), so that it follows the data whatever batch the policies choose. None for
    the default (constant, no warm-up): the optimizer's rate is left alone."""
    schedule, warmup, decay = args.lr_schedule, args.warmup_fraction, args.decay_fraction
    if schedule == "constant" and warmup == 0:
        return None
    total = args.epochs * train_samples / args.batch_size   # scale-invariant steps in all
    floor = 1.0 / max(1.0, warmup * total)   # the first step's factor: not 0 (no lost step)

    def factor(steps: int) -> float:
        return schedule_factor(steps / total, schedule, warmup=warmup, decay=decay,
                               warmup_floor=floor)

    return ProgressLR(torch.optim.lr_scheduler.LambdaLR(optimizer, factor), job)


def _check_schedule(args: argparse.Namespace) -> None:
    """Refuse, before anything loads, a wsd warm-up and decay that overlap."""
    warmup, decay = args.warmup_fraction, args.decay_fraction
    if args.lr_schedule == "wsd" and warmup + decay > 1:
        raise ConfigurationError(f"--warmup-fraction {warmup} and --decay-fraction {decay} "
                                 f"add up to more than the whole run; make their sum <= 1")


def _optimizer(args: argparse.Namespace, model: nn.Module) -> torch.optim.Optimizer:
    if getattr(args, "optimizer", "sgd") == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.lr,
                                 weight_decay=args.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                           weight_decay=args.weight_decay)


def run_builtin(args: argparse.Namespace) -> Dict[str, Any]:
    """Train a built-in model on a built-in dataset with the job's policies; returns the
    summary (``job.finish`` exits with 75 after a stop signal)."""
    job = Job(args)
    _check_schedule(args)
    _check_save_model(args, job)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    sizes = {"num_samples": args.samples} if args.samples is not None else {}
    if args.dataset == "shakespeare":
        sizes["context"] = args.context
    data = load_dataset(args.dataset, seed=args.seed, **sizes)
    model = build_model(args.model, data.input_shape, data.num_classes, seed=args.seed,
                        hidden=args.hidden, width=args.width)
    device = job.device
    model.to(device)
    optimizer = _optimizer(args, model)
    on_gpu = device.type == "cuda"
    loader = ElasticDataLoader(TensorDataset(data.x_train, data.y_train),
                               batch_size=args.batch_size, seed=args.seed, pin_memory=on_gpu,
                               num_workers=getattr(args, "loader_workers", 0))
    x_test, y_test = data.x_test.to(device), data.y_test.to(device)
    loss_fn = nn.CrossEntropyLoss()
    sched = _scheduler(args, job, optimizer, len(data.x_train))
    job.setup(model, optimizer, loader, identity={"model": args.model, "dataset": args.dataset},
              extra={"scheduler": sched} if sched is not None else None)
    sched = job.extra["scheduler"] if sched is not None else None
    every = args.eval_every_samples
    cached: Dict[str, Any] = {"samples": -1}

    def validate() -> Dict[str, float]:
        """The validation set's loss and accuracy now (once per point of training)."""
        if cached["samples"] != job.samples_seen:
            cached.update(evaluate(model, x_test, y_test), samples=job.samples_seen)
        return cached

    next_eval = (job.samples_seen // every + 1) * every if every else 0
    logged_at = -1
    for _ in job.epochs(args.epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=on_gpu), y.to(device, non_blocking=on_gpu)
            if not job.step(loss_fn(model(x), y)):
                continue
            if sched is not None:
                sched.step()
            if every and job.samples_seen >= next_eval:
                v = validate()
                job.log_eval(val_loss=v["loss"], val_accuracy=v["accuracy"])
                logged_at = job.samples_seen
                next_eval = (job.samples_seen // every + 1) * every
        v = validate()
        job.log_epoch(test_accuracy=v["accuracy"], val_loss=v["loss"])
    if every and not job.stopped and logged_at != job.samples_seen:
        v = validate()
        job.log_eval(val_loss=v["loss"], val_accuracy=v["accuracy"])
    if args.save_model and not job.stopped and job.world.rank == 0:
        save_model(args.save_model, SavedModel(
            model=args.model, input_shape=tuple(data.input_shape),
            num_classes=data.num_classes, dataset=args.dataset, hidden=list(args.hidden),
            width=args.width, vocab=data.vocab, state_dict=model.state_dict()))
        log.info("trained model saved to %s", args.save_model)
    return job.finish()


def _check_save_model(args: argparse.Namespace, job: Job) -> None:
    """--save-model PATH: its folder must exist and be writable where rank 0 writes it
    (said at start, not after the training; rank 0's verdict for every rank)."""
    if not args.save_model:
        return
    error = ""
    folder = os.path.dirname(os.path.abspath(args.save_model))
    if job.world.rank == 0 and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        error = (f"--save-model {args.save_model}: cannot write in {folder} (create it, or "
                 f"pass a path in a folder you can write)")
    agree(error, job.world)
