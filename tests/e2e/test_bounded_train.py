"""Bounded-delay aggregation end to end, on real MPI ranks with the training entry point
(digits): with one rank slowed 3x it trains to within a point of S-SGD, applies no update
older than --max-delay, counts what it dropped (per round and in the summary) and uses every
sample of every epoch exactly once; the straggler-async policy switches to it while a
straggler lasts and back to S-SGD (replicas bit-identical) when it goes; it goes on across a
grow and a shrink; bad input is one clear line."""

import json
import subprocess
import sys

import pytest

from conftest import FULL, ROOT, mpiexec, reap_on_teardown
from runs import TRAIN, Run, every_sample_once, train

pytestmark = pytest.mark.slow


def _train(tmp_path, name, flags, epochs=8, ranks=3):
    """Digits on 3 ranks by default: rank 0 aggregates, two workers train."""
    return train(tmp_path, name, flags, epochs=epochs, ranks=ranks)


@pytest.mark.skipif(not FULL, reason="make test-long")
def test_bounded_delay_with_a_slowed_rank_bounds_delays_and_matches_ssgd(tmp_path):
    ssgd, _ = _train(tmp_path, "ssgd", [])
    summary, rows = _train(tmp_path, "bd", ["--strategy", "bounded-delay", "--max-delay", "2",
                                            "--async-round-steps", "20", "--slow-rank", "2",
                                            "--slow-compute", "3"])
    every_sample_once(tmp_path / "bd-samples")
    acc = {"ssgd": ssgd["final_test_accuracy"], "bd": summary["final_test_accuracy"]}
    print("final test accuracy:", acc, "bounded delay:", summary["bounded_delay"])
    assert acc["ssgd"] > 0.9 and acc["bd"] >= acc["ssgd"] - 0.01, acc
    rounds = [r for r in rows if r.get("event") == "bounded-delay"]
    totals = summary["bounded_delay"]
    assert totals["rounds"] == len(rounds) >= 8 * 3  # 45 steps an epoch: 3 rounds each
    assert max(int(d) for d in totals["delays_applied"]) <= 2
    assert all(int(d) > 2 for d in totals["delays_dropped"])
    assert sum(totals["delays_dropped"].values()) == totals["dropped_updates"] == \
        sum(r["dropped_updates"] for r in rounds)
    assert sum(totals["delays_applied"].values()) == totals["applied_updates"]
    assert all(r["samples"] == 20 * 32 or r["step"] % 45 == 0 for r in rounds)
    # the slowed worker sent fewer updates than the other one
    per_worker = {}
    for r in rounds:
        for w, n in r["updates_per_worker"].items():
            per_worker[w] = per_worker.get(w, 0) + n
    assert per_worker["2"] < per_worker["1"], per_worker


@pytest.mark.skipif(not FULL, reason="make test-long")
def test_straggler_async_switches_while_the_straggler_lasts(tmp_path):
    _, rows = _train(tmp_path, "sa", [
        "--policy", "straggler-async", "--straggler-async-patience", "3",
        "--straggler-async-factor", "3", "--straggler-async-round-steps", "5",
        "--slow-rank", "2", "--slow-compute", "10", "--slow-until", "60", "--check-replicas"],
        epochs=4)
    switches = [(r["step"], r["from"]["name"], r["to"]["name"], r["replicas_identical"])
                for r in rows if r.get("event") == "strategy"]
    assert switches[0][1:3] == ("ssgd", "bounded-delay") and switches[0][0] < 60, switches
    assert switches[1][1:] == ("bounded-delay", "ssgd", True) and switches[1][0] > 60, switches
    assert any(r.get("event") == "bounded-delay" for r in rows)
    every_sample_once(tmp_path / "sa-samples")


def test_bounded_delay_goes_on_across_a_grow_and_a_shrink(tmp_path):
    run = Run(tmp_path, 2, ["--strategy", "bounded-delay", "--async-round-steps", "5",
                            "--max-workers", "3", "--policy", "resize-schedule",
                            "--resize-schedule-steps", "3:3,60:2",
                            "--resize-schedule-hold", "30"])

    def shrunk_and_trained_on():
        rows = run.rows()
        shrinks = [r["step"] for r in rows if r.get("event") == "resize" and r["ok"]
                   and r["new_size"] == 2]
        return bool(shrinks) and any(r.get("event") == "bounded-delay"
                                     and r["world_size"] == 2
                                     and r["step"] > shrinks[0] + 10 for r in rows)

    run.wait_for("the shrink back to 2 and rounds after it", shrunk_and_trained_on)
    rows = run.rows()
    resizes = [(r["old_size"], r["new_size"]) for r in rows
               if r.get("event") == "resize" and r["ok"]]
    assert resizes[:2] == [(2, 3), (3, 2)], resizes
    assert any(r.get("event") == "bounded-delay" and r["world_size"] == 3 for r in rows)
    run.stop_file.write_text("stop")
    assert run.finish(timeout=120) == 0, run.stderr()[-4000:]


@pytest.mark.parametrize("flags, ranks, message", [
    (["--strategy", "bounded-delay"], 1, "--strategy bounded-delay needs at least 2 workers"),
    (["--strategy", "bounded-delay", "--max-delay", "-1"], 1, "--max-delay: must be >= 0"),
    (["--strategy", "pair-avg"], 1, "--strategy pair-avg needs at least 2 workers"),
    (["--async-round-steps", "0"], 1, "--async-round-steps"),
])
def test_bad_input_is_one_clear_line(tmp_path, flags, ranks, message):
    proc = subprocess.run([mpiexec(), "-n", str(ranks), sys.executable] + TRAIN +
                          ["--epochs", "1"] + flags, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]


def test_a_stop_signal_ends_a_round_saved_and_the_restart_finishes_exactly_once(tmp_path):
    """Slurm's preemption: every rank gets SIGTERM while rounds run; the job stops at the
    round's end with the state saved (exit 75), and the restart trains on from there with
    every sample of every epoch exactly once across both."""
    import collections
    import os
    import signal

    from conftest import wait_for
    from procs import python_ranks

    ckpt, metrics = tmp_path / "state.ckpt", tmp_path / "m.jsonl"
    samples = tmp_path / "samples"
    flags = ["--strategy", "bounded-delay", "--async-round-steps", "5", "--checkpoint",
             str(ckpt), "--sample-log", str(samples)]
    first = subprocess.Popen([mpiexec(), "-n", "3", sys.executable] + TRAIN +
                             ["--epochs", "1000", "--metrics-file", str(metrics)] + flags,
                             cwd=ROOT, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    reap_on_teardown(first, str(metrics))
    wait_for(lambda: metrics.exists() and metrics.read_text().count('"bounded-delay"') >= 3,
             "three rounds", first)
    for pid in python_ranks(str(metrics)):
        os.kill(pid, signal.SIGTERM)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 75, err[-3000:]
    stopped = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    assert stopped["stopped"] and ckpt.exists()
    total = stopped["steps"] + 2 * 45 + 7
    second = subprocess.run([mpiexec(), "-n", "3", sys.executable] + TRAIN +
                            ["--epochs", "1000", "--max-steps", str(total)] + flags,
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr
    resumed = json.loads([line for line in second.stdout.splitlines()
                          if line.startswith("{")][-1])
    assert resumed["steps"] == total
    seen = collections.Counter()
    for f in samples.iterdir():
        for line in f.read_text().splitlines():
            row = json.loads(line)
            seen.update((row["epoch"], i) for i in row["indices"])
    assert set(seen.values()) == {1}  # nothing twice
    last = max(e for e, _ in seen)
    assert all(sum(1 for (e, _) in seen if e == k) == 1438 for k in range(last))


def test_a_worker_killed_in_a_round_is_recovered_and_rounds_go_on(tmp_path):
    """SIGKILL of a joined worker while rounds run: the aggregator and the other worker
    notice it in their bounded waits, recover at 2 ranks, and rounds go on. The sample log
    is written by the aggregator when a round completes, so it shows the broken round once
    (redone): what it checks is that the survivors agreed on the round's start (a wrong
    cursor would skip or repeat samples)."""
    run = Run(tmp_path, 2, ["--strategy", "bounded-delay", "--async-round-steps", "5",
                            "--max-workers", "3", "--policy", "resize-schedule",
                            "--resize-schedule-steps", "3:3", "--check-replicas"])
    run.wait_for("a round at 3 workers", lambda: [
        r for r in run.rows() if r.get("event") == "bounded-delay" and r["world_size"] == 3])
    grown = [r for r in run.rows() if r.get("event") == "resize" and r["ok"]
             and r["new_size"] == 3][-1]
    run.kill(grown["pids"][2])
    failure = run.wait_for("the failure record", lambda: [
        r for r in run.rows() if r.get("event") == "failure"])[0]
    assert failure["recovered"] and failure["dead"] == [2] and failure["world_size"] == 2
    run.wait_for("rounds at 2 workers after the recovery", lambda: [
        r for r in run.rows() if r.get("event") == "bounded-delay" and r["world_size"] == 2
        and r["step"] > failure["step"] + 10])
    run.stop_file.write_text("stop")
    assert run.finish(timeout=120) == 0, run.stderr()[-4000:]
    every_sample_once(run.samples)
    run.assert_no_process_left()


@pytest.mark.skipif(not FULL, reason="make test-long")
def test_the_divergence_guard_counts_updates_not_rounds(tmp_path):
    """--lr 1e6 under bounded delay: the updates turn non-finite; the guard counts them (one
    round of 20 steps holds far more than --max-nonfinite-steps 5), so the job stops with
    exit code 1 in the first rounds, saying how many updates, instead of training its 10
    epochs to the end at chance accuracy."""
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.run([mpiexec(), "-n", "3", sys.executable] + TRAIN +
                          ["--strategy", "bounded-delay", "--async-round-steps", "20",
                           "--lr", "1e6", "--epochs", "10", "--metrics-file", str(metrics)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["stopped"].split(" with ")[0].endswith("updates"), summary["stopped"]
    assert int(summary["stopped"].split()[0]) >= 5
    assert summary["bounded_delay"]["rounds"] <= 5, summary
