"""Synchronisation strategies end to end, on real MPI ranks with the training entry point
(digits, 2 ranks): each trains to within a point of S-SGD (pair-avg, asynchronous, three); a switch in the middle of an epoch
from sma to ssgd and back leaves the replicas bit-identical right after every switch into
ssgd, raises the cluster version and uses every sample of every epoch exactly once; model
averaging goes on across a grow and a shrink."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FULL, ROOT, mpiexec
from runs import Run, every_sample_once, train

pytestmark = pytest.mark.slow

def test_every_strategy_trains_to_within_a_point_of_ssgd(tmp_path):
    acc = {}
    for name, flags in [("ssgd", []), ("sma", ["--strategy", "sma"]),
                        ("local-sgd", ["--strategy", "local-sgd", "--local-sgd-period", "4"]),
                        ("pair-avg", ["--strategy", "pair-avg"])]:
        summary, _ = train(tmp_path, name, flags)
        acc[name] = summary["final_test_accuracy"]
        every_sample_once(tmp_path / f"{name}-samples")
    print("final test accuracy:", acc)
    assert acc["ssgd"] > 0.9, acc
    for name in ("sma", "local-sgd"):
        assert acc[name] >= acc["ssgd"] - 0.01, acc
    # pair-avg averages with whatever the peer last published, so its path depends on the
    # ranks' relative speed (a loaded machine gives staler averages): a wider bound
    assert acc["pair-avg"] >= acc["ssgd"] - 0.03, acc


def test_a_switch_mid_epoch_to_ssgd_and_back_leaves_identical_replicas(tmp_path):
    # digits: 45 steps an epoch at batch 32; every switch lands inside an epoch
    _, rows = train(tmp_path, "switch", [
        "--strategy", "sma", "--check-replicas", "--policy", "sync-switch",
        "--sync-switch-steps", "20:ssgd,50:sma,80:local-sgd,110:ssgd,140:sma"], epochs=4)
    switches = [r for r in rows if r["event"] == "strategy"]
    assert [(s["step"], s["to"]["name"]) for s in switches] == [
        (20, "ssgd"), (50, "sma"), (80, "local-sgd"), (110, "ssgd"), (140, "sma")]
    assert all(s["step"] % 45 != 0 for s in switches)
    into_ssgd = [s for s in switches if s["to"]["name"] == "ssgd"]
    assert all(s["replicas_identical"] is True for s in into_ssgd), into_ssgd
    versions = [s["cluster_version"] for s in switches]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert all(s["cluster_version"] == s["previous_cluster_version"] + 1 for s in switches)
    every_sample_once(tmp_path / "switch-samples")


@pytest.mark.parametrize("strategy", ["sma", pytest.param("pair-avg", marks=pytest.mark.skipif(not FULL, reason="make test-long"))])
def test_model_averaging_goes_on_across_a_grow_and_a_shrink(tmp_path, strategy):
    """Under pair-avg the window is rebuilt for each world (the joiner takes part from its
    first step) and the shrink's leaver frees it with the survivors."""
    run = Run(tmp_path, 2, ["--strategy", strategy, "--max-workers", "3", "--policy",
                            "resize-schedule", "--resize-schedule-steps", "3:3,60:2",
                            "--resize-schedule-hold", "30"])
    def shrunk_and_trained_on():
        rows = run.rows()  # once per poll: the file grows by thousands of steps
        shrinks = [r["step"] for r in rows if r.get("event") == "resize" and r["ok"]
                   and r["new_size"] == 2]
        return bool(shrinks) and any(r.get("event") == "step" and r["world_size"] == 2
                                     and r["step"] > shrinks[0] + 5 for r in rows)

    run.wait_for("the shrink back to 2 and steps after it", shrunk_and_trained_on)
    resizes = [(r["old_size"], r["new_size"]) for r in run.rows()
               if r.get("event") == "resize" and r["ok"]]
    assert resizes[:2] == [(2, 3), (3, 2)], resizes
    run.stop_file.write_text("stop")
    assert run.finish(timeout=120) == 0, run.stderr()[-4000:]
    every_sample_once(run.samples)
    run.assert_no_process_left()


def test_a_switch_from_pair_averaging_into_ssgd_leaves_identical_replicas(tmp_path):
    _, rows = train(tmp_path, "pair-switch", [
        "--strategy", "pair-avg", "--check-replicas", "--policy", "sync-switch",
        "--sync-switch-steps", "20:ssgd,50:pair-avg,80:ssgd"], epochs=3)
    switches = [r for r in rows if r["event"] == "strategy"]
    assert [(s["step"], s["to"]["name"]) for s in switches] == [
        (20, "ssgd"), (50, "pair-avg"), (80, "ssgd")]
    into_ssgd = [s for s in switches if s["to"]["name"] == "ssgd"]
    assert all(s["replicas_identical"] is True for s in into_ssgd), into_ssgd
    every_sample_once(tmp_path / "pair-switch-samples")


@pytest.mark.skipif(not FULL, reason="make test-long")
def test_topology_auto_takes_the_hierarchical_allreduce_on_two_emulated_nodes(tmp_path):
    summary, rows = train(tmp_path, "topo", [
        "--ranks-per-node", "2", "--policy", "topology-auto", "--topology-auto-window", "10"],
        epochs=3, ranks=4)
    switches = [r for r in rows if r["event"] == "topology"]
    assert switches and switches[0]["step"] == 0, switches
    assert (switches[0]["from"], switches[0]["to"]) == ("flat", "hierarchical")
    assert all(s["cluster_version"] == s["previous_cluster_version"] + 1 for s in switches)
    assert summary["final_test_accuracy"] > 0.9, summary
    every_sample_once(tmp_path / "topo-samples")


def test_a_peer_killed_under_pair_averaging_is_recovered_from(tmp_path):
    """A fetch from a dead peer (or the window's next use) raises PeerFailure within the
    bound; the window is kept unfreed and the survivors train on with a new one."""
    run = Run(tmp_path, 2, ["--strategy", "pair-avg", "--max-workers", "3", "--policy",
                            "resize-schedule", "--resize-schedule-steps", "3:3"])
    run.wait_for("a step at 3 workers",
                 lambda: [s for s in run.steps()[-1:] if s["world_size"] == 3])
    grown = [r for r in run.rows() if r.get("event") == "resize" and r["ok"]
             and r["new_size"] == 3][-1]
    run.kill(grown["pids"][2])
    try:
        failure = run.wait_for("the failure record", lambda: [
            r for r in run.rows() if r.get("event") == "failure"])[0]
    except AssertionError:
        # Seen 1 run in 2 early on: UCX aborts a survivor ("Connection reset by remote
        # peer") on a request to the dead joiner (RMA to a spawned process goes through UCX,
        # not shared memory); not recoverable from Python. (MPICH's own SIGSEGV, seen once
        # here in a CI-style run, is Run.wait_for's xfail.)
        if run.proc.poll() is None or "Connection reset by remote peer" not in run.stderr():
            raise
        run.assert_no_process_left()
        pytest.xfail("UCX aborted a survivor on a request to the dead joiner")
    assert failure["recovered"] and failure["dead"] == [2], failure
    run.wait_for("steps on 2 workers after the recovery", lambda: [
        s for s in run.steps() if s["world_size"] == 2 and s["step"] > failure["step"] + 5])
    run.stop_file.write_text("stop")
    assert run.finish(timeout=120) == 0, run.stderr()[-4000:]
    every_sample_once(run.samples)
    run.assert_no_process_left()


def test_a_strategy_registered_from_outside_trains_under_the_entry_point(tmp_path):
    """Adding a strategy is one module (tests/scripts/sparse_sma_strategy.py, outside the
    package) and its registration: its flags reach the entry point, it trains every sample
    once, sync-switch leaves it for ssgd (replicas identical again) and comes back to it with
    its settings (tests/unit/test_strategy.py: plans and checkpoints carry it)."""
    script = str(Path(ROOT) / "tests" / "scripts" / "sparse_sma_strategy.py")
    metrics = tmp_path / "m.jsonl"
    flags = ["--no-progress", "--batch-size", "32", "--lr", "0.05", "--seed", "0",
             "--threads", "1", "--epochs", "4", "--check-replicas",
             "--strategy", "sparse-sma", "--sparse-sma-every", "3", "--sparse-sma-alpha", "0.5",
             "--policy", "sync-switch", "--sync-switch-steps", "40:ssgd,70:sparse-sma",
             "--metrics-file", str(metrics), "--sample-log", str(tmp_path / "samples")]
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, script] + flags, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy sparse-sma (alpha 0.5, every 3 steps)" in proc.stderr
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["final_test_accuracy"] > 0.9, summary
    every_sample_once(tmp_path / "samples")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    switches = [r for r in rows if r["event"] == "strategy"]
    assert [(s["step"], s["to"]["name"]) for s in switches] == [(40, "ssgd"),
                                                                (70, "sparse-sma")]
    assert switches[0]["from"] == {"name": "sparse-sma", "every": 3, "alpha": 0.5}
    assert switches[0]["replicas_identical"] is True
    # the way back takes the strategy's own defaults (sync-switch has no flags for it)
    assert switches[1]["to"] == {"name": "sparse-sma", "every": 4, "alpha": 0.5}
