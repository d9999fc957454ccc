"""failure: how long training stops when one worker is SIGKILLed, in hpcadapt (recovery in
place) and in torchrun (torch.distributed.elastic restarts every worker from a checkpoint).

hpcadapt: the entry point on 2 ranks grows to 4 (two joined workers, each its own mpiexec)
with --replace-failed. A joined worker (rank >= 2; the original ranks share one mpiexec launch,
whose death ends that launch) is SIGKILLed once the 4-worker world has trained a few steps;
the survivors detect it, form a 3-worker world, redo the step in flight, and a replacement
joins stop-free, after which the next worker is killed. From the metrics file:
detect = the failure line's detected_unix - the kill's time.time(); recover = from the
detection to the moment training resumes: the start of the first step after the recovery (the
step line's unix_time - step_time_s; step lines are written when a step ends).
torchrun: 4 workers (--standalone, gloo, DDP, --max-restarts, checkpoint every few steps by
rank 0); a worker other than rank 0 is SIGKILLed once its generation has trained a few steps;
the agent stops every worker and starts a new generation, which reloads the checkpoint. The
restart is from the kill to the moment training resumes: the start of the new generation's
first step (after start-up, rendezvous, checkpoint load and DDP's broadcast).
Both sides also report the time to the end of that first step (``*_to_step_end_s``): on this
machine one step of this model is seconds of allreduce, the same on both sides.

Both models are the resize benchmark's 25.7M-parameter MLP. Kills are spaced by waiting for
the metrics/step logs, never by fixed sleeps; every wait has a deadline that fails the
benchmark with what was awaited."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

from launch import ROOT, env, mpiexec, quick_defaults

BIG = "4096,2560,1024"   # about 25.7M parameters on 3x32x32 inputs, as in driver_resize
SMALL = "256,256"        # --quick


class Tail:
    """Reads a JSON Lines file as it grows (a partial last line is kept for the next read)."""

    def __init__(self, path: str):
        self.path = path
        self.rows: List[dict] = []
        self._pos = 0
        self._partial = ""

    def poll(self) -> List[dict]:
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                f.seek(self._pos)
                chunk = f.read()
                self._pos = f.tell()
            text = self._partial + chunk
            lines = text.split("\n")
            self._partial = lines.pop()
            self.rows.extend(json.loads(line) for line in lines if line.strip())
        return self.rows


def wait_for(tail: Tail, start: int, pred: Callable[[dict], bool], what: str, timeout: float,
             alive: Callable[[], Optional[str]]) -> int:
    """Index of the first row at or after ``start`` that satisfies ``pred``; fails the
    benchmark after ``timeout`` seconds or as soon as ``alive()`` reports the job ended."""
    deadline = time.time() + timeout
    i = start
    while True:
        rows = tail.poll()
        while i < len(rows):
            if pred(rows[i]):
                return i
            i += 1
        dead = alive()
        if dead is not None:
            tail.poll()
            raise SystemExit(f"failure benchmark: {dead} while waiting for {what} "
                             f"(last lines of {tail.path}: {tail.rows[-3:]})")
        if time.time() > deadline:
            raise SystemExit(f"failure benchmark: no {what} within {timeout:.0f} s "
                             f"(last lines of {tail.path}: {tail.rows[-3:]})")
        time.sleep(0.02)


def stderr_tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return ""


def end_group(proc: subprocess.Popen) -> None:
    """SIGKILL the session this driver started for ``proc`` (its launcher and workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def measure_recovery(tail: Tail, start: int, killed: float, rank: int, what: str,
                     timeout: float, alive: Callable[[], Optional[str]]):
    """(the row index of the first step after the recovery, the kill's measures): waits for
    the failure line after ``start`` and the first step after it (module text: detect,
    recover)."""
    i = wait_for(tail, start, lambda r: r.get("event") == "failure",
                 f"a failure line after killing rank {rank} ({what})", timeout, alive)
    fail = tail.rows[i]
    if not fail.get("recovered"):
        raise SystemExit(f"failure benchmark: the job did not recover: {fail}")
    recovered = fail["recovered_unix"]
    i = wait_for(tail, i + 1, lambda r: r.get("event") == "step"
                 and r["unix_time"] >= recovered, f"a step after the recovery ({what})",
                 timeout, alive)
    step = tail.rows[i]
    detect = fail["detected_unix"] - killed
    recover = step["unix_time"] - step["step_time_s"] - fail["detected_unix"]
    return i, {"killed_rank": rank, "dead": fail.get("dead"), "detect_s": detect,
               "recover_s": recover, "kill_to_resume_s": detect + recover,
               "kill_to_step_end_s": step["unix_time"] - killed,
               "state_broadcast_s": fail.get("state_broadcast_s"),
               "recovery_s": fail.get("recovery_s"), "rolled_back_to": fail.get("step"),
               "first_step": step["step"], "first_step_world": step["world_size"],
               "first_step_time_s": step.get("step_time_s")}


def hpcadapt_failures(tmp: str, kills: int, timeout: float, settle_steps: int,
                      kill_rank: str, out: List[dict], label: str = "hpcadapt",
                      hidden: str = BIG) -> None:
    """One job, ``kills`` kills; each recovered kill is appended to ``out`` as it ends."""
    metrics = os.path.join(tmp, f"{label}.jsonl")
    stop = os.path.join(tmp, f"{label}.stop")
    err = os.path.join(tmp, f"{label}.stderr")
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "hpcadapt.train", "--model", "mlp",
           "--hidden", hidden, "--dataset", "synthetic", "--synthetic-samples", "1024",
           "--batch-size", "32", "--epochs", "100000", "--no-progress", "--threads", "1",
           "--max-workers", "4", "--policy", "resize-schedule", "--resize-schedule-steps", "3:4",
           "--replace-failed", "--metrics-file", metrics, "--stop-file", stop]
    with open(err, "w", encoding="utf-8") as ferr:
        # a crash of a survivor in C (MPICH) then leaves a Python traceback in the output
        proc = subprocess.Popen(cmd, env=dict(env(), PYTHONFAULTHANDLER="1"), cwd=ROOT,
                                stdout=ferr, stderr=subprocess.STDOUT, start_new_session=True)
    tail = Tail(metrics)

    def alive() -> Optional[str]:
        rc = proc.poll()
        return None if rc is None else (f"the hpcadapt job ended (exit {rc}; output tail: "
                                        f"{stderr_tail(err)})")

    try:
        i = 0
        for k in range(kills):
            # the 4-worker world (the grow, or the last kill's replacement) ...
            i = wait_for(tail, i, lambda r: r.get("event") == "resize" and r.get("ok")
                         and r.get("new_size") == 4, f"a resize to 4 workers (kill {k + 1})",
                         timeout, alive)
            resize = tail.rows[i]
            # ... that has trained a few steps, so that no joiner is inside its join
            for _ in range(settle_steps):
                i = wait_for(tail, i + 1, lambda r: r.get("event") == "step"
                             and r.get("world_size") == 4,
                             f"a step on 4 workers after the resize (kill {k + 1})", timeout,
                             alive)
            pids = resize.get("pids") or []
            if len(pids) != 4:
                raise SystemExit(f"failure benchmark: the resize line has no 4 pids: {resize}")
            rank = 2 + k % 2 if kill_rank == "alternate" else int(kill_rank)
            pid = int(pids[rank])
            os.kill(pid, signal.SIGKILL)
            killed = time.time()
            i, row = measure_recovery(tail, i + 1, killed, rank, f"kill {k + 1}", timeout,
                                      alive)
            out.append(row)
            print(f"  hpcadapt kill {k + 1}: rank {rank} detect {row['detect_s']:.3f} s, "
                  f"recover {row['recover_s']:.3f} s", flush=True)
            i += 1
        # the last replacement joins before the stop, so the job ends with what it started
        i = wait_for(tail, i, lambda r: r.get("event") == "resize" and r.get("ok")
                     and r.get("new_size") == 4, "the last replacement's resize to 4", timeout,
                     alive)
        with open(stop, "w"):
            pass
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"failure benchmark: the hpcadapt job did not end within "
                             f"{timeout:.0f} s of the stop file (output tail: "
                             f"{stderr_tail(err)})")
        if rc != 0:
            raise SystemExit(f"failure benchmark: the hpcadapt job ended with exit {rc} after "
                             f"the stop file (output tail: {stderr_tail(err)})")
    finally:
        end_group(proc)


def hpcadapt_series(tmp: str, kills: int, timeout: float, settle_steps: int, kill_rank: str,
                    max_crashes: int, hidden: str = BIG):
    """``kills`` recovered kills; with ``max_crashes`` > 0 a job that crashes or hangs on a
    kill is recorded and a fresh job takes over (else the benchmark fails at once)."""
    done: List[dict] = []
    crashes: List[dict] = []
    job = 0
    while len(done) < kills:
        job += 1
        out: List[dict] = []
        try:
            hpcadapt_failures(tmp, kills - len(done), timeout, settle_steps, kill_rank, out,
                              label=f"hpcadapt-job{job}", hidden=hidden)
        except SystemExit as e:
            if len(crashes) >= max_crashes:
                raise
            crashes.append({"job": job, "after_recovered_kills": len(out), "what": str(e)})
            print(f"  hpcadapt job {job} failed after {len(out)} recovered kill(s); a fresh "
                  f"job goes on: {str(e)[:200]} ...", flush=True)
        finally:
            for r in out:
                r["job"] = job
            done.extend(out)
    return done, crashes


def openmpi_python() -> str:
    """A Python whose mpi4py runs on Open MPI: this one, else the checkout's .venv-openmpi."""
    from mpi4py import MPI

    if MPI.get_vendor()[0] == "Open MPI":
        return sys.executable
    other = ROOT / ".venv-openmpi" / "bin" / "python"
    if not other.exists():
        raise SystemExit("failure benchmark --mpi openmpi: no Open MPI here; run "
                         "`make setup MPI=openmpi` first (it creates .venv-openmpi)")
    return str(other)


def _launch_rank_pids(launcher_pid: int) -> Dict[int, int]:
    """{rank: pid} of the launcher's child processes, from Open MPI's rank variable."""
    out = {}
    with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children", encoding="ascii") as f:
        children = [int(p) for p in f.read().split()]
    for pid in children:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env_vars = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        except OSError:
            continue
        rank = env_vars.get(b"OMPI_COMM_WORLD_RANK", b"")
        if rank.isdigit():
            out[int(rank)] = pid
    return out


def ulfm_failures(tmp: str, kills: int, timeout: float, settle_steps: int, out: List[dict],
                  hidden: str = BIG) -> List[dict]:
    """Open MPI with ULFM: one plain `mpirun --with-ft ulfm -n 4` launch per kill (growing
    back is not built on Open MPI yet), the victim taking turns through ranks 0, 1, 2 and 3;
    the survivors shrink in place. Each job ends by its stop file, which must give exit 0;
    a job that ends otherwise counts as crashed (and is recorded, not retried)."""
    python = openmpi_python()
    mpirun = [os.path.join(os.path.dirname(python), "mpirun"), "--with-ft", "ulfm", "--mca",
              "async_mpi_finalize", "1", "--oversubscribe"] + \
        (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    crashed = []
    for k in range(kills):
        label = f"ulfm-kill{k + 1}"
        metrics = os.path.join(tmp, f"{label}.jsonl")
        stop = os.path.join(tmp, f"{label}.stop")
        err = os.path.join(tmp, f"{label}.stderr")
        cmd = mpirun + ["-n", "4", python, "-m", "hpcadapt.train", "--model", "mlp",
                        "--hidden", hidden, "--dataset", "synthetic", "--synthetic-samples",
                        "1024", "--batch-size", "32", "--epochs", "100000", "--no-progress",
                        "--threads", "1", "--on-failure", "recover", "--metrics-file",
                        metrics, "--stop-file", stop]
        with open(err, "w", encoding="utf-8") as ferr:
            proc = subprocess.Popen(cmd, env=env(), cwd=ROOT, stdout=ferr,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        tail = Tail(metrics)

        def alive() -> Optional[str]:
            rc = proc.poll()
            return None if rc is None else (f"the hpcadapt job ended (exit {rc}; output "
                                            f"tail: {stderr_tail(err)})")

        rank = k % 4
        try:
            i = 0
            for _ in range(settle_steps):
                i = wait_for(tail, i, lambda r: r.get("event") == "step",
                             f"a step of launch {k + 1}", timeout, alive) + 1
            pid = _launch_rank_pids(proc.pid)[rank]
            os.kill(pid, signal.SIGKILL)
            killed = time.time()
            _, row = measure_recovery(tail, i, killed, rank, f"kill {k + 1}", timeout, alive)
            with open(stop, "w"):
                pass
            rc = proc.wait(timeout=timeout)
            if rc != 0:
                raise SystemExit(f"exit {rc} after the stop file (output tail: "
                                 f"{stderr_tail(err)})")
        except (SystemExit, subprocess.TimeoutExpired) as e:
            if isinstance(e, SystemExit) and not isinstance(e.code, str):
                raise  # a stop of the benchmark itself (SIGTERM), not the job's failure
            crashed.append({"job": k + 1, "after_recovered_kills": 0, "what": str(e)})
            print(f"  hpcadapt (Open MPI) launch {k + 1} failed: {str(e)[:300]}", flush=True)
            continue
        finally:
            end_group(proc)
        out.append(dict(row, job=k + 1))
        print(f"  hpcadapt (Open MPI, ULFM) kill {k + 1}: rank {rank} detect "
              f"{row['detect_s']:.3f} s, recover {row['recover_s']:.3f} s", flush=True)
    return crashed


def torchrun_failures(tmp: str, kills: int, timeout: float, settle_steps: int,
                      save_every: int, hidden: str = BIG) -> List[dict]:
    log = os.path.join(tmp, "torchrun.jsonl")
    ckpt = os.path.join(tmp, "torchrun.ckpt")
    err = os.path.join(tmp, "torchrun.stderr")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node=4", f"--max-restarts={kills + 2}",
           str(ROOT / "benchmarks" / "torchrun_worker.py"), "--step-log", log,
           "--checkpoint", ckpt, "--hidden", hidden, "--steps", "1000000",
           "--save-every", str(save_every), "--log-pid", "--store-per-generation"]
    with open(err, "w", encoding="utf-8") as ferr:
        proc = subprocess.Popen(cmd, env=env(), cwd=ROOT, stdout=ferr, stderr=subprocess.STDOUT,
                                start_new_session=True)
    tail = Tail(log)

    def alive() -> Optional[str]:
        rc = proc.poll()
        return None if rc is None else (f"torchrun ended (exit {rc}; output tail: "
                                        f"{stderr_tail(err)})")

    out = []
    try:
        i = 0
        for k in range(kills):
            gen = k
            # this generation's first step, then a few more ...
            i = wait_for(tail, i, lambda r: r["gen"] == gen,
                         f"torchrun generation {gen}'s first step", timeout, alive)
            # ... past a checkpoint of its own, so that every generation gets further
            first = tail.rows[i]["step"]
            saved = -(-first // save_every) * save_every
            need = max(first + settle_steps, saved + 1)
            i = wait_for(tail, i, lambda r: r["gen"] == gen and r["step"] >= need
                         and r["rank"] == 3, f"torchrun generation {gen}'s step {need}",
                         timeout, alive)
            victim = tail.rows[i]
            if not os.path.exists(ckpt):
                raise SystemExit("failure benchmark: torchrun wrote no checkpoint")
            pid = int(victim["pid"])
            os.kill(pid, signal.SIGKILL)
            killed = time.time()
            i = wait_for(tail, i + 1, lambda r: r["gen"] == gen + 1,
                         f"torchrun generation {gen + 1}'s first step (kill {k + 1})",
                         timeout, alive)
            new = tail.rows[i]
            restart = new["t_start"] - killed
            last = max(r["step"] for r in tail.rows[:i] if r["gen"] == gen)
            out.append({"killed_rank": 3, "restart_s": restart,
                        "restart_to_step_end_s": new["t"] - killed,
                        "resumed_at_step": new["step"] - 1, "last_step_before": last,
                        "steps_redone": last - (new["step"] - 1)})
            print(f"  torchrun kill {k + 1}: restart {restart:.3f} s", flush=True)
            i += 1
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)   # the agent stops its workers and exits
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        end_group(proc)
    return out


def median(xs: List[float]) -> Optional[float]:
    return float(statistics.median(xs)) if xs else None


def run(name, extra):
    ap = argparse.ArgumentParser(prog=f"run.py {name}")
    ap.add_argument("--kills", type=int, default=5, help="kills on each side (default: 5)")
    ap.add_argument("--settle-steps", type=int, default=3,
                    help="steps a world trains before its next kill (default: 3)")
    ap.add_argument("--save-every", type=int, default=5,
                    help="torchrun's checkpoint interval in steps (default: 5)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds any one wait may take before the benchmark fails")
    ap.add_argument("--kill-rank", choices=["alternate", "2", "3"], default="alternate",
                    help="which joined worker of hpcadapt's 4 to kill: ranks 2 and 3 in turn "
                         "(the rank 3 of a replaced world is the replacement), or always one")
    ap.add_argument("--max-crashes", type=int, default=0,
                    help="hpcadapt jobs that may crash or hang on a kill, each replaced by a "
                         "fresh job and counted in the result (default 0: the first fails the "
                         "benchmark)")
    ap.add_argument("--skip", choices=["hpcadapt", "torchrun"], default=None,
                    help="leave one side out (its ratios are n/a)")
    ap.add_argument("--hidden", default=BIG, help=f"the MLP's hidden layers on both sides "
                                                  f"(default {BIG}: 25.7M parameters)")
    ap.add_argument("--mpi", choices=["mpich", "openmpi"], default="mpich",
                    help="hpcadapt's side: mpich (joined workers killed, replaced stop-free) "
                         "or openmpi (one plain `mpirun --with-ft ulfm -n 4` launch per kill, "
                         "any rank, rank 0 included; from .venv-openmpi when this Python "
                         "runs MPICH)")
    quick_defaults(ap, extra, kills=1, hidden=SMALL, timeout=120.0)
    args = ap.parse_args(extra)
    tmp = tempfile.mkdtemp(prefix="hpcadapt-failure-")
    print(f"failure benchmark: logs in {tmp}", flush=True)
    if args.skip == "hpcadapt":
        hp, crashes = [], []
    elif args.mpi == "openmpi":
        hp = []
        crashes = ulfm_failures(tmp, args.kills, args.timeout, args.settle_steps, hp,
                                args.hidden)
    else:
        hp, crashes = hpcadapt_series(tmp, args.kills, args.timeout, args.settle_steps,
                                      args.kill_rank, args.max_crashes, args.hidden)
    tr = [] if args.skip == "torchrun" else torchrun_failures(
        tmp, args.kills, args.timeout, args.settle_steps, args.save_every, args.hidden)
    rows: Dict[str, dict] = {}
    for n, r in enumerate(hp, 1):
        rows[f"hpcadapt kill {n}"] = r
    for n, c in enumerate(crashes, 1):
        rows[f"hpcadapt crash {n}"] = {"job": c["job"],
                                       "after_recovered_kills": c["after_recovered_kills"]}
    for n, r in enumerate(tr, 1):
        rows[f"torchrun kill {n}"] = r
    detect = median([r["detect_s"] for r in hp])
    recover = median([r["recover_s"] for r in hp])
    restart = median([r["restart_s"] for r in tr])
    to_resume = median([r["kill_to_resume_s"] for r in hp])
    to_end = median([r["kill_to_step_end_s"] for r in hp])
    restart_end = median([r["restart_to_step_end_s"] for r in tr])
    ratio = restart / to_resume if None not in (to_resume, restart) and to_resume > 0 else None
    ratio_end = (restart_end / to_end if None not in (to_end, restart_end) and to_end > 0
                 else None)
    return {"benchmark": "failure", "rows": rows, "logs": tmp, "kills": args.kills,
            "mpi": args.mpi,
            "hpcadapt_crashes": crashes,
            "ratios": {
                "failure_jobs_crashed": len(crashes) if args.skip != "hpcadapt" else None,
                "crashed_jobs": len(crashes) if args.skip != "hpcadapt" else None,
                "failure_detect_s": detect,
                "failure_recover_s": recover,
                "failure_kill_to_resume_s": to_resume,
                "failure_kill_to_step_end_s": to_end,
                "torchrun_restart_s": restart,
                "torchrun_restart_to_step_end_s": restart_end,
                # kill -> training resumes, both sides
                "torchrun_restart_vs_failure_recover": ratio,
                # kill -> end of the first step after it, both sides
                "torchrun_restart_vs_failure_recover_to_step_end": ratio_end,
            }}
