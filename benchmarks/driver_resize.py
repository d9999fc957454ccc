"""resize: how long training stops when hpcadapt grows or shrinks the job, and how long
torchrun (torch.distributed.elastic, c10d rendezvous) takes to train again after a membership
change, reloading a checkpoint of the same model, measured in the same run.

hpcadapt: the entry point on 1 rank with a resize-schedule 1 -> 2 -> 4 -> 2 -> 1; the pause is
the time from the moment the running ranks stop to accept joiners (or split off leavers) until
the next step can start, as rank 0 measures it; decision_to_first_step_s adds the joiners'
start-up, during which training went on.
torchrun: agent A trains alone; agent B arrives; A's workers are stopped, both re-rendezvous,
and the new generation reloads the checkpoint. The restart time is from the last step of the
old generation to the first step of the new one."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from launch import ROOT, env, free_port, run_mpi

BIG = "4096,2560,1024"   # about 25.7M parameters on 3x32x32 inputs
SMALL = "256,256"


def hpcadapt_pauses(hidden, tmp, label):
    metrics = os.path.join(tmp, f"hpcadapt-{label}.jsonl")
    run_mpi(1, ["-m", "hpcadapt.train", "--model", "mlp", "--hidden", hidden,
                "--dataset", "synthetic", "--synthetic-samples", "1024", "--batch-size", "32",
                "--epochs", "1000", "--max-steps", "400", "--no-progress", "--threads", "1",
                "--max-workers", "4", "--policy", "resize-schedule",
                "--resize-schedule-steps", "3:2,40:4,80:2,100:1", "--metrics-file", metrics])
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    out = {}
    for r in rows:
        if r["event"] == "resize" and r["ok"]:
            out[f"{r['old_size']}->{r['new_size']}"] = {
                "pause_s": r["pause_s"], "decision_to_first_step_s": r["decision_to_first_step_s"]}
    return out


def torchrun_restart(hidden, tmp):
    log = os.path.join(tmp, "torchrun.jsonl")
    ckpt = os.path.join(tmp, "torchrun.ckpt")
    port = free_port()
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    base = [torchrun, "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=hpcadapt-bench",
            "--max-restarts=3", "--monitor-interval=0.1"]
    worker = [str(ROOT / "benchmarks" / "torchrun_worker.py"), "--log", log, "--ckpt", ckpt,
              "--hidden", hidden, "--steps", "60"]
    agent_a = subprocess.Popen(base + ["--rdzv-conf=is_host=1"] + worker, env=env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def rows():
        if not os.path.exists(log):
            return []
        with open(log) as f:
            return [json.loads(line) for line in f if line.strip()]

    deadline = time.time() + 600
    while len(rows()) < 15 and time.time() < deadline:
        time.sleep(0.2)
    joined_at = time.time()
    agent_b = subprocess.Popen(base + ["--rdzv-conf=is_host=0"] + worker, env=env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for agent in (agent_a, agent_b):
        agent.wait(timeout=900)
    r = rows()
    old = [x for x in r if x["gen"] == 0 and x["world"] == 1]
    new = [x for x in r if x["world"] == 2]
    if not old or not new:
        raise SystemExit("torchrun never trained with 2 workers")
    last_old = max(x["t"] for x in old)
    first_new = min(x["t"] for x in new)
    return {"restart_s": first_new - last_old, "membership_change_to_first_step_s":
            first_new - joined_at, "steps_before": len(old)}


def run(name, extra):
    ap = argparse.ArgumentParser(prog=f"run.py {name}")
    ap.parse_args(extra)
    tmp = tempfile.mkdtemp(prefix="hpcadapt-resize-")
    big = hpcadapt_pauses(BIG, tmp, "25M")
    small = hpcadapt_pauses(SMALL, tmp, "small")
    tr = torchrun_restart(BIG, tmp)
    rows = {f"25M {k}": v for k, v in big.items()}
    rows.update({f"small {k}": v for k, v in small.items()})
    rows["torchrun 25M 1->2"] = tr
    out_pause = big["1->2"]["pause_s"]
    return {"benchmark": "resize", "rows": rows, "ratios": {
        "scale_out_pause_s": out_pause,
        "scale_out_2_4_pause_s": big["2->4"]["pause_s"],
        "scale_in_pause_s": big["2->1"]["pause_s"],
        "scale_out_decision_to_first_step_s": big["1->2"]["decision_to_first_step_s"],
        "torchrun_restart_s": tr["restart_s"],
        "torchrun_restart_vs_scale_out_pause": tr["restart_s"] / out_pause,
    }}
