"""Slurm integration. The parsers run on output recorded from a real Slurm (tests/data/slurm);
the rest runs against the real test cluster (slurm/testcluster), which this module starts
when none is up and stops afterwards by its recorded PIDs."""

from __future__ import annotations

import collections
import glob
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcadapt.errors import AllocationError
from hpcadapt.slurm.commands import (check_hostlist, check_job_id, check_node_name,
                                     check_partition, parse_cpus_per_node, parse_duration,
                                     parse_hostnames, parse_key_values, parse_sbatch_job_id,
                                     parse_salloc_job_id, parse_show_config,
                                     parse_sinfo_nodes, parse_squeue, permits_job_expansion,
                                     run_slurm, show_hostnames, SlurmCommandError)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "slurm"
TRAIN_SBATCH = str(ROOT / "slurm" / "train.sbatch")


def data(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


# -- pure parsers on recorded output ---------------------------------------------------------
def test_parsers_read_recorded_slurm_output():
    assert parse_sbatch_job_id(data("sbatch_parsable.txt")) == "8"
    assert parse_sbatch_job_id("12;cluster\n") == "12"
    assert parse_hostnames(data("scontrol_show_hostnames.txt")) == ["n1", "n2", "n4"]
    job = parse_key_values(data("scontrol_show_job_running.txt"))
    assert job["JobId"] == "8" and job["JobState"] == "RUNNING" and job["NodeList"] == "n[1-2]"
    assert job["NumNodes"] == "2" and job["TimeLimit"] == "00:10:00"
    pending = parse_key_values(data("scontrol_show_job_pending.txt"))
    assert pending["JobState"] == "PENDING" and pending["Reason"] == "PartitionConfig"
    states = parse_squeue(data("squeue_states.txt"))
    assert states["8"].state == "RUNNING" and states["8"].nodes == "n[1-2]"
    assert states["8"].time_left_s == 600 and not states["8"].finished
    assert parse_squeue(data("squeue_pending.txt"))["9"].reason == "PartitionConfig"
    assert parse_squeue(data("squeue_cancelled.txt"))["9"].finished
    nodes = parse_sinfo_nodes(data("sinfo_nodes.txt"))
    assert [n.state for n in nodes.values()] == ["allocated", "allocated", "idle", "idle"]
    assert nodes["n1"].cpus == 2 and nodes["n1"].partition == "debug"
    assert all(n.idle for n in parse_sinfo_nodes(data("sinfo_nodes_idle.txt")).values())
    config = parse_show_config(data("scontrol_show_config.txt"))
    assert config["ClusterName"] == "hpcadapt" and permits_job_expansion(config)
    assert not permits_job_expansion({"SchedulerParameters": "bf_continue,permit_job_expansionX"})
    assert parse_salloc_job_id(data("salloc_pending.err")) == "73"
    assert parse_salloc_job_id("salloc: error: invalid partition specified: x") is None


def test_durations_and_cpu_lists():
    assert parse_duration("10:00") == 600
    assert parse_duration("1-02:03:04") == 93784
    assert parse_duration("UNLIMITED") == math.inf
    assert parse_cpus_per_node("2(x3),1") == [2, 2, 2, 1]
    for bad in ("soon", "1:2:3:4"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    with pytest.raises(ValueError):
        parse_cpus_per_node("2(x)")
    with pytest.raises(ValueError, match="not a job id"):
        parse_sbatch_job_id("sbatch: error: Batch job submission failed")


@pytest.mark.parametrize("check,value", [
    (check_job_id, "12; scancel -u root"), (check_job_id, "-1"), (check_job_id, ""),
    (check_node_name, "n1 n2"), (check_node_name, "-n1"), (check_node_name, "n[1-2]"),
    (check_partition, "debug,other"), (check_partition, "--all"),
    (check_hostlist, "n[1-2] && reboot"),
])
def test_values_from_the_environment_are_validated(check, value):
    with pytest.raises(AllocationError):
        check(value)


def test_a_failing_command_reports_the_command_and_its_stderr():
    with pytest.raises(SlurmCommandError, match=r"`ls /nonexistent-hpcadapt`: exit code 2: .*No such file"):
        run_slurm(["ls", "/nonexistent-hpcadapt"])
    with pytest.raises(SlurmCommandError, match="not found; is Slurm installed"):
        run_slurm(["hpcadapt-no-such-command"])


def test_slurm_allocator_outside_a_job_falls_back_to_local_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_JOB")}
    proc = subprocess.run([sys.executable, "-m", "hpcadapt.train", "--allocator", "slurm",
                           "--max-workers", "2", "--epochs", "1", "--no-progress",
                           "--max-steps", "3"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if "Slurm allocator unavailable" in l]
    assert len(lines) == 1 and "using the local allocator" in lines[0], proc.stderr


# -- against the real test cluster ---------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster():
    from hpcadapt.slurm.testcluster.cluster import TestCluster, ensure_packages

    c = TestCluster()
    started = False
    if not c.running():
        if os.geteuid() != 0:
            try:
                ensure_packages()
            except Exception as exc:  # not root and Slurm missing: nothing to test against
                pytest.skip(f"no Slurm test cluster possible here: {exc}")
        c.up()
        started = True
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(c.slurm_conf)
    try:
        yield c
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        if started:
            c.down()


def job_env(**extra) -> dict:
    from hpcadapt.slurm.testcluster.watch import job_environment

    return job_environment(sys.executable, **extra)


def job_output(folder: Path, job: str) -> str:
    return (folder / f"hpcadapt-train-{job}.out").read_text(encoding="utf-8")


def summary_of(output: str) -> dict:
    lines = [l for l in output.splitlines() if l.startswith("{\"final_test_accuracy\"")]
    assert lines, output[-3000:]
    return json.loads(lines[-1])


def samples_seen(folder: Path) -> collections.Counter:
    seen: collections.Counter = collections.Counter()
    for path in glob.glob(str(folder / "samples" / "*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                seen.update((row["epoch"], i) for i in row["indices"])
    return seen


def assert_exactly_once(folder: Path, epochs: int, n_train: int = 1438) -> None:
    seen = samples_seen(folder)
    assert len(seen) == epochs * n_train, len(seen)
    assert set(seen.values()) == {1}, collections.Counter(seen.values())


@pytest.mark.slurm
def test_allocation_is_read_from_the_job_environment(cluster):
    code = ("import json; from hpcadapt.slurm import Allocation; a = Allocation.from_environment(); "
            "print(json.dumps([a.job_id, a.partition, a.nodes, a.cpus_per_node, a.gpus_per_node, "
            "a.time_limit_s]))")
    out = run_slurm(["srun", "-N2", "-n2", "--exclusive", "-t", "5", sys.executable, "-c", code],
                    timeout=120, env=job_env())
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("[")]
    assert len(rows) == 2 and rows[0] == rows[1]
    job_id, partition, nodes, cpus, gpus, left = rows[0]
    assert job_id.isdigit() and partition == "debug" and gpus == 0
    assert len(nodes) == 2 and len(set(nodes)) == 2 and all(n.startswith("n") for n in nodes)
    assert cpus == [2, 2]
    assert 200 < left <= 300


def hostnames(nodelist: str) -> set:
    return set(show_hostnames(nodelist))


@pytest.mark.slurm
@pytest.mark.parametrize("mode", ["companion", "expand"])
def test_grow_to_three_nodes_and_back_releases_the_nodes_while_training_goes_on(cluster, tmp_path,
                                                                               mode):
    from hpcadapt.slurm.testcluster.watch import JobWatcher, submit

    args = ["--epochs", "40", "--policy", "resize-schedule", "--resize-schedule-steps", "5:3,10:1",
            "--resize-schedule-hold", "150", "--metrics-file", "m.jsonl", "--sample-log",
            "samples", "--check-replicas", "--slurm-grow", mode]
    with JobWatcher() as watch:
        job = submit(TRAIN_SBATCH, args, env=job_env(MAX_NODES=3), cwd=str(tmp_path))
        final = watch.wait_until_gone(job, 600)
    out = job_output(tmp_path, job)
    assert final.state == "COMPLETED", out[-3000:]
    obs = [o for o in watch.observations if job in o.jobs]
    companions = f"hpcadapt-join-{job}"

    def running(o):
        return o.jobs[job].state == "RUNNING"

    first_node = hostnames(next(o.jobs[job].nodes for o in obs if running(o)))
    assert len(first_node) == 1
    if mode == "companion":
        # Two companion jobs, one node each, beside the training job.
        grown = [i for i, o in enumerate(obs) if running(o) and
                 len([j for j in o.named(companions) if j.state == "RUNNING"]) == 2]
        assert grown, "never saw two companion jobs running beside the training job"
        extra_nodes = {j.nodes for j in obs[grown[0]].named(companions)}
        assert all(j.state == "COMPLETED" for j in obs[-1].named(companions))
    else:
        # The training job itself holds three nodes, then one again; no companion jobs.
        grown = [i for i, o in enumerate(obs) if running(o) and
                 len(hostnames(o.jobs[job].nodes)) == 3]
        assert grown, "never saw the training job expanded to three nodes"
        extra_nodes = hostnames(obs[grown[0]].jobs[job].nodes) - first_node
        assert not any(o.named(companions) for o in obs)
        shrunk = [o for o in obs[grown[-1]:] if running(o) and
                  hostnames(o.jobs[job].nodes) == first_node]
        assert shrunk, "the job's node list never went back to its first node"
    assert len(extra_nodes) == 2 and not extra_nodes & first_node
    assert all(obs[grown[0]].nodes[n].state == "allocated" for n in extra_nodes)
    released = [o for o in obs[grown[-1]:] if running(o) and
                all(o.nodes[n].idle for n in extra_nodes)]
    assert released, "the added nodes were not idle in sinfo while the training still ran"

    summary = summary_of(out)
    assert summary["final_test_accuracy"] >= 0.95 and summary["world_size"] == 1
    sizes = [(r["old_size"], r["new_size"], r["ok"]) for r in summary["resizes"]]
    assert sizes == [(1, 3, True), (3, 1, True)], summary["resizes"]
    steps = [json.loads(l) for l in (tmp_path / "m.jsonl").read_text().splitlines()]
    resizes = [r for r in steps if r.get("event") == "resize"]
    assert all(r["replicas_identical"] for r in resizes if r["new_size"] > 1)
    sizes_trained = [r["world_size"] for r in steps if r.get("event") == "step"]
    assert sizes_trained.count(3) >= 150 and sizes_trained[-1] == 1
    assert_exactly_once(tmp_path, 40)


@pytest.mark.slurm
def test_requests_that_cannot_be_met_leave_training_running_with_the_reason(cluster, tmp_path):
    from hpcadapt.slurm.testcluster.watch import JobWatcher, submit

    common = ["--epochs", "3", "--policy", "resize-schedule", "--metrics-file", "m.jsonl"]
    too_many, bad_partition, limit = (tmp_path / "too-many", tmp_path / "bad-partition",
                                      tmp_path / "limit")
    for folder in (too_many, bad_partition, limit):
        folder.mkdir()
    with JobWatcher() as watch:
        a = submit(TRAIN_SBATCH, common + ["--resize-schedule-steps", "3:6"],
                   env=job_env(MAX_NODES=6), cwd=str(too_many))
        b = submit(TRAIN_SBATCH, common + ["--resize-schedule-steps", "3:2",
                                           "--slurm-partition", "nope"],
                   env=job_env(MAX_NODES=2), cwd=str(bad_partition))
        # The test cluster's partition "short" allows one minute; the job has an hour left.
        c = submit(TRAIN_SBATCH, common + ["--resize-schedule-steps", "3:2",
                                           "--slurm-partition", "short"],
                   env=job_env(MAX_NODES=2), cwd=str(limit))
        states = [watch.wait_until_gone(j, 300) for j in (a, b, c)]
    assert [s.state for s in states] == ["COMPLETED"] * 3
    out_a, out_b, out_c = (job_output(too_many, a), job_output(bad_partition, b),
                           job_output(limit, c))
    assert "5 more node(s) requested, but partition 'debug' has 4 nodes" in out_a
    assert "partition 'nope' has no nodes or does not exist" in out_b
    # The failing command and its stderr, as Slurm printed it.
    assert "`sbatch --parsable --nodes=1" in out_c and "--partition=short" in out_c
    assert "exit code 1: sbatch: error: Batch job submission failed: Requested time limit " \
           "is invalid" in out_c
    for out in (out_a, out_b, out_c):
        s = summary_of(out)
        assert s["world_size"] == 1 and s["epochs"] == 3 and not s["resizes"][0]["ok"]
        assert "training goes on with 1 workers" in out
    assert not any(o.named(f"hpcadapt-join-{j}") for o in watch.observations for j in (a, b, c))


@pytest.mark.slurm
@pytest.mark.parametrize("mode", ["companion", "expand"])
def test_a_request_pending_past_the_timeout_is_cancelled_and_reported(cluster, tmp_path, mode):
    from hpcadapt.slurm.testcluster.watch import JobWatcher, submit

    blocker = run_slurm(["sbatch", "--parsable", "-N3", "--exclusive", "-o", "/dev/null",
                         "--wrap", "sleep 300"]).strip()
    try:
        with JobWatcher() as watch:
            job = submit(TRAIN_SBATCH, ["--epochs", "40", "--policy", "resize-schedule",
                                        "--resize-schedule-steps", "3:2",
                                        "--slurm-pending-timeout", "4", "--slurm-grow", mode],
                         env=job_env(MAX_NODES=2), cwd=str(tmp_path))
            final = watch.wait_until_gone(job, 600)
    finally:
        run_slurm(["scancel", blocker])
    out = job_output(tmp_path, job)
    assert final.state == "COMPLETED", out[-3000:]
    if mode == "companion":
        assert "still pending after 4 s (reason Resources); cancelled" in out
        requests = watch.observations[-1].named(f"hpcadapt-join-{job}")
    else:
        assert "by 1 node(s)" in out and "still pending after 4 s; cancelled" in out
        requests = watch.observations[-1].named(f"hpcadapt-expand-{job}")
    assert [c.state for c in requests] == ["CANCELLED"]
    s = summary_of(out)
    assert s["world_size"] == 1 and s["epochs"] == 40 and s["final_test_accuracy"] >= 0.95


@pytest.mark.slurm
def test_usr1_saves_the_state_and_the_requeued_job_finishes_exactly_once(cluster, tmp_path):
    from hpcadapt.slurm.testcluster.watch import submit

    epochs = 30
    job = submit(TRAIN_SBATCH, ["--epochs", str(epochs), "--metrics-file", "m.jsonl",
                                "--sample-log", "samples"], env=job_env(), cwd=str(tmp_path))
    metrics = tmp_path / "m.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count('"event": "step"') >= 100:
            break
        time.sleep(0.2)
    run_slurm(["scancel", "--signal=USR1", job])
    from hpcadapt.slurm.testcluster.watch import JobWatcher

    final = JobWatcher().wait_until_gone(job, 600)
    out = job_output(tmp_path, job)
    assert final.state == "COMPLETED", out[-3000:]
    assert "stopped on SIGUSR1" in out and f"requeueing job {job}" in out
    assert "(restart 1)" in out and f"resumed from hpcadapt-{job}.ckpt" in out
    shown = parse_key_values(run_slurm(["scontrol", "show", "job", job]))
    assert shown["Restarts"] == "1"
    summary = summary_of(out)
    assert summary["epochs"] == epochs and summary["final_test_accuracy"] >= 0.95
    assert_exactly_once(tmp_path, epochs)
    assert not (tmp_path / f"hpcadapt-{job}.ckpt").exists()  # removed once training finished


@pytest.mark.slurm
def test_time_limit_signal_requeues_until_the_training_is_done(cluster, tmp_path):
    """The real thing: a two-minute job that needs longer. Slurm sends USR1 60 s before the
    limit (give or take its 30 s of slack: between 30 and 60 s into the run), the state is
    saved, the job requeued, and so on until the training (90 s or more) is done."""
    from hpcadapt.slurm.testcluster.watch import JobWatcher, submit

    epochs = 1000
    job = submit(TRAIN_SBATCH, ["--epochs", str(epochs), "--sample-log", "samples"],
                 env=job_env(), cwd=str(tmp_path),
                 sbatch_options=["--time=2", "--signal=USR1@60"])
    final = JobWatcher().wait_until_gone(job, 1200)
    out = job_output(tmp_path, job)
    assert final.state == "COMPLETED", out[-3000:]
    restarts = int(parse_key_values(run_slurm(["scontrol", "show", "job", job]))["Restarts"])
    assert restarts >= 1
    assert out.count("stopped on SIGUSR1") == restarts == out.count("resumed from")
    assert summary_of(out)["epochs"] == epochs
    assert_exactly_once(tmp_path, epochs)
