"""The training entry point: ``python -m hpcadapt.train`` (console script ``hpcadapt-train``).

Run it under ``mpiexec -n N`` or ``srun --mpi=pmi2``; without a launcher it trains as a
single rank."""

from __future__ import annotations

if __name__ == "__main__":
    # First, before torch loads: a stop signal from the scheduler waits until it can be handled.
    from hpcadapt.preemption import block_stop_signals

    block_stop_signals()

import argparse
import json
import logging
import os
import sys
from typing import List, Optional

from hpcadapt.policies import add_policy_arguments, argparse_type, build_lr_rule, build_policies
from hpcadapt.policies import params

from .allocator import LAUNCHERS
from .preemption import EXIT_REQUEUE, StopSignals, parse_signal, unblock_stop_signals
from .datasets import DATASETS
from .engine import RESIZE_BATCH
from .errors import ConfigurationError, HpcAdaptError
from .models import MODELS
from .monitor import MONITORS

__all__ = ["build_parser", "main"]

log = logging.getLogger(__name__)

ALLOCATORS = ["auto", "local", "slurm"]


_positive_int = argparse_type(params.positive_int)
_positive_float = argparse_type(params.positive_float)
_momentum = argparse_type(params.momentum)
_fraction_open = argparse_type(params.fraction_open)


def _int_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers like 256,256, got {text!r}")
    return values


def _signal_list(text: str) -> List[str]:
    try:
        return [parse_signal(s).name for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    e = p.add_argument_group("elastic workers")
    e.add_argument("--max-workers", type=_positive_int, default=None,
                   help="allow resizing up to this many workers (local allocator: slots on "
                        "this host; Slurm: one node per added worker); without it the world "
                        "keeps its size")
    e.add_argument("--min-workers", type=_positive_int, default=1,
                   help="never shrink below this many workers")
    e.add_argument("--allocator", choices=ALLOCATORS, default="auto",
                   help="where added workers come from: slurm (companion allocations), "
                        "local (this host), auto (slurm inside a Slurm job, else local)")
    e.add_argument("--launcher", choices=list(LAUNCHERS), default="process",
                   help="how the local allocator starts a joining worker: process (its own "
                        "mpiexec; a crash cannot hurt the job) or spawn (MPI_Comm_spawn; under "
                        "MPICH run mpiexec with -disable-auto-cleanup)")
    e.add_argument("--join-timeout", type=_positive_float, default=120.0,
                   help="seconds a grow may wait for its workers before it is abandoned")
    e.add_argument("--slurm-partition", default=None,
                   help="partition for added nodes (default: the job's own)")
    e.add_argument("--slurm-pending-timeout", type=_positive_float, default=60.0,
                   help="cancel a node request still pending after this many seconds")
    e.add_argument("--slurm-mpi", choices=["pmi2", "pmix", "none"], default="pmi2",
                   help="srun --mpi plugin for added workers (pmi2 for MPICH)")
    e.add_argument("--slurm-grow", choices=["companion", "expand", "auto"], default="companion",
                   help="how the job gets nodes: companion jobs (any Slurm), job expansion "
                        "(needs SchedulerParameters=permit_job_expansion), or auto (expansion "
                        "where the site permits it)")
    e.add_argument("--resize-batch", choices=list(RESIZE_BATCH), default="keep-global",
                   help="on a resize keep the global batch (the local batch changes) or the "
                        "local batch (the global batch changes, with --lr-rule)")
    e.add_argument("--join-dir", default=None, help=argparse.SUPPRESS)
    e.add_argument("--join-id", type=int, default=0, help=argparse.SUPPRESS)
    c = p.add_argument_group("preemption and requeue")
    c.add_argument("--checkpoint", default=None, metavar="PATH",
                   help="on a stop signal save the training state here and exit with code "
                        f"{EXIT_REQUEUE}; when PATH exists at start, resume from it")
    c.add_argument("--stop-signals", type=_signal_list, default="USR1,TERM",
                   help="signals that stop training at the next step boundary (with "
                        "--checkpoint); Slurm: #SBATCH --signal=USR1@120")
    o = p.add_argument_group("output")
    o.add_argument("--metrics-file", default=None, help="write JSON Lines metrics here (rank 0)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--check-replicas", action="store_true",
                   help="after every resize, compare a digest of the parameters across ranks "
                        "and record it in the resize line (costs one pass over the model)")
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
    from .elastic import ElasticController, JoinTicket, join_running_job
    from .engine import PolicyEngine
    from .trainer import TrainConfig, Trainer

    joining = args.join_dir is not None
    if joining:
        _drop_spawn_link()
    stop_signals = None
    if args.checkpoint:
        stop_signals = StopSignals([parse_signal(s) for s in args.stop_signals]).install()
    else:
        unblock_stop_signals()
    w = world_mod.init()
    setup_logging(lambda: w.rank)
    cfg = TrainConfig(model=args.model, dataset=args.dataset, epochs=args.epochs,
                      batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                      weight_decay=args.weight_decay, seed=args.seed, max_steps=args.max_steps,
                      # rank 0 of the running job writes the metrics, never a joiner
                      metrics_file=None if joining else args.metrics_file,
                      progress=not args.no_progress and not joining,
                      bucket_bytes=args.bucket_bytes, hidden=args.hidden, width=args.width,
                      synthetic_samples=args.synthetic_samples, threads=args.threads,
                      monitors=args.monitor, monitor_interval=args.monitor_interval,
                      monitor_ema=args.monitor_ema, sample_log=args.sample_log,
                      check_replicas=args.check_replicas)
    allocator = None
    try:
        engine = PolicyEngine(policies, lr_rule, resize_batch=args.resize_batch)
        trainer = Trainer(cfg, w, engine=engine)
        if args.max_workers is not None:
            if args.max_workers < w.size:
                raise ConfigurationError(f"--max-workers {args.max_workers} is below the "
                                         f"{w.size} workers already running")
            if args.min_workers > args.max_workers:
                raise ConfigurationError(f"--min-workers {args.min_workers} is above "
                                         f"--max-workers {args.max_workers}")
            allocator, join_root = build_allocator(args, w.rank)
            joiner_argv = ["-m", "hpcadapt.train"] + _without_join_flags(
                list(argv) if argv is not None else sys.argv[1:])
            trainer.elastic = ElasticController(w, allocator, joiner_argv,
                                                join_timeout=args.join_timeout,
                                                min_workers=args.min_workers,
                                                join_root=join_root)
        trainer.stop_signals = stop_signals
        trainer.checkpoint_path = args.checkpoint
        resumed = False
        if joining:
            w.replace(join_running_job(JoinTicket(args.join_dir, args.join_id)))
            trainer.after_join()
            log.info("joined as rank %d of %d at step %d", w.rank, w.size, trainer.step)
        else:
            if args.checkpoint:
                resumed = trainer.resume_from_checkpoint(args.checkpoint)
            if w.rank == 0:
                log.info("training %s on %s with %d workers, global batch %d, policies: %s",
                         cfg.model, cfg.dataset, w.size, cfg.batch_size,
                         ", ".join(args.policy) or "none")
        summary = trainer.run(resume=joining or resumed)
    except HpcAdaptError as exc:
        log.error("%s", exc)
        world_mod.shutdown()
        return 2
    if w.rank == 0 and not summary["left"]:
        print(json.dumps(summary))
        if args.summary_json:
            with open(args.summary_json, "w", encoding="utf-8") as f:
                json.dump(summary, f)
    if allocator is not None:
        allocator.close()
    if summary["stopped"]:
        world_mod.shutdown()
        # Requeue only from a saved state (rank 0 saves; the others follow its word).
        return 1 if summary["stopped"].endswith("NOT saved") else EXIT_REQUEUE
    if args.checkpoint and w.rank == 0 and not joining and os.path.exists(args.checkpoint):
        os.unlink(args.checkpoint)
        log.info("training finished; removed the preemption checkpoint %s", args.checkpoint)
    world_mod.shutdown()
    if summary["left"]:
        _exit_now()
    return 0


def _exit_now() -> None:
    """A worker that left the job has written everything; skipping the interpreter's
    teardown (about 0.7 s with torch loaded) gives its node back to Slurm that much sooner."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def build_allocator(args: argparse.Namespace, rank: int):
    """The allocator ``--allocator`` asks for, and the folder joiners find the port in.

    Slurm needs its commands and a job to live in; without them it says why in one line
    (rank 0) and the job uses the local allocator."""
    from .allocator import LocalAllocator

    if args.allocator in ("auto", "slurm"):
        from hpcadapt.slurm import SlurmAllocator, in_slurm_job, slurm_available

        why = ""
        if not slurm_available():
            why = "no Slurm commands (sbatch, squeue, scancel, scontrol) on this machine"
        elif not in_slurm_job():
            why = "not inside a Slurm job (SLURM_JOB_ID is not set)"
        if not why:
            # The port folder must be visible from the new nodes: the job's working folder.
            return (SlurmAllocator(None, args.max_workers, partition=args.slurm_partition,
                                   pending_timeout=args.slurm_pending_timeout,
                                   mpi=args.slurm_mpi, grow=args.slurm_grow),
                    os.path.join(os.getcwd(), ".hpcadapt-join"))
        if args.allocator == "slurm" and rank == 0:
            log.warning("Slurm allocator unavailable: %s; using the local allocator", why)
    return LocalAllocator(args.max_workers, launcher=args.launcher), None


def _without_join_flags(argv: List[str]) -> List[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--join-dir", "--join-id"):
            skip = True
            continue
        if a.startswith("--join-dir=") or a.startswith("--join-id="):
            continue
        out.append(a)
    return out


def _drop_spawn_link() -> None:
    """A worker started by MPI_Comm_spawn joins through the port; it lets go of its parent."""
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    if parent != MPI.COMM_NULL:
        parent.Disconnect()


if __name__ == "__main__":
    sys.exit(main())
