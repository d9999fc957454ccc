"""Your own model, Dataset, optimizer, loss and state, trained adaptively by hpcadapt.

    mpiexec -n 2 python examples/mnist1d_adamw.py --epochs 10 \
        --policy gns-batch --gns-batch-max 512 --lr-rule sqrt --metrics-file run.jsonl

With --cosine the learning rate follows a cosine over the run, keyed on progress in samples
(hpcadapt.ProgressLR), so that it ends where it should however gns-batch grows the batch:

    mpiexec -n 2 python examples/mnist1d_adamw.py --epochs 10 --cosine \
        --policy gns-batch --gns-batch-max 512 --metrics-file run.jsonl

Every flag of `hpcadapt.add_arguments` works here as on `python -m hpcadapt.train`: policies,
monitors, --max-workers (growing and shrinking: see elastic.sh), --checkpoint (preemption),
--device (a GPU per rank when there is one). --amp trains in mixed precision (autocast and a
gradient scaler: float16 on a GPU, bfloat16 on the CPU).
"""

import hpcadapt

# First, before torch loads (seconds): a stop signal from Slurm during start-up waits for the
# job's handlers instead of killing the process.
hpcadapt.block_stop_signals()

import argparse  # noqa: E402
import copy  # noqa: E402
import math  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from hpcadapt.datasets import load_dataset  # noqa: E402


class MNIST1D(Dataset):
    """One (signal, label) pair per index, as a user's own Dataset would give it."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def collate(samples):
    xs, ys = zip(*samples)
    return torch.stack(xs), torch.tensor(ys)


class ConvNet(nn.Module):
    """A small 1-D CNN (the shape of Greydanus' MNIST-1D baseline)."""

    def __init__(self, width=32, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(1, width, 5, padding=2), nn.ReLU(),
            nn.Conv1d(width, width, 3, padding=1, stride=2), nn.ReLU(),
            nn.Conv1d(width, width, 3, padding=1, stride=2), nn.ReLU())
        self.head = nn.Linear(width * 10, classes)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--samples", type=int, default=5000, help="MNIST-1D samples in all")
    parser.add_argument("--workers", type=int, default=2, help="loader worker processes")
    parser.add_argument("--amp", action="store_true", help="mixed precision")
    parser.add_argument("--cosine", action="store_true",
                        help="cosine learning-rate decay over the run, by samples seen")
    parser.add_argument("--amp-init-scale", type=float, default=2.0 ** 16,
                        help="the gradient scaler's first loss scale")
    hpcadapt.add_arguments(parser)             # --policy, --max-workers, --checkpoint, ...
    args = parser.parse_args()

    job = hpcadapt.Job(args)
    torch.manual_seed(0)
    data = load_dataset("mnist1d", seed=0, num_samples=args.samples)
    device = job.device                        # this rank's GPU, or the CPU
    model = ConvNet().to(device)
    ema = copy.deepcopy(model)                 # EMA weights: extra state of our own
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    loader = hpcadapt.ElasticDataLoader(MNIST1D(data.x_train, data.y_train), args.batch_size,
                                        num_workers=args.workers, collate_fn=collate)
    half = torch.float16 if device.type == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, init_scale=args.amp_init_scale,
                                  enabled=args.amp)
    extra = {"ema": ema, "updates": 0, "scaler": scaler}
    if args.cosine:
        # Written in steps at the starting batch; ProgressLR steps it by samples seen.
        total = args.epochs * math.ceil(len(data.x_train) / args.batch_size)
        extra["schedule"] = hpcadapt.ProgressLR(
            torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total), job)
    # the scaler's loss scale and the schedule travel with resizes and checkpoints, like
    # the EMA weights; after a recovered failure they are as if it had not happened
    job.setup(model, optimizer, loader, extra=extra)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=0.05)
    x_test, y_test = data.x_test.to(device), data.y_test.to(device)

    for epoch in job.epochs(args.epochs):
        for x, y in loader:                    # this rank's share of the global batch
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=half, enabled=args.amp):
                loss = loss_fn(model(x), y)
            if not job.step(loss, scaler=scaler):   # backward, allreduce, AdamW step
                continue                       # a micro-batch (--max-local-batch) or a step
                                               # a failure gave up: no update to follow
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.05)
            job.extra["updates"] += 1
            if args.cosine:
                job.extra["schedule"].step()
        job.log_epoch(test_accuracy=hpcadapt.evaluate_accuracy(model, x_test, y_test),
                      ema_accuracy=hpcadapt.evaluate_accuracy(ema, x_test, y_test))
    job.finish()                               # prints the summary; exit 75 after a stop signal


if __name__ == "__main__":
    main()
