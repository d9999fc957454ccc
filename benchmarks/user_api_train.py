"""A user's own training script on hpcadapt's public API, for the user-api benchmark: the
workload of ``python -m hpcadapt.train --model mlp --dataset digits`` (the same MLP, seeded
the same way, the same data, optimizer and loss), written as a user would write it, with the
loop in the script.

    mpiexec -n 2 python benchmarks/user_api_train.py --epochs 15 --metrics-file user.jsonl

Every flag of ``hpcadapt.add_arguments`` works here too (policies, --max-workers, ...)."""

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import hpcadapt
from hpcadapt.datasets import load_dataset


def make_model(hidden=256, classes=10):
    return nn.Sequential(nn.Flatten(),
                         nn.Linear(64, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, classes))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank")
    hpcadapt.add_arguments(parser)
    args = parser.parse_args(argv)

    job = hpcadapt.Job(args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    data = load_dataset("digits", seed=args.seed)
    torch.manual_seed(args.seed)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loader = hpcadapt.ElasticDataLoader(TensorDataset(data.x_train, data.y_train),
                                        args.batch_size, seed=args.seed)
    loss_fn = nn.CrossEntropyLoss()
    job.setup(model, optimizer, loader)

    for _ in job.epochs(args.epochs):
        for x, y in loader:
            job.step(loss_fn(model(x), y))
        job.log_epoch(test_accuracy=hpcadapt.evaluate_accuracy(model, data.x_test, data.y_test))
    job.finish()


if __name__ == "__main__":
    main()
