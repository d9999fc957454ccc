"""A user's own script as docs/guides/own-script.md writes it (own model, optimizer and
loader, the job's flags on its own parser): the flag-combination matrix runs it beside the
entry point."""

import hpcadapt

hpcadapt.block_stop_signals()

import argparse  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    hpcadapt.add_arguments(parser)
    args = parser.parse_args()
    job = hpcadapt.Job(args)
    data = hpcadapt.datasets.load_dataset("digits")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = hpcadapt.ElasticDataLoader(torch.utils.data.TensorDataset(data.x_train,
                                                                       data.y_train), 32)
    job.setup(model, optimizer, loader)
    for _ in job.epochs(args.epochs):
        for x, y in loader:
            job.step(nn.functional.cross_entropy(model(x), y))
    job.finish()  # rank 0 prints the summary as one line of JSON


if __name__ == "__main__":
    main()
