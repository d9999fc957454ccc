"""A user's script with everything a recovery must leave as if nothing had happened: a
counter in ``job.extra``, a cosine LR scheduler stepped after every ``job.step``, an EMA of
the model and a BatchNorm model. At the end each rank writes what it holds to
``RESULT_DIR/rank<R>.json`` (the failure-rollback test compares them across ranks and with
an uninterrupted run)."""

import hpcadapt

hpcadapt.block_stop_signals()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402


def digest(tensors):
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--num-workers", type=int, default=0, help="the loader's workers "
                        "(persistent: they live across epochs, resizes and recoveries)")
    hpcadapt.add_arguments(parser)
    args = parser.parse_args()
    job = hpcadapt.Job(args)
    data = hpcadapt.datasets.load_dataset("digits")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(),
                          nn.Dropout(0.1), nn.Linear(32, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = hpcadapt.ElasticDataLoader(torch.utils.data.TensorDataset(data.x_train,
                                                                       data.y_train), 48,
                                        num_workers=args.num_workers)
    total = args.epochs * len(loader)  # steps (len: steps per epoch, as torch)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    job.setup(model, optimizer, loader,
              extra={"updates": 0, "scheduler": scheduler, "ema": ema})
    body_runs = 0  # a plain local variable: not the job's to undo
    for _ in job.epochs(args.epochs):
        for x, y in loader:
            job.step(nn.functional.cross_entropy(model(x), y))
            ema.update_parameters(model)
            scheduler.step()
            job.extra["updates"] += 1
            body_runs += 1
    summary = job.finish(exit=False)
    path = os.path.join(args.result_dir, f"rank{job.rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": job.rank, "size": job.size, "step_count": job.step_count,
                   "updates": job.extra["updates"], "last_epoch": scheduler.last_epoch,
                   "body_runs": body_runs, "lr": optimizer.param_groups[0]["lr"],
                   "ema": digest(ema.state_dict().values()),
                   "buffers": digest(model.buffers()), "params": digest(model.parameters()),
                   "steps": summary["steps"]}, f)
    os.replace(path + ".tmp", path)  # whole, for a test that waits for it
    return job.exit_code  # 75 after a stop with the state saved: the job script requeues


if __name__ == "__main__":
    raise SystemExit(main())
