"""The torchrun side of the resize benchmark: the same model trained with DDP (gloo) under
torch.distributed.elastic, checkpointing so that a restarted generation reloads and goes on.
Every step appends {generation, rank, step, t} to --log."""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpcadapt.models import build_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-log", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--hidden", default="4096,2560,1024")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--save-every", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = build_model("mlp", (3, 32, 32), 10, hidden=[int(h) for h in args.hidden.split(",")])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = 0
    if os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = int(state["step"])
    ddp = DDP(model)
    x = torch.randn(16, 3, 32, 32)
    y = torch.randint(0, 10, (16,))
    while step < args.steps:
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        step += 1
        with open(args.step_log, "a") as f:
            f.write(json.dumps({"gen": gen, "rank": rank, "step": step, "t": time.time(),
                                "world": dist.get_world_size()}) + "\n")
        if rank == 0 and step % args.save_every == 0:
            tmp = args.checkpoint + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, args.checkpoint)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
