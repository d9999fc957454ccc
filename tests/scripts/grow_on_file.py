"""A user script that grows from 1 to 2 workers when a file appears (checked at each epoch's
end while it runs alone, so every rank, i.e. the one, asks at the same point): the warm-spare
test triggers its grow on an event (a spare reported warm), not on a step count."""

import hpcadapt

hpcadapt.block_stop_signals()

import argparse  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--grow-file", required=True)
    hpcadapt.add_arguments(parser)
    args = parser.parse_args()
    job = hpcadapt.Job(args)
    data = hpcadapt.datasets.load_dataset("digits")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = hpcadapt.ElasticDataLoader(torch.utils.data.TensorDataset(data.x_train,
                                                                       data.y_train), 32)
    job.setup(model, optimizer, loader)
    for _ in job.epochs(100000):
        for x, y in loader:
            job.step(nn.functional.cross_entropy(model(x), y))
        if job.world.size == 1 and os.path.exists(args.grow_file):
            os.unlink(args.grow_file)
            job.request_resize(2, "the test's grow file")
    job.finish()


if __name__ == "__main__":
    main()
