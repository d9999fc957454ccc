"""What the data plane adds to a training step, counted and timed (issue 44), on a model of
many small parameters (where per-parameter work shows), 2 ranks:

- aten operations per step, from torch's profiler: a plain local step (no communication),
  hpcadapt's (the job's pattern: buckets zeroed in place, backward accumulates into them;
  and a user's ``opt.zero_grad()`` pattern), torch DDP on gloo (its default, and with
  ``gradient_as_bucket_view``); what each adds over the plain step, per parameter;
- host transfers of tensors (``.item()``, ``float()``, ``.cpu()``, ``.tolist()``) made by the
  data plane (its hooks, bucket launches and ``synchronize``) on an unmonitored step and a
  monitored one (the gradient noise scale's statistics);
- the step time of each, in interleaved rounds, and what each adds over the plain step.

On a GPU (``--device cuda``, one rank: the runner starts one where there is one GPU) the
same, over the GPU's data plane and DDP on NCCL; not run on a GPU yet."""

import argparse
import collections
import sys
import time

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hpcadapt
from hpcadapt.parallel import optimizer as plane
from common import free_port, init_gloo, interleaved, median, single_thread, write_result
from launch import quick_defaults


def many_small(layers: int, width: int) -> nn.Module:
    """``layers`` Linear layers of ``width`` x ``width``: 2 x ``layers`` small parameters."""
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*mods, nn.Linear(width, 2))


def aten_ops(step, steps: int) -> float:
    """aten operations per step (every thread the profiler sees), over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")) / steps


class TransferCounter:
    """Counts host transfers of tensors made inside the data plane's hooks, bucket launches
    and ``synchronize`` (instrumented for the count, restored after)."""

    NAMES = ("item", "__float__", "cpu", "tolist")

    def __init__(self):
        self.count = collections.Counter()
        self.inside = 0
        self._saved = []

    def __enter__(self):
        def counted(name, original):
            def method(t, *a, **k):
                if self.inside:
                    self.count[name] += 1
                return original(t, *a, **k)
            return method

        def watched(original):
            def method(*a, **k):
                self.inside += 1
                try:
                    return original(*a, **k)
                finally:
                    self.inside -= 1
            return method

        D = plane.DistributedOptimizer
        for owner, names, wrap in ((torch.Tensor, self.NAMES, None),
                                   (D, ("_on_grad_ready", "_launch", "synchronize"), watched)):
            for name in names:
                original = getattr(owner, name)
                self._saved.append((owner, name, original))
                setattr(owner, name, wrap(original) if wrap else counted(name, original))
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)

    def per_step(self, step, steps: int) -> float:
        self.count.clear()
        for _ in range(steps):
            step()
        return sum(self.count.values()) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=100, help="Linear layers (2 parameters each)")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch")
    ap.add_argument("--steps", type=int, default=50, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    quick_defaults(ap, sys.argv[1:], steps=10, rounds=3, profile_steps=2)
    args = ap.parse_args()
    single_thread()
    w = hpcadapt.init()
    raw = MPI.COMM_WORLD.Dup()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(w.rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        port = raw.bcast(free_port() if raw.rank == 0 else None, root=0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                                rank=raw.rank, world_size=raw.size)
    else:
        init_gloo(raw)
    g = torch.Generator().manual_seed(w.rank)
    x = torch.randn(args.batch, args.width, generator=g).to(device)
    y = torch.randint(0, 2, (args.batch,), generator=g).to(device)
    loss_fn = nn.CrossEntropyLoss()

    def sgd(model):
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def stepper(model, opt, set_to_none=True):
        def step():
            opt.zero_grad(set_to_none=set_to_none)
            loss_fn(model(x), y).backward()
            opt.step()
        return step

    models, steps = {}, {}
    m = models["plain"] = many_small(args.layers, args.width).to(device)
    steps["plain"] = stepper(m, sgd(m))
    m = models["hpcadapt"] = many_small(args.layers, args.width).to(device)
    opt_hpc = hpcadapt.DistributedOptimizer(sgd(m), m.named_parameters(), world=w)
    # the job's own step: the buckets zeroed in place, backward accumulates into them
    steps["hpcadapt"] = stepper(m, opt_hpc, set_to_none=False)
    m = models["hpcadapt_set_to_none"] = many_small(args.layers, args.width).to(device)
    opt_user = hpcadapt.DistributedOptimizer(sgd(m), m.named_parameters(), world=w)
    steps["hpcadapt_set_to_none"] = stepper(m, opt_user)  # a user's opt.zero_grad()
    ddp = DDP(many_small(args.layers, args.width).to(device))
    steps["torch_ddp"] = stepper(ddp, sgd(ddp))
    view = DDP(many_small(args.layers, args.width).to(device), gradient_as_bucket_view=True)
    steps["torch_ddp_bucket_view"] = stepper(view, sgd(view))
    params = sum(1 for p in models["plain"].parameters())
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)

    for s in steps.values():
        for _ in range(3):
            s()
    sync()
    raw.Barrier()
    ops = {k: aten_ops(s, args.profile_steps) for k, s in steps.items()}
    added = {k: (v - ops["plain"]) / params for k, v in ops.items() if k != "plain"}

    with TransferCounter() as counter:
        opt_hpc.track_grad_norms = False
        unmonitored = counter.per_step(steps["hpcadapt"], args.profile_steps)
        opt_hpc.track_grad_norms = True
        monitored = counter.per_step(steps["hpcadapt"], args.profile_steps)
        opt_hpc.track_grad_norms = False

    def timed(step):
        def run():
            sync()
            raw.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync()
            return raw.allreduce(time.perf_counter() - t0, op=MPI.MAX) / args.steps
        return run

    times = interleaved({k: timed(s) for k, s in steps.items()}, args.rounds)
    step_ms = {k: 1e3 * median(v) for k, v in times.items()}

    def backward_only(model, opt, finish):
        """Seconds per backward pass alone (the hooks and bucket launches run inside it;
        the rest of the step outside the clock)."""
        def run():
            spent = 0.0
            for _ in range(args.steps):
                opt.zero_grad(set_to_none=False)
                loss = loss_fn(model(x), y)
                sync()
                t0 = time.perf_counter()
                loss.backward()
                sync()
                spent += time.perf_counter() - t0
                finish()
            return spent / args.steps
        return run

    plain_opt = sgd(models["plain"])
    backward = interleaved({
        "plain": backward_only(models["plain"], plain_opt, lambda: None),
        "hpcadapt": backward_only(models["hpcadapt"], opt_hpc, opt_hpc.synchronize)},
        args.rounds)
    backward_us = {k: 1e6 * median(v) for k, v in backward.items()}
    rows = {k: {"aten_ops_per_step": ops[k], "step_ms": step_ms[k],
                **({"added_ops_per_param": added[k],
                    "added_ms": step_ms[k] - step_ms["plain"]} if k != "plain" else {})}
            for k in steps}
    rows["transfers"] = {"unmonitored_step": unmonitored, "monitored_step": monitored}
    rows["backward"] = {"plain_us": backward_us["plain"], "hpcadapt_us": backward_us["hpcadapt"],
                        # what the hooks and the launches add to backward, per parameter
                        "hook_us_per_param": (backward_us["hpcadapt"] - backward_us["plain"])
                        / params}
    result = {
        "benchmark": "step-overhead",
        "config": {"parameters": params, "layers": args.layers, "width": args.width,
                   "batch": args.batch, "ranks": w.size, "device": str(device),
                   "steps": args.steps, "rounds": args.rounds,
                   "profile_steps": args.profile_steps},
        "rows": rows,
        "ratios": {
            # per parameter, what hpcadapt's data plane adds to a plain step's aten
            # operations over what DDP's reducer adds (its default); <= 1: no more work
            "step_ops_per_param_vs_ddp": added["hpcadapt"] / added["torch_ddp"],
            "step_ops_per_param_vs_ddp_bucket_view": (
                added["hpcadapt"] / added["torch_ddp_bucket_view"]),
            "host_transfers_unmonitored_step": unmonitored,
            "host_transfers_monitored_step": monitored,
            # the step's time over DDP's (< 1: faster), on many small parameters
            "step_time_vs_ddp": step_ms["hpcadapt"] / step_ms["torch_ddp"],
        },
    }
    opt_hpc.remove_hooks()
    opt_user.remove_hooks()
    if w.rank == 0:
        write_result(args.out, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
