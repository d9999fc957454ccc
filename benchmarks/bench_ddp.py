"""Training throughput: hpcadapt's DistributedOptimizer vs torch DDP on gloo, same model,
data and per-rank batch, measured in alternating rounds in one run."""

import argparse
import sys
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hpcadapt
from hpcadapt.models import build_model, count_parameters
from common import init_gloo, interleaved, median, single_thread, write_result
from launch import quick_defaults

MODELS = {
    # about 10M parameters: communication matters
    "mlp": dict(name="mlp", options=dict(hidden=[2048, 2048])),
    "cnn": dict(name="cnn", options=dict(width=32)),
}


def make_step(model, opt, x, y):
    loss_fn = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return step


def throughput(step, steps, batch, comm):
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    return batch * comm.size * steps / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    quick_defaults(ap, sys.argv[1:], steps=3, rounds=2)
    args = ap.parse_args()
    single_thread()
    w = hpcadapt.init()
    raw = MPI.COMM_WORLD.Dup()
    init_gloo(raw)
    rows, ratios = {}, {}
    for key, spec in MODELS.items():
        shape = (3, 32, 32)
        g = torch.Generator().manual_seed(w.rank)
        x = torch.randn(args.batch, *shape, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        m_hpc = build_model(spec["name"], shape, 10, seed=0, **spec["options"])
        m_ddp = build_model(spec["name"], shape, 10, seed=0, **spec["options"])
        opt_hpc = hpcadapt.DistributedOptimizer(
            torch.optim.SGD(m_hpc.parameters(), lr=0.01, momentum=0.9),
            m_hpc.named_parameters(), world=w)
        ddp = DDP(m_ddp)
        opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        steps = {"hpcadapt": make_step(m_hpc, opt_hpc, x, y), "torch_ddp": make_step(ddp, opt_ddp, x, y)}
        for s in steps.values():
            for _ in range(3):
                s()
        res = interleaved({k: (lambda s=s: throughput(s, args.steps, args.batch, raw))
                           for k, s in steps.items()}, args.rounds)
        rows[key] = {"parameters": count_parameters(m_hpc),
                     **{k: {"samples_per_s": median(v)} for k, v in res.items()}}
        ratios[f"hpcadapt_vs_torch_ddp_{key}"] = (rows[key]["hpcadapt"]["samples_per_s"]
                                                  / rows[key]["torch_ddp"]["samples_per_s"])
        opt_hpc.remove_hooks()
    if w.rank == 0:
        write_result(args.out, {"benchmark": "ddp", "world_size": w.size, "per_rank_batch":
                                args.batch, "rows": rows, "ratios": ratios})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
