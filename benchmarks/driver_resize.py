"""resize: how long training stops when hpcadapt grows or shrinks the job, and how long
torchrun (torch.distributed.elastic, c10d rendezvous) takes to train again after a membership
change, reloading a checkpoint of the same model, measured in the same run.

hpcadapt: the entry point on 1 rank with a resize-schedule 1 -> 2 -> 4 -> 2 -> 1; the pause is
the time from the moment the running ranks stop to accept joiners (or split off leavers) until
the next step can start, as rank 0 measures it; decision_to_first_step_s adds the joiners'
start-up, during which training went on.
Warm spare: the same 1 -> 2 grow with --warm-spares 1 (a worker started ahead, idle until the
grow takes it), asked once the spare reports warm (benchmarks/warm_spare_user.py).
torchrun: 1 worker trains and checkpoints every 5 steps; at a checkpoint the membership changes
to 2 workers, which start and reload the checkpoint. The restart time is from the last step
before the change to the first step after it."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from launch import ROOT, env, mpiexec, run_mpi

BIG = "4096,2560,1024"   # about 25.7M parameters on 3x32x32 inputs
SMALL = "256,256"


def mlp_parameters(hidden: str, inputs: int = 3 * 32 * 32, classes: int = 10) -> int:
    """Weights and biases of the built-in MLP with these hidden layers."""
    sizes = [inputs] + [int(h) for h in hidden.split(",")] + [classes]
    return sum(a * b + b for a, b in zip(sizes, sizes[1:]))


def hpcadapt_pauses(hidden, tmp, label, max_steps=None):
    """The pauses of the schedule's resizes. Without ``max_steps`` the job trains until
    the last resize, 2 -> 1, is in the metrics file, then is stopped (its --stop-file): a
    fast model's joiners then never race a step cap."""
    metrics = os.path.join(tmp, f"hpcadapt-{label}.jsonl")
    args = ["-m", "hpcadapt.train", "--model", "mlp", "--hidden", hidden,
            "--dataset", "synthetic", "--synthetic-samples", "1024", "--batch-size", "32",
            "--epochs", "100000", "--no-progress", "--threads", "1",
            "--max-workers", "4", "--policy", "resize-schedule",
            "--resize-schedule-steps", "3:2,40:4,80:2,100:1", "--metrics-file", metrics]
    if max_steps is None:
        run_until_resized(args, metrics, os.path.join(tmp, f"hpcadapt-{label}.stop"), 2, 1)
    else:
        run_mpi(1, args + ["--max-steps", str(max_steps)])
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    out = {}
    for r in rows:
        if r["event"] == "resize" and r["ok"]:
            out[f"{r['old_size']}->{r['new_size']}"] = {
                "pause_s": r["pause_s"], "decision_to_first_step_s": r["decision_to_first_step_s"]}
    return out


def run_until_resized(args, metrics, stop, old_size, new_size, timeout=600.0):
    """Run the entry point (``args``) on 1 rank until its metrics file shows the resize
    ``old_size -> new_size``, then stop it through ``stop`` (its --stop-file)."""
    from driver_failure import Tail, end_group, wait_for

    proc = subprocess.Popen([mpiexec(), "-n", "1", sys.executable] + args
                            + ["--stop-file", stop], env=env(), cwd=ROOT,
                            start_new_session=True)
    try:
        wait_for(Tail(metrics), 0, lambda r: r.get("event") == "resize" and r.get("ok")
                 and (r["old_size"], r["new_size"]) == (old_size, new_size),
                 f"the resize {old_size}->{new_size}", timeout,
                 lambda: None if proc.poll() is None else f"the job ended (exit {proc.returncode})")
        with open(stop, "w"):
            pass
        rc = proc.wait(timeout=timeout)
        if rc != 0:
            raise SystemExit(f"resize benchmark: the job ended with exit {rc} after its stop "
                             f"file")
    finally:
        end_group(proc)


def hpcadapt_warm_spare(hidden, tmp, timeout=600.0):
    """decision_to_first_step_s and pause_s of a 1 -> 2 grow taken by a warm spare: the
    grow is asked (benchmarks/warm_spare_user.py's grow file) once the spare says it is
    warm, and the job is stopped once the grow is in its metrics file."""
    import glob

    from driver_failure import Tail, end_group, wait_for

    metrics = os.path.join(tmp, "hpcadapt-warm-spare.jsonl")
    spares = os.path.join(tmp, "spares")  # the job's TMPDIR: a local spare's folder is there
    os.mkdir(spares, 0o700)
    grow, stop = os.path.join(tmp, "warm-spare.grow"), os.path.join(tmp, "warm-spare.stop")
    err_path = os.path.join(tmp, "warm-spare.err")
    cmd = [mpiexec(), "-n", "1", sys.executable, str(ROOT / "benchmarks" / "warm_spare_user.py"),
           "--hidden", hidden, "--grow-file", grow, "--allocator", "local", "--max-workers",
           "2", "--warm-spares", "1", "--metrics-file", metrics, "--stop-file", stop]

    def job_stderr():
        with open(err_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def warm():
        """A started spare said it is warm: its file (MPICH: a launch of its own) or rank 0's
        line (Open MPI: a spawned spare)."""
        return (glob.glob(os.path.join(spares, "hpcadapt-spare-*", "warm-0"))
                or "warm spares ready: 1" in job_stderr())

    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, env=dict(env(), TMPDIR=spares), cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        deadline = time.time() + timeout
        while not warm():
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the warm-spare run: no warm spare (exit {proc.poll()}): "
                                 f"{job_stderr()[-2000:]}")
            time.sleep(0.05)
        with open(grow, "w"):
            pass
        tail = Tail(metrics)
        grow_row = tail.rows[wait_for(
            tail, 0, lambda r: r.get("event") == "resize", "the warm spare's grow", timeout,
            lambda: None if proc.poll() is None else
            f"the job ended (exit {proc.returncode}): {job_stderr()[-2000:]}")]
        with open(stop, "w"):
            pass
        rc = proc.wait(timeout=timeout)
    finally:
        end_group(proc)
    if rc != 0 or not grow_row["ok"]:
        raise SystemExit(f"the warm-spare run failed (exit {rc}, grow {grow_row}): "
                         f"{job_stderr()[-2000:]}")
    # MPICH: rank 0's line of the grow; Open MPI: the spawned spare's grow says it in its reason
    if ("took 1 spare(s) (1 warm)" not in job_stderr()
            and not grow_row["reason"].endswith("from warm spares")):
        raise SystemExit(f"the grow did not take the warm spare: {job_stderr()[-2000:]}")
    return {"pause_s": grow_row["pause_s"],
            "decision_to_first_step_s": grow_row["decision_to_first_step_s"]}


BROADCAST_CODE = """
import sys, time
import numpy as np
from mpi4py import MPI
n = int(sys.argv[1])
buf = np.ones(n, dtype=np.uint8)
times = []
for _ in range(7):
    MPI.COMM_WORLD.Barrier()
    t0 = time.perf_counter()
    MPI.COMM_WORLD.Bcast(buf, root=0)
    MPI.COMM_WORLD.Barrier()
    times.append(time.perf_counter() - t0)
if MPI.COMM_WORLD.Get_rank() == 0:
    print(sorted(times)[len(times) // 2])
"""


def plain_broadcast_s(nbytes):
    """Median time of a plain MPI_Bcast of ``nbytes`` between 2 ranks of one launch (shared
    memory): the floor a join's state transfer could reach."""
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-c", BROADCAST_CODE,
                           str(nbytes)], env=env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"the plain broadcast failed: {proc.stderr[-2000:]}")
    return float(proc.stdout.split()[-1])


def torchrun_restart(hidden, tmp, after=24):
    """torchrun with 1 worker trains and checkpoints; the membership changes to 2 workers:
    the job is stopped and torchrun starts 2 workers, which reload the checkpoint (what
    torch.distributed.elastic does on a membership change: stop every worker, rendezvous,
    restart them all from the last checkpoint) and train ``after`` steps past the last one
    logged. Two agents on one host with the c10d backend did not complete the
    re-rendezvous here, so the agent is restarted too. The first agent would train 10**6
    steps: the change always lands while it trains."""
    log = os.path.join(tmp, "torchrun.jsonl")
    ckpt = os.path.join(tmp, "torchrun.ckpt")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")

    def agent(nproc, steps):
        return subprocess.Popen(
            [torchrun, "--standalone", f"--nproc-per-node={nproc}",
             str(ROOT / "benchmarks" / "torchrun_worker.py"), "--step-log", log,
             "--checkpoint", ckpt, "--hidden", hidden, "--steps", str(steps),
             "--save-every", "5"],
            env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def rows():
        if not os.path.exists(log):
            return []
        with open(log) as f:  # the workers are writing it: complete lines only
            return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]

    agents = []
    try:
        first = agent(1, 10 ** 6)
        agents.append(first)
        deadline = time.time() + 600
        # stop once the checkpoint of step 15 is on disk (written after step 15's log line)
        while not any(r["step"] == 16 for r in rows()):
            if first.poll() is not None or time.time() > deadline:
                raise SystemExit("torchrun with 1 worker did not reach step 16")
            time.sleep(0.05)
        changed_at = time.time()
        first.terminate()
        first.wait(timeout=120)
        second = agent(2, max(x["step"] for x in rows()) + after)
        agents.append(second)
        second.wait(timeout=900)
    finally:  # an agent stops its workers on SIGTERM
        for a in agents:
            if a.poll() is None:
                a.terminate()
                try:
                    a.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    a.kill()
    r = rows()
    old = [x for x in r if x["world"] == 1]
    new = [x for x in r if x["world"] == 2]
    if not new:
        raise SystemExit("torchrun never trained with 2 workers")
    last_old = max(x["t"] for x in old)
    first_new = min(x["t"] for x in new)
    return {"restart_s": first_new - last_old,
            "membership_change_to_first_step_s": first_new - changed_at,
            "resumed_at_step": min(x["step"] for x in new) - 1}


def run(name, extra):
    ap = argparse.ArgumentParser(prog=f"run.py {name}")
    ap.add_argument("--quick", action="store_true",
                    help="the small MLP only (for the pauses, the warm spare, the broadcast "
                         "and torchrun)")
    args = ap.parse_args(extra)
    tmp = tempfile.mkdtemp(prefix="hpcadapt-resize-")
    if args.quick:
        label, hidden = "small", SMALL
        big = hpcadapt_pauses(SMALL, tmp, "small")
        small = {}
        spare = hpcadapt_warm_spare(SMALL, tmp)
        tr = torchrun_restart(SMALL, tmp)
    else:
        label, hidden = "25M", BIG
        big = hpcadapt_pauses(BIG, tmp, "25M", 400)
        small = hpcadapt_pauses(SMALL, tmp, "small")  # until its last resize: steps are fast
        spare = hpcadapt_warm_spare(BIG, tmp)
        tr = None
    # the state a joiner receives: the parameters and SGD's momentum, float32
    params = mlp_parameters(hidden)
    bcast = plain_broadcast_s(2 * 4 * params)
    if tr is None:
        tr = torchrun_restart(BIG, tmp)
    missing = [k for k in ("1->2", "2->4", "2->1") if k not in big]
    if missing:
        raise SystemExit(f"resize benchmark: the {label} run made no resize {missing} "
                         f"(made: {sorted(big)}); joiners slower than its --max-steps "
                         f"(only the 25M run has one)")
    rows = {f"{label} {k}": v for k, v in big.items()}
    rows.update({f"small {k}": v for k, v in small.items()})
    rows[f"torchrun {label} 1->2"] = tr
    rows[f"{label} 1->2 warm spare"] = spare
    rows[f"plain broadcast of the {label} state (2 ranks)"] = {"seconds": bcast,
                                                              "bytes": 2 * 4 * params}
    out_pause = big["1->2"]["pause_s"]
    return {"benchmark": "resize", "rows": rows, "ratios": {
        "scale_out_pause_s": out_pause,
        "scale_out_2_4_pause_s": big["2->4"]["pause_s"],
        "scale_in_pause_s": big["2->1"]["pause_s"],
        "scale_out_decision_to_first_step_s": big["1->2"]["decision_to_first_step_s"],
        "warm_spare_decision_to_first_step_s": spare["decision_to_first_step_s"],
        "warm_spare_pause_s": spare["pause_s"],
        "scale_out_pause_vs_broadcast": out_pause / bcast,
        "torchrun_restart_s": tr["restart_s"],
        "torchrun_restart_vs_scale_out_pause": tr["restart_s"] / out_pause,
    }}
