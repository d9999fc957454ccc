"""The training entry point: ``python -m hpcadapt.train`` (console script ``hpcadapt-train``).

Run it under ``mpiexec -n N`` or ``srun --mpi=pmi2``; without a launcher it trains as a
single rank."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import List, Optional

from hpcadapt.policies import add_policy_arguments, build_lr_rule, build_policies

from .datasets import DATASETS
from .errors import ConfigurationError, HpcAdaptError
from .models import MODELS
from .monitor import MONITORS

__all__ = ["build_parser", "main"]

log = logging.getLogger(__name__)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _momentum(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _fraction_open(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _int_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 256,256, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpcadapt-train",
        description="Adaptive data-parallel training over MPI. Launch with "
                    "`mpiexec -n N python -m hpcadapt.train ...` or `srun --mpi=pmi2 ...`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("training")
    g.add_argument("--model", choices=sorted(MODELS), default="mlp", help="built-in model")
    g.add_argument("--dataset", choices=sorted(DATASETS), default="digits",
                   help="digits: scikit-learn's handwritten digits; synthetic: random images")
    g.add_argument("--epochs", type=_positive_int, default=5)
    g.add_argument("--batch-size", type=_positive_int, default=32, help="global batch size")
    g.add_argument("--lr", type=_positive_float, default=0.05, help="learning rate")
    g.add_argument("--momentum", type=_momentum, default=0.9)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-steps", type=_positive_int, default=None,
                   help="stop after this many steps (for benchmarks)")
    g.add_argument("--hidden", type=_int_list, default=[256, 256],
                   help="MLP hidden widths, comma-separated")
    g.add_argument("--width", type=_positive_int, default=32, help="CNN/ResNet base width")
    g.add_argument("--synthetic-samples", type=_positive_int, default=4096)
    g.add_argument("--bucket-bytes", type=_positive_int, default=None,
                   help="gradient fusion bucket size (default: HPCADAPT_BUCKET_BYTES or 4 MiB)")
    g.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads per rank (0: torch's default)")
    m = p.add_argument_group("monitoring (computed inside each step)")
    m.add_argument("--monitor", action="append", default=[], choices=list(MONITORS),
                   help="gradient monitor to run (repeatable): gns (noise scale), variance "
                        "(and signal-to-noise ratio); policies switch on what they need")
    m.add_argument("--monitor-interval", type=_positive_int, default=1,
                   help="compute gradient statistics every N steps")
    m.add_argument("--monitor-ema", type=_fraction_open, default=0.1,
                   help="weight of the newest estimate in the moving averages")
    add_policy_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--metrics-file", default=None, help="write JSON Lines metrics here (rank 0)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--sample-log", default=None, metavar="DIR",
                   help="each process appends the sample indices it trains on to DIR (tests)")
    o.add_argument("--summary-json", default=None,
                   help="write the run's summary (final accuracy, steps) here (rank 0)")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        policies = build_policies(args)
        lr_rule = build_lr_rule(args)
    except ConfigurationError as exc:
        parser.error(str(exc))

    from . import runtime as world_mod
    from .logs import setup_logging
    from .engine import PolicyEngine
    from .trainer import TrainConfig, Trainer

    w = world_mod.init()
    setup_logging(lambda: w.rank)
    cfg = TrainConfig(model=args.model, dataset=args.dataset, epochs=args.epochs,
                      batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                      weight_decay=args.weight_decay, seed=args.seed, max_steps=args.max_steps,
                      metrics_file=args.metrics_file, progress=not args.no_progress,
                      bucket_bytes=args.bucket_bytes, hidden=args.hidden, width=args.width,
                      synthetic_samples=args.synthetic_samples, threads=args.threads,
                      monitors=args.monitor, monitor_interval=args.monitor_interval,
                      monitor_ema=args.monitor_ema, sample_log=args.sample_log)
    try:
        trainer = Trainer(cfg, w, engine=PolicyEngine(policies, lr_rule))
        if w.rank == 0:
            log.info("training %s on %s with %d workers, global batch %d, policies: %s",
                     cfg.model, cfg.dataset, w.size, cfg.batch_size,
                     ", ".join(args.policy) or "none")
        summary = trainer.run()
    except HpcAdaptError as exc:
        log.error("%s", exc)
        world_mod.shutdown()
        return 2
    if w.rank == 0:
        print(json.dumps(summary))
        if args.summary_json:
            with open(args.summary_json, "w", encoding="utf-8") as f:
                json.dump(summary, f)
    world_mod.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
