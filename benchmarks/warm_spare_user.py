"""The resize benchmark's warm-spare run: the built-in MLP on synthetic images (as
``hpcadapt.train --model mlp --dataset synthetic``), one rank with ``--warm-spares 1``, grown
to 2 when the driver's grow file appears. The driver writes it once the spare reports warm,
so the grow waits for that event, not for a step count that a slow start-up could miss."""

import hpcadapt

hpcadapt.block_stop_signals()

import argparse  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from hpcadapt.datasets import load_dataset  # noqa: E402
from hpcadapt.models import build_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--grow-file", required=True)
    parser.add_argument("--hidden", default="256,256")
    hpcadapt.add_arguments(parser)
    args = parser.parse_args()
    job = hpcadapt.Job(args)
    torch.set_num_threads(1)
    data = load_dataset("synthetic", num_samples=1024)
    model = build_model("mlp", data.input_shape, data.num_classes,
                        hidden=[int(h) for h in args.hidden.split(",")])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loader = hpcadapt.ElasticDataLoader(TensorDataset(data.x_train, data.y_train), 32)
    job.setup(model, optimizer, loader)
    for _ in job.epochs(100000):
        for x, y in loader:
            job.step(nn.functional.cross_entropy(model(x), y))
            # one rank asks, at a step boundary of its own
            if job.world.size == 1 and os.path.exists(args.grow_file):
                os.unlink(args.grow_file)
                job.request_resize(2, "the benchmark's grow file")
    job.finish()


if __name__ == "__main__":
    main()
