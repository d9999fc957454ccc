"""The torchrun side of the resize benchmark: the same model trained with DDP (gloo) under
torch.distributed.elastic, checkpointing so that a restarted generation reloads and goes on.
Every step appends {generation, rank, step, t} to --log (with --log-pid also the worker's
pid, for the failure benchmark to kill one)."""

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
    ap.add_argument("--log-pid", action="store_true", help="add the worker's pid to each line")
    ap.add_argument("--store-per-generation", action="store_true",
                    help="keys of the agent's store under a prefix per restart: after an "
                         "in-place restart (--max-restarts) gloo otherwise read the dead "
                         "generation's addresses and failed with 'connection refused'")
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.store_per_generation and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        world = int(os.environ["WORLD_SIZE"])
        store = dist.PrefixStore(f"/failure-bench/gen{gen}", dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False))
        dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]),
                                world_size=world)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
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
        t_start = time.time()
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        step += 1
        line = {"gen": gen, "rank": rank, "step": step, "t": time.time(), "t_start": t_start,
                "world": dist.get_world_size()}
        if args.log_pid:
            line["pid"] = os.getpid()
        with open(args.step_log, "a") as f:
            f.write(json.dumps(line) + "\n")
        if rank == 0 and step % args.save_every == 0:
            tmp = args.checkpoint + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, args.checkpoint)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
