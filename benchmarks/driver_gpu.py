"""gpu: hpcadapt's data plane on one GPU, measured side by side in one run.

1. Training step of the 25.7M-parameter MLP (batch 256 of random 3x32x32 inputs on the
   GPU, SGD with momentum): hpcadapt's DistributedOptimizer over NCCL against torch's
   DistributedDataParallel on the NCCL process group, both at world size 1; rounds alternate
   the two, each round times ``--steps`` steps after a warm-up (torch.cuda.synchronize()
   around), and the ratio is of the median samples/s (``hpcadapt_vs_torch_ddp_gpu``).
2. The same hpcadapt loop with the noise-scale statistics every step (track_grad_norms) vs
   off: ``gpu_gns_every_step_throughput`` = on / off.
3. Allreduce bandwidth of float32 CUDA tensors from 1 MB to 256 MB, NCCL vs host-staged
   (pinned host buffers over MPI): GB/s per size and ``nccl_vs_host_staged_allreduce_<N>MB``.

Without a GPU, CuPy or NCCL it says what is missing in one line and exits non-zero."""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from typing import Callable, Dict, List

BIG = [4096, 2560, 1024]
SIZES_MB = [1, 4, 16, 64, 256]


def _require_gpu() -> None:
    from hpcadapt.cuda.device import INSTALL_HINT, gpu_problems

    problems = gpu_problems()
    if problems:
        raise SystemExit(f"gpu benchmark: {'; '.join(problems)}; {INSTALL_HINT}")


def _model(torch):
    from hpcadapt.models import build_model

    torch.manual_seed(0)
    return build_model("mlp", (3, 32, 32), 10, hidden=BIG).cuda()


def _throughput(torch, step: Callable[[], None], steps: int, batch: int) -> float:
    """samples/s of ``steps`` calls of ``step`` (the device drained before and after)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return steps * batch / (time.perf_counter() - t0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def training(torch, steps: int, rounds: int, batch: int) -> Dict[str, List[float]]:
    """samples/s per round: hpcadapt (monitors off and on) and DDP, alternating."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import hpcadapt

    x = torch.randn(batch, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (batch,), device="cuda")
    loss_fn = torch.nn.CrossEntropyLoss()

    ours = _model(torch)
    opt = hpcadapt.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.01,
                                                        momentum=0.9),
                                        ours.named_parameters(), data_plane="nccl")

    def hpcadapt_step():
        opt.zero_grad()
        loss_fn(ours(x), y).backward()
        opt.step()

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    ddp = DistributedDataParallel(_model(torch), device_ids=[0])
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    def ddp_step():
        ddp_opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        ddp_opt.step()

    out: Dict[str, List[float]] = {"hpcadapt": [], "hpcadapt_gns": [], "ddp": []}
    for step in (hpcadapt_step, ddp_step):
        for _ in range(5):
            step()
    for r in range(rounds):
        order = ["hpcadapt", "ddp", "hpcadapt_gns"] if r % 2 == 0 else \
            ["hpcadapt_gns", "ddp", "hpcadapt"]
        for name in order:
            opt.track_grad_norms = name == "hpcadapt_gns"
            step = ddp_step if name == "ddp" else hpcadapt_step
            out[name].append(_throughput(torch, step, steps, batch))
    dist.destroy_process_group()
    opt.remove_hooks()
    return out


def bandwidth(torch, repeats: int = 5) -> Dict[str, Dict[str, float]]:
    """GB/s of an allreduce per size, NCCL vs host-staged (median of ``repeats``)."""
    from mpi4py import MPI

    import hpcadapt
    from hpcadapt.cuda.nccl import NCCLCommunicator
    from hpcadapt.cuda.staged import HostStagedCommunicator

    nccl = NCCLCommunicator(MPI.COMM_SELF, 0)
    staged = HostStagedCommunicator(hpcadapt.communicator())
    rows = {}
    for mb in SIZES_MB:
        x = torch.ones(mb * 1024 * 1024 // 4, device="cuda")
        row = {}
        for name, comm in (("nccl", nccl), ("host_staged", staged)):
            times = []
            for _ in range(repeats + 1):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                comm.allreduce_async(x).wait()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            row[f"{name}_GBps"] = mb / 1024 / statistics.median(times[1:])
        rows[f"allreduce {mb} MB"] = row
    nccl.destroy()
    return rows


def run(name, extra):
    ap = argparse.ArgumentParser(prog=f"run.py {name}")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args(extra)
    if args.device != "cuda":
        raise SystemExit("gpu benchmark: --device cpu has nothing to measure here; the CPU "
                         "path is the ddp and allreduce benchmarks")
    _require_gpu()
    import cupy
    import torch

    import hpcadapt

    hpcadapt.init()
    speeds = training(torch, args.steps, args.rounds, args.batch_size)
    med = {k: statistics.median(v) for k, v in speeds.items()}
    rows = {f"train {k}": {"samples_per_s": v} for k, v in med.items()}
    bw = bandwidth(torch)
    rows.update(bw)
    ratios = {"hpcadapt_vs_torch_ddp_gpu": med["hpcadapt"] / med["ddp"],
              "gpu_gns_every_step_throughput": med["hpcadapt_gns"] / med["hpcadapt"]}
    for label, row in bw.items():
        mb = label.split()[1]
        ratios[f"nccl_vs_host_staged_allreduce_{mb}MB"] = \
            row["nccl_GBps"] / row["host_staged_GBps"]
    return {"benchmark": "gpu", "rows": rows, "ratios": ratios,
            "gpu": torch.cuda.get_device_name(0),
            "versions": {"torch": torch.__version__, "cupy": cupy.__version__,
                         "nccl": int(cupy.cuda.nccl.get_version())}}
