"""Command-line flags of the adaptive runtime, for any parser: ``add_arguments(parser)`` puts
the policies, monitors, elastic, preemption and output flags on the user's own
``argparse`` parser, so ``--policy gns-batch --gns-batch-max 512`` works on their script
exactly as on ``python -m hpcadapt.train``. The training flags (model, data, epochs, batch
size, learning rate) stay the script's own."""

from __future__ import annotations

import argparse
import logging
from typing import List, Optional

from hpcadapt.base.options import (FLAGLESS_OPTIONS, RESIZING_POLICIES, option_defaults,
                                   refuse_inconsistent)
from hpcadapt.policies import add_policy_arguments, argparse_type, params
from hpcadapt.policies import unused_flags as warn_unused_policy_flags

from hpcadapt.elastic.allocator import LAUNCHERS
from hpcadapt.adapt.engine import RESIZE_BATCH
from hpcadapt.base.lifecycle import is_first_rank
from hpcadapt.adapt.monitors import MONITORS
from hpcadapt.base.preemption import EXIT_REQUEUE, parse_signal
from hpcadapt.base.strategies import STRATEGIES
from hpcadapt.comm.topology import Topology, parse_ranks_per_node

__all__ = ["add_arguments", "one_line_errors", "warn_unused_policy_flags", "refuse_inconsistent",
           "RESIZING_POLICIES", "ALLOCATORS", "RESIZE_BATCH",
           "positive_int", "positive_float"]

log = logging.getLogger(__name__)

ALLOCATORS = ["auto", "local", "slurm"]


positive_int = argparse_type(params.positive_int)
positive_float = argparse_type(params.positive_float)
_fraction_open = argparse_type(params.fraction_open)
_non_negative_int = argparse_type(params.non_negative_int)
_non_negative_float = argparse_type(params.non_negative_float)
_factor = argparse_type(params.at_least(1.0))   # a slow-down: 1 (none) or more


def _ranks_per_node(text: str) -> Optional[int]:
    from hpcadapt.base.errors import ConfigurationError

    try:
        return parse_ranks_per_node(text)
    except ConfigurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _signal_list(text: str) -> List[str]:
    names = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            sig = parse_signal(part)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if sig.name in ("SIGKILL", "SIGSTOP", "SIGCHLD", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL"):
            raise argparse.ArgumentTypeError(
                f"{sig.name} cannot be a stop signal (it cannot be caught, or the process "
                f"needs it); use USR1, USR2, TERM or INT")
        names.append(sig.name)
    if not names:
        raise argparse.ArgumentTypeError(f"no signal in {text!r}; use e.g. USR1,TERM")
    return names


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """A usage error prints what was wrong and where the flags are listed, from the first
    rank of the launch only (every rank parses the same command line: N copies of the whole
    usage text buried the one line that mattered), and exits with code 2 on every rank."""
    def error(message: str):
        text = (f"{parser.prog}: error: {message}\n"
                f"{parser.prog}: run `{parser.prog} --help` for the flags\n")
        parser.exit(2, text if is_first_rank() else None)

    parser.error = error  # type: ignore[method-assign]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add hpcadapt's runtime flags to ``parser`` (returned, for chaining). Pass the parsed
    namespace to ``hpcadapt.Job(args)``. A bad flag then ends the process with exit code 2
    and two lines from the launch's first rank only (see ``one_line_errors``)."""
    one_line_errors(parser)
    add_policy_arguments(parser)
    m = parser.add_argument_group("monitoring (computed inside each step)")
    m.add_argument("--monitor", action="append", default=[], choices=list(MONITORS),
                   help="gradient monitor to run (repeatable): gns (noise scale), variance "
                        "(and signal-to-noise ratio); policies switch on what they need")
    m.add_argument("--monitor-interval", type=positive_int,
                   help="compute gradient statistics every N steps")
    m.add_argument("--monitor-ema", type=_fraction_open,
                   help="weight of the newest estimate in the moving averages (at the first "
                        "batch; see --monitor-window)")
    m.add_argument("--monitor-window", type=_non_negative_int, metavar="SAMPLES",
                   help="memory of the noise scale's moving averages in samples: a rising "
                        "noise scale is followed one window late, and the estimate's error "
                        "shrinks as the window grows (0: from --monitor-ema at the first batch)")
    y = parser.add_argument_group("synchronisation strategy (switchable by the sync-switch "
                                  "policy)")
    y.add_argument("--strategy", choices=list(STRATEGIES),
                   help="; ".join(f"{name}: {cls.summary}" for name, cls in STRATEGIES.items()
                                  if cls.summary))
    for name, cls in STRATEGIES.items():  # each strategy's own settings
        defaults = cls.defaults()
        for setting in cls.settings:
            y.add_argument(setting.flag, dest=setting.dest, type=argparse_type(setting.parse),
                           default=defaults[setting.field], metavar=setting.metavar,
                           help=f"{name}: {setting.help}")
    y.add_argument("--topology", choices=[t.value for t in Topology],
                   help="how the gradients' allreduce travels: flat (MPI's own), "
                        "hierarchical (within each node, then one leader per node), ring or "
                        "tree (hpcadapt's own, over point-to-point messages); switchable by "
                        "the topology-auto policy")
    y.add_argument("--ranks-per-node", type=_ranks_per_node, metavar="K",
                   help="pretend nodes of K consecutive ranks (tests and benchmarks on one "
                        "host); default: the real nodes")
    y.add_argument("--broadcast-buffers", action=argparse.BooleanOptionalAction,
                   help="make the model's buffers (BatchNorm's running statistics) rank 0's "
                        "on every rank after every step, as DDP's broadcast_buffers (one "
                        "small broadcast overlapped with the step's exchange); "
                        "--no-broadcast-buffers leaves each replica its own")
    t = parser.add_argument_group("slow ranks on purpose (tests and benchmarks)")
    t.add_argument("--slow-rank", type=_non_negative_int, metavar="RANK",
                   help="the rank that --slow-compute and --slow-comm slow down")
    t.add_argument("--slow-compute", type=_factor, metavar="FACTOR",
                   help="that rank's forward and backward take FACTOR times as long")
    t.add_argument("--slow-comm", type=_factor, metavar="FACTOR",
                   help="that rank's gradient or model exchange takes FACTOR times as long")
    t.add_argument("--slow-until", type=positive_int, metavar="STEP",
                   help="the slow-down ends at this step (a straggler that goes away)")
    s = parser.add_argument_group("steps and memory")
    s.add_argument("--max-steps", type=positive_int,
                   help="stop after this many steps in total")
    s.add_argument("--max-nonfinite-steps", type=positive_int,
                   help="a step whose loss (or monitored gradient) is NaN or infinite is "
                        "skipped; after this many in a row training stops, saving the last "
                        "good state to --checkpoint, with exit code 1")
    s.add_argument("--max-local-batch", type=positive_int,
                   help="most samples one rank puts through forward/backward at once; a "
                        "larger local batch is split into micro-batches whose gradients "
                        "accumulate (so adaptive batch sizes are not capped by memory)")
    s.add_argument("--bucket-bytes", type=positive_int,
                   help="gradient fusion bucket size (default: HPCADAPT_BUCKET_BYTES or 4 MiB)")
    d = parser.add_argument_group("device")
    d.add_argument("--device", choices=["auto", "cpu", "cuda"],
                   help="where each rank trains: auto (a GPU when one is visible, else the "
                        "CPU), cpu, or cuda (one line saying what is missing when it cannot "
                        "be; GPUs need the extra `pip install \"hpcadapt[cuda]\"`)")
    d.add_argument("--data-plane", choices=["auto", "mpi", "host-staged", "nccl"],
                   help="how gradients travel: auto (MPI on the CPU; NCCL on GPUs, or "
                        "host-staged through pinned memory over MPI when ranks share a GPU or "
                        "NCCL is missing), or one of them explicitly")
    e = parser.add_argument_group("elastic workers")
    e.add_argument("--max-workers", type=positive_int,
                   help="allow resizing up to this many workers (local allocator: slots on "
                        "this host; Slurm: one node per added worker); without it the world "
                        "keeps its size")
    e.add_argument("--min-workers", type=positive_int,
                   help="never shrink below this many workers")
    e.add_argument("--initial-workers", type=positive_int,
                   help="train from the first step on this many workers: those the launch "
                        "lacks (e.g. mpiexec -n 1) are started as joined workers before the "
                        "first step, each its own launch, so that any of them that dies is "
                        "recovered from (--on-failure); needs --max-workers")
    e.add_argument("--resume-size", choices=["saved", "launch"],
                   help="on a resume from --checkpoint (a restart, a Slurm requeue): grow back "
                        "to the number of workers the checkpoint was written by (saved; needs "
                        "--max-workers, capped by it) or train at the launch's size (launch)")
    e.add_argument("--allocator", choices=ALLOCATORS,
                   help="where added workers come from: slurm (companion allocations), "
                        "local (this host), auto (slurm inside a Slurm job, else local)")
    e.add_argument("--launcher", choices=list(LAUNCHERS),
                   help="how the local allocator starts a joining worker: process (its own "
                        "mpiexec; a crash cannot hurt the job) or spawn (MPI_Comm_spawn; under "
                        "MPICH run mpiexec with -disable-auto-cleanup)")
    e.add_argument("--join-timeout", type=positive_float,
                   help="seconds a grow may wait for its workers before it is abandoned")
    e.add_argument("--warm-spares", type=_non_negative_int, metavar="K",
                   help="keep K workers started ahead (imports done, model built, data "
                        "loaded), idle until a grow takes them, so that a grow waits for no "
                        "start-up; replaced in the background after each grow. They hold "
                        "slots (Slurm: nodes) while idle; clipped to the allocator's free "
                        "ones. Needs --max-workers")
    e.add_argument("--peer-timeout", type=positive_float,
                   help="a wait on another worker (gradient allreduce, state transfer, a "
                        "join) ends as a failure after max(this, 20 x the median step time) "
                        "when that worker's liveness cannot be seen (another node); a dead "
                        "worker on this node is noticed within about 0.1 s. A failure saves the "
                        "last committed state to --checkpoint and exits with 75 (see --on-failure)")
    e.add_argument("--on-failure", choices=("recover", "stop"),
                   help="when a worker that joined the running job dies: recover (the "
                        "survivors agree on who died, form a world without it, redo the step "
                        "in flight and train on at the smaller size) or stop (save to "
                        "--checkpoint, exit 75 for the job script to requeue). The death of a "
                        "rank of the first launch (mpiexec/srun ends its whole launch) or of "
                        "rank 0 always stops")
    e.add_argument("--replace-failed", action="store_true",
                   help="after recovering from a failure, ask the allocator for as many new "
                        "workers as died; they join stop-free like any grow")
    e.add_argument("--slurm-partition",
                   help="partition for added nodes (default: the job's own)")
    e.add_argument("--slurm-pending-timeout", type=positive_float,
                   help="cancel a node request still pending after this many seconds")
    e.add_argument("--slurm-mpi", choices=["pmi2", "pmix", "none"],
                   help="srun --mpi plugin for added workers (pmi2 for MPICH)")
    e.add_argument("--slurm-grow", choices=["companion", "expand", "auto"],
                   help="how the job gets nodes: companion jobs (any Slurm), job expansion "
                        "(needs SchedulerParameters=permit_job_expansion), or auto (expansion "
                        "where the site permits it)")
    e.add_argument("--resize-batch", choices=list(RESIZE_BATCH),
                   help="on a resize keep the global batch (the local batch changes) or the "
                        "local batch (the global batch changes, with --lr-rule)")
    c = parser.add_argument_group("preemption and requeue")
    c.add_argument("--checkpoint", metavar="PATH",
                   help="on a stop signal save the training state here and exit with code "
                        f"{EXIT_REQUEUE}; when PATH exists at start, resume from it")
    c.add_argument("--checkpoint-every", type=positive_int, metavar="STEPS",
                   help="also save to --checkpoint every STEPS steps (rank 0, at the step "
                        "boundary): what survives a crash that saves nothing (a node lost, "
                        "an MPI library crash)")
    c.add_argument("--stop-signals", type=_signal_list,
                   help="signals that stop training at the next step boundary (saving to "
                        "--checkpoint when given; without it nothing is saved, exit 1); "
                        "Ctrl-C (SIGINT) always does; Slurm: #SBATCH --signal=USR1@120")
    c.add_argument("--stop-file", metavar="PATH",
                   help="end training cleanly (exit 0, as if finished) at the step boundary "
                        "after PATH appears")
    o = parser.add_argument_group("output")
    o.add_argument("--metrics-file", help="write JSON Lines metrics here (rank 0)")
    o.add_argument("--summary-json",
                   help="write the run's summary (final accuracy, steps) here (rank 0)")
    o.add_argument("--no-progress", "--quiet", dest="no_progress", action="store_true",
                   help="no progress: on a terminal a bar (samples done, percent, rate, time "
                        "left) that log lines print above; elsewhere (a Slurm output file) a "
                        "line every --progress-every seconds and one at the end")
    o.add_argument("--progress-every", type=_non_negative_float,
                   metavar="SECONDS",
                   help="off a terminal: a progress line every SECONDS (0: every step)")
    o.add_argument("--check-replicas", action="store_true",
                   help="after every resize, compare a digest of the parameters and buffers "
                        "across ranks and record it in the resize line (costs one pass over "
                        "the model)")
    o.add_argument("--sample-log", metavar="DIR",
                   help="each process appends the sample indices it trains on to DIR (tests)")
    # The flags' defaults are the options' (hpcadapt.base.options), written once there.
    parser.set_defaults(**{name: value for name, value in option_defaults().items()
                           if name not in FLAGLESS_OPTIONS})
    return parser
