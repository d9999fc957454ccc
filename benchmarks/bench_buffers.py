"""The per-step cost of keeping the buffers consistent (rank 0's BatchNorm statistics to
every rank after every step) on the BatchNorm CNN: steps with and without the broadcast,
side by side in one run.

Blocks of ``--steps`` S-SGD steps alternate between a ``DistributedOptimizer`` given the
model's buffers and one without (the same model, rewrapped per block; rounds rotate the
order so that drift on a shared machine hits both alike). Each block's median step time is
the slowest rank's; the medians over ``--rounds`` blocks are printed as JSON with their
ratio (and the median of each round's own ratio), and the broadcast's own cost (keep, pack,
broadcast, wait, unpack: not overlapped with anything, the slowest rank's median over 200),
an upper bound of what it adds to a step. On a busy machine compare with the same run's
spread: ratios of a few percent either way are noise there. Run:
``mpiexec -n 2 python benchmarks/bench_buffers.py``."""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hpcadapt  # noqa: E402
from common import interleaved  # noqa: E402
from hpcadapt.comm.collectives import MPICommunicator  # noqa: E402
from hpcadapt.models import build_model  # noqa: E402
from hpcadapt.parallel.optimizer import BufferBroadcast  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per block")
    ap.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--image", type=int, default=32, help="input side (3 x N x N)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    w = hpcadapt.init()
    model = build_model("cnn", (3, args.image, args.image), 10, width=args.width,
                        batch_norm=True)
    base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(w.rank)
    x = torch.randn(args.batch, 3, args.image, args.image, generator=gen)
    y = torch.randint(0, 10, (args.batch,), generator=gen)

    def block(buffers: bool) -> float:
        opt = hpcadapt.DistributedOptimizer(base, model.named_parameters(), world=w,
                                            buffers=model.buffers() if buffers else ())
        times = []
        for i in range(args.steps + 2):  # 2 warm-up steps
            t0 = time.perf_counter()
            opt.begin_step(i)  # as the job does: keeps the buffers as the step starts
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        opt.remove_hooks()
        return w.comm.allreduce(statistics.median(times[2:]), op=MPI.MAX)

    alone = BufferBroadcast(list(model.buffers()), torch.device("cpu"))
    comm = MPICommunicator(w)
    exchange = []
    for _ in range(200):
        w.comm.Barrier()
        t0 = time.perf_counter()
        alone.keep()
        alone.start(comm)
        alone.finish(w.rank)
        alone.step_done()
        exchange.append(time.perf_counter() - t0)
    exchange_s = w.comm.allreduce(statistics.median(exchange), op=MPI.MAX)
    results = interleaved({"with_buffers": lambda: block(True),
                           "without_buffers": lambda: block(False)}, args.rounds)
    if w.rank == 0:
        with_s = statistics.median(results["with_buffers"])
        without_s = statistics.median(results["without_buffers"])
        nbytes = sum(b.numel() * b.element_size() for b in model.buffers())
        print(json.dumps({"ranks": w.size, "buffers": len(list(model.buffers())),
                          "buffer_bytes": nbytes,
                          "parameters": sum(p.numel() for p in model.parameters()),
                          "batch_per_rank": args.batch, "rounds": args.rounds,
                          "steps_per_block": args.steps,
                          "step_s_with_buffers": with_s, "step_s_without_buffers": without_s,
                          "ratio": with_s / without_s,
                          "paired_ratio_median": statistics.median(
                              a / b for a, b in zip(results["with_buffers"],
                                                    results["without_buffers"])),
                          "buffer_exchange_alone_s": exchange_s}))


if __name__ == "__main__":
    main()
