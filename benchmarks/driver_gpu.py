"""gpu: hpcadapt's GPU data plane on one GPU (world size 1), measured side by side in one run.

What is measured, and how:

1. Training throughput of the 25.7M-parameter MLP (``build_model("mlp", (3, 32, 32), 10,
   hidden=[4096, 2560, 1024])``; a fixed batch of ``--batch-size`` random inputs and labels
   already on the GPU; SGD, momentum 0.9): hpcadapt's ``DistributedOptimizer`` with
   ``data_plane="nccl"`` against torch's ``DistributedDataParallel`` on the NCCL process
   group. Each contender is warmed up, then ``--rounds`` rounds each time ``--steps`` steps
   of every contender in rotating order, with ``torch.cuda.synchronize()`` before starting
   and before stopping the clock. Ratio of the median samples/s:
   ``hpcadapt_vs_torch_ddp_gpu`` = hpcadapt / DDP.
2. The same hpcadapt loop with the noise-scale statistics every step
   (``opt.track_grad_norms = True``) as a third contender of those rounds:
   ``gpu_gns_every_step_throughput`` = on / off.
3. Allreduce bandwidth of float32 CUDA tensors of 1, 4, 16, 64 and 256 MB, NCCL
   (``hpcadapt.cuda.nccl.NCCLCommunicator`` over ``MPI.COMM_SELF``) vs host-staged
   (``hpcadapt.cuda.staged.HostStagedCommunicator``: pinned host buffers over MPI): the
   median time of ``allreduce_async(x).wait()`` plus a device synchronize, as GB/s
   (10^9 bytes of the tensor per second) per size and path, and
   ``nccl_vs_host_staged_allreduce_<N>MB`` = NCCL / host-staged.
4. The GPU's name and the torch, CUDA, CuPy and NCCL versions go into the result.

At world size 1 no bytes cross between GPUs: NCCL's allreduce is a copy on the device and
the host-staged one is the device-to-host and host-to-device copies around MPI, so (3) is
the cost of staging through the host, and (1) compares the two libraries' per-step
overheads around the same model.

No timed assertions: the numbers are reported, not judged. ``--device cpu`` is refused in
one line; without a GPU, CuPy or NCCL the benchmark says what is missing and how to install
it in one line and exits non-zero (``raise SystemExit(message)``: no traceback).

``--quick``: an MLP of 1024,1024 hidden units (4.2M parameters), 1 warm-up step, 2 rounds
of 2 steps at batch 16, allreduces of 1 and 4 MB, 2 repeats. Where no
GPU is usable, ``--quick`` runs the same code on the CPU instead (hpcadapt's MPI data plane
against DDP on gloo; host-staged against MPI's own allreduce of CPU tensors): it checks
that the benchmark runs, and says so in its result (``"device": "cpu"``, ``"cpu_fallback"``:
why); the ratios that need NCCL are n/a and the others measure the CPU, not a GPU."""

from __future__ import annotations

import argparse
import time
from typing import Callable, Dict, List

from common import free_port, interleaved, median
from launch import quick_defaults

HIDDEN = [4096, 2560, 1024]
INPUT_SHAPE = (3, 32, 32)
CLASSES = 10
SIZES_MB = [1, 4, 16, 64, 256]
WARMUP_STEPS = 5
ALLREDUCE_REPEATS = 5


def parse_args(name: str, extra: List[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=f"run.py {name}")
    ap.add_argument("--device", default="cuda",
                    help="cuda (the default and the only choice: cpu is refused)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round (20)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of every contender; medians are reported (5)")
    ap.add_argument("--batch-size", type=int, default=256, help="samples per step (256)")
    ap.add_argument("--hidden", default=",".join(map(str, HIDDEN)),
                    help="the MLP's hidden layers (4096,2560,1024: 25.7M parameters)")
    ap.add_argument("--warmup", type=int, default=WARMUP_STEPS,
                    help=f"untimed steps of each contender first ({WARMUP_STEPS})")
    quick_defaults(ap, extra, steps=2, rounds=2, batch_size=16, hidden="1024,1024", warmup=1)
    args = ap.parse_args(extra)
    args.hidden = [int(h) for h in args.hidden.split(",")]
    if args.device != "cuda":
        raise SystemExit(f"gpu benchmark: --device {args.device} is refused: it measures "
                         "a GPU (the CPU is measured by the ddp and allreduce benchmarks)")
    if min(args.steps, args.rounds, args.batch_size) < 1:
        raise SystemExit("gpu benchmark: --steps, --rounds and --batch-size must be >= 1")
    return args


def require_gpu() -> None:
    """One line saying what is missing and how to install it, unless all is there."""
    from hpcadapt.cuda.device import INSTALL_HINT, gpu_problems

    problems = gpu_problems()
    if problems:
        raise SystemExit(f"gpu benchmark: {'; '.join(problems)}; {INSTALL_HINT}")


def sync(torch, device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_mlp(torch, device, hidden: List[int] = HIDDEN):
    from hpcadapt.models import build_model

    torch.manual_seed(0)  # both contenders start from the same weights
    return build_model("mlp", INPUT_SHAPE, CLASSES, hidden=hidden).to(device)


def sgd(torch, model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def training_step(torch, model, optimizer, x, y) -> Callable[[], None]:
    """One step: zero the gradients, forward, backward, optimizer step."""
    loss_fn = torch.nn.CrossEntropyLoss()

    def step() -> None:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    return step


def samples_per_s(torch, device, step: Callable[[], None], steps: int, batch: int) -> float:
    sync(torch, device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(torch, device)
    return steps * batch / (time.perf_counter() - t0)


def training(torch, device, steps: int, rounds: int, batch: int, *, plane: str = "nccl",
             backend: str = "nccl", hidden: List[int] = HIDDEN,
             warmup: int = WARMUP_STEPS) -> Dict[str, List[float]]:
    """samples/s per round of hpcadapt (noise-scale statistics off and on) and DDP.

    ``plane``/``backend``: hpcadapt's data plane and torch.distributed's backend (NCCL on
    the GPU; "mpi"/"gloo" let the same code run on the CPU)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import hpcadapt

    x = torch.randn(batch, *INPUT_SHAPE, device=device)
    y = torch.randint(0, CLASSES, (batch,), device=device)

    ours = build_mlp(torch, device, hidden)
    opt = hpcadapt.DistributedOptimizer(sgd(torch, ours), ours.named_parameters(),
                                        data_plane=plane)
    ours_step = training_step(torch, ours, opt, x, y)

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    ddp = DistributedDataParallel(build_mlp(torch, device, hidden),
                                  device_ids=[device.index] if device.type == "cuda" else None)
    ddp_step = training_step(torch, ddp, sgd(torch, ddp), x, y)

    def hpcadapt_with(gns: bool) -> Callable[[], None]:
        def step() -> None:
            opt.track_grad_norms = gns
            ours_step()
        return step

    steps_of = {"hpcadapt": hpcadapt_with(False), "hpcadapt_gns": hpcadapt_with(True),
                "ddp": ddp_step}
    try:
        for step in steps_of.values():
            for _ in range(warmup):
                step()
        return interleaved({name: (lambda s=step: samples_per_s(torch, device, s, steps, batch))
                            for name, step in steps_of.items()}, rounds)
    finally:
        opt.remove_hooks()
        dist.destroy_process_group()


def allreduce_seconds(torch, device, comm, x, repeats: int) -> float:
    """Median seconds of one allreduce of ``x`` until its result is on the device (the
    first, untimed call builds buffers)."""
    times = []
    for _ in range(repeats + 1):
        sync(torch, device)
        t0 = time.perf_counter()
        comm.allreduce_async(x).wait()
        sync(torch, device)
        times.append(time.perf_counter() - t0)
    return median(times[1:])


def bandwidth(torch, device, paths: Dict[str, object], sizes_mb: List[int] = SIZES_MB,
              repeats: int = ALLREDUCE_REPEATS) -> Dict[str, Dict[str, float]]:
    """Rows ``allreduce <N> MB`` of GB/s per path (``paths``: name -> communicator)."""
    rows = {}
    for mb in sizes_mb:
        nbytes = mb * 1024 * 1024
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        rows[f"allreduce {mb} MB"] = {
            f"{name}_GBps": nbytes / 1e9 / allreduce_seconds(torch, device, comm, x, repeats)
            for name, comm in paths.items()}
        del x
    return rows


def gpu_allreduce_paths(torch, device) -> Dict[str, object]:
    """NCCL over MPI.COMM_SELF, and host-staged over hpcadapt's MPI communicator."""
    from mpi4py import MPI

    import hpcadapt
    from hpcadapt.cuda.nccl import NCCLCommunicator
    from hpcadapt.cuda.staged import HostStagedCommunicator

    return {"nccl": NCCLCommunicator(MPI.COMM_SELF, device.index),
            "host_staged": HostStagedCommunicator(hpcadapt.communicator())}


def versions(torch) -> Dict[str, object]:
    import cupy
    import cupy.cuda.nccl

    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "cupy": cupy.__version__, "nccl": int(cupy.cuda.nccl.get_version())}


def ratios_of(train: Dict[str, float], bw_rows: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    ratios = {"hpcadapt_vs_torch_ddp_gpu": train["hpcadapt"] / train["ddp"],
              "gpu_gns_every_step_throughput": train["hpcadapt_gns"] / train["hpcadapt"]}
    for label, row in bw_rows.items():
        mb = label.split()[1]
        ratios[f"nccl_vs_host_staged_allreduce_{mb}MB"] = \
            row["nccl_GBps"] / row["host_staged_GBps"]
    return ratios


QUICK_SIZES_MB = [1, 4]
QUICK_ALLREDUCE_REPEATS = 2


def run_on_cpu(args, why: str) -> dict:
    """--quick without a usable GPU: the same measurements of CPU tensors (hpcadapt's MPI
    plane vs DDP on gloo; host-staged vs MPI's allreduce), NCCL's ratios n/a."""
    import torch

    import hpcadapt
    from hpcadapt.cuda.staged import HostStagedCommunicator

    print(f"gpu benchmark: no GPU ({why}): --quick runs its CPU fallback", flush=True)
    hpcadapt.init()
    device = torch.device("cpu")
    per_round = training(torch, device, args.steps, args.rounds, args.batch_size,
                         plane="mpi", backend="gloo", hidden=args.hidden, warmup=args.warmup)
    train = {k: median(v) for k, v in per_round.items()}
    paths = {"host_staged": HostStagedCommunicator(hpcadapt.communicator()),
             "mpi": hpcadapt.communicator()}
    bw_rows = bandwidth(torch, device, paths, QUICK_SIZES_MB, QUICK_ALLREDUCE_REPEATS)
    paths["host_staged"].release()
    ratios = {"hpcadapt_vs_torch_ddp_gpu": train["hpcadapt"] / train["ddp"],
              "gpu_gns_every_step_throughput": train["hpcadapt_gns"] / train["hpcadapt"]}
    ratios.update({f"nccl_vs_host_staged_allreduce_{mb}MB": None for mb in QUICK_SIZES_MB})
    rows = {f"train {k} (cpu)": {"samples_per_s": v} for k, v in train.items()}
    rows.update({f"{k} (cpu)": v for k, v in bw_rows.items()})
    return {"benchmark": "gpu", "device": "cpu", "cpu_fallback": why, "rows": rows,
            "ratios": ratios, "samples_per_s_per_round": per_round,
            "versions": {"torch": torch.__version__},
            "settings": {"world_size": 1, "model": "mlp", "hidden": args.hidden,
                         "batch_size": args.batch_size, "steps": args.steps,
                         "rounds": args.rounds, "warmup_steps": args.warmup,
                         "sizes_mb": QUICK_SIZES_MB, "allreduce_repeats": QUICK_ALLREDUCE_REPEATS,
                         "optimizer": "SGD momentum 0.9", "data_plane": "mpi",
                         "ddp_backend": "gloo"}}


def run(name, extra):
    args = parse_args(name, extra)
    if args.quick:
        from hpcadapt.cuda.device import gpu_problems

        problems = gpu_problems()
        if problems:
            return run_on_cpu(args, "; ".join(problems))
    require_gpu()
    import torch

    import hpcadapt

    hpcadapt.init()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    per_round = training(torch, device, args.steps, args.rounds, args.batch_size,
                         hidden=args.hidden, warmup=args.warmup)
    train = {k: median(v) for k, v in per_round.items()}

    paths = gpu_allreduce_paths(torch, device)
    sizes, repeats = ((QUICK_SIZES_MB, QUICK_ALLREDUCE_REPEATS) if args.quick
                      else (SIZES_MB, ALLREDUCE_REPEATS))
    bw_rows = bandwidth(torch, device, paths, sizes, repeats)
    paths["nccl"].destroy()
    paths["host_staged"].release()

    rows = {f"train {k}": {"samples_per_s": v} for k, v in train.items()}
    rows.update(bw_rows)
    model_params = sum(p.numel() for p in build_mlp(torch, "cpu", args.hidden).parameters())
    return {"benchmark": "gpu", "rows": rows, "ratios": ratios_of(train, bw_rows),
            "samples_per_s_per_round": per_round,
            "gpu": torch.cuda.get_device_name(0), "versions": versions(torch),
            "settings": {"world_size": 1, "model": "mlp", "hidden": args.hidden,
                         "parameters": model_params, "batch_size": args.batch_size,
                         "steps": args.steps, "rounds": args.rounds,
                         "warmup_steps": args.warmup, "sizes_mb": sizes,
                         "allreduce_repeats": repeats, "optimizer": "SGD momentum 0.9"}}
