"""AdamW with a LambdaLR warm-up stepped after every ``job.step``: writes, for every batch,
the rates the update used (read from the optimizer just before ``job.step``) and the job's
progress values to ``--out`` (rank 0), for the tests that the metrics log the optimizer's
own numbers and that the progress values are right."""

import hpcadapt

hpcadapt.block_stop_signals()

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    hpcadapt.add_arguments(parser)
    args = parser.parse_args()
    job = hpcadapt.Job(args)
    data = hpcadapt.datasets.load_dataset("digits")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    head = list(model[3].parameters())
    body = list(model[1].parameters())
    optimizer = torch.optim.AdamW([{"params": body}, {"params": head, "lr": 0.001}],
                                  lr=0.003, betas=(0.8, 0.99))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50))
    loader = hpcadapt.ElasticDataLoader(torch.utils.data.TensorDataset(data.x_train,
                                                                       data.y_train), 64)
    job.setup(model, optimizer, loader, extra={"scheduler": scheduler})
    used = []
    for _ in job.epochs(1):
        for x, y in loader:
            used.append({"lrs": [g["lr"] for g in optimizer.param_groups],
                         "global": job.global_batch_size, "local": job.local_batch_size,
                         "loader_batch": loader.batch_size,
                         "accumulation": job.accumulation_steps, "seen": job.samples_seen,
                         "epochs": job.epoch_progress, "steps": job.scale_invariant_steps,
                         "size": len(loader.dataset)})
            if job.step(nn.functional.cross_entropy(model(x), y)):
                scheduler.step()  # once per step, also with micro-batches
    job.finish()
    if job.rank == 0:
        with open(args.out, "w") as f:
            json.dump(used, f)


if __name__ == "__main__":
    main()
