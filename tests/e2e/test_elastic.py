"""Elastic membership with real MPI processes: joiners started by the local allocator,
connected through MPI ports, shrinks by split."""

import json
import os

import pytest
from mpi4py import MPI

from conftest import FULL, ROOT, complete_rows, reap_on_teardown, repeats, run_mpi
from hpcadapt.elastic.allocator import LocalAllocator
from hpcadapt.elastic.membership import ElasticController
from hpcadapt.comm.world import World

pytestmark = pytest.mark.slow


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def processes_mentioning(text):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


@pytest.mark.timeout(1800)  # two 40-epoch runs, each with its own 900 s limit
@pytest.mark.skipif(not FULL, reason="make test-long (two 40-epoch runs; the matrix, the soak "
                                     "and the user-script tests resize under make test)")
def test_train_2_4_3_1_2_workers(tmp_path):
    """The issue's schedule through the entry point: identical replicas after every resize,
    every sample of every epoch exactly once across the sizes it saw, the accuracy of a
    fixed-size run, and no process left behind."""
    common = ["-m", "hpcadapt.train", "--model", "cnn", "--epochs", "40", "--no-progress",
              "--lr", "0.05"]
    metrics, samples = tmp_path / "elastic.jsonl", tmp_path / "samples"
    run_mpi(2, common + ["--allocator", "local", "--max-workers", "4", "--policy", "resize-schedule",
                         "--resize-schedule-steps", "5:4,450:3,500:1,550:2",
                         "--check-replicas", "--metrics-file", str(metrics),
                         "--sample-log", str(samples)], timeout=900)
    assert not processes_mentioning(str(metrics)), "a worker outlived the job"
    rows = read_jsonl(metrics)
    resizes = [r for r in rows if r["event"] == "resize"]
    done = [(r["old_size"], r["new_size"]) for r in resizes if r["ok"]]
    assert done == [(2, 4), (4, 3), (3, 1), (1, 2)], resizes
    assert all(r["replicas_identical"] is True for r in resizes if r["ok"])
    assert [r["cluster_version"] for r in resizes if r["ok"]] == [1, 2, 3, 4]
    sizes = {r["world_size"] for r in rows if r["event"] == "step"}
    assert sizes == {1, 2, 3, 4}
    seen = {}
    for f in samples.iterdir():
        for line in f.read_text().splitlines():
            r = json.loads(line)
            seen.setdefault(r["epoch"], []).extend(r["indices"])
    assert sorted(seen) == list(range(40))
    for epoch, indices in seen.items():
        assert sorted(indices) == list(range(1438)), f"epoch {epoch}: a sample skipped or repeated"
    elastic_acc = [r for r in rows if r["event"] == "epoch"][-1]["test_accuracy"]
    fixed = tmp_path / "fixed.jsonl"
    run_mpi(2, common + ["--metrics-file", str(fixed)], timeout=900)
    fixed_acc = [r for r in read_jsonl(fixed) if r["event"] == "epoch"][-1]["test_accuracy"]
    assert abs(elastic_acc - fixed_acc) <= 0.01, (elastic_acc, fixed_acc)


def test_50_grow_shrink_cycles_leak_nothing(tmp_path):
    out = tmp_path / "cycles.json"
    cycles = repeats(50, 20)
    run_mpi(1, [str(ROOT / "tests" / "elastic_cycles.py"), "--cycles", str(cycles), "--out",
                str(out)], timeout=1200)
    r = json.loads(out.read_text())
    s = r["samples"]
    assert len(s) == cycles and r["version"] == 2 * cycles  # one version per resize
    fds = [x["fds"] for x in s]
    assert max(fds) - min(fds) <= 2, fds
    assert all(x["children"] == 0 for x in s)  # every joiner's launcher has exited
    # resident memory: after the first cycles warmed the MPI library's pools, growth stays small
    assert s[-1]["rss_kb"] - s[4]["rss_kb"] < 16 * 1024, [x["rss_kb"] for x in s]


def test_joiner_crashing_during_start_up_is_abandoned(tmp_path):
    out = tmp_path / "crash.json"
    proc = run_mpi(1, [str(ROOT / "tests" / "elastic_cycles.py"), "--cycles", "2", "--crash",
                       "--out", str(out)], timeout=300)
    r = json.loads(out.read_text())
    assert [o.get("abandoned", "") for o in r["outcomes"]] == [
        "joining worker 0 exited with code 3 during start-up"] * 2
    assert r["version"] == 0
    assert "training goes on with 1 workers" in proc.stderr


def test_requests_beyond_the_allocator_are_clipped_or_refused(caplog):
    world = World(MPI.COMM_SELF.Dup())
    ctrl = ElasticController(world, LocalAllocator(3), ["-c", "pass"])
    assert ctrl.clip(0, "test") is None and "at least 1 worker" in caplog.text
    assert ctrl.clip(9, "test") == 3 and "clipped to 3" in caplog.text
    assert ctrl.clip(1, "test") is None  # already that size
    world.free()


def test_a_resizing_policy_without_an_allocator_is_refused_at_start_once(tmp_path):
    """Refused before training (it used to train on at its size, the schedule ignored): one
    line from rank 0, exit 2, no metrics written."""
    metrics = tmp_path / "m.jsonl"
    proc = run_mpi(2, ["-m", "hpcadapt.train", "--epochs", "1", "--no-progress",
                       "--policy", "resize-schedule", "--resize-schedule-steps", "5:3",
                       "--metrics-file", str(metrics)], timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if "needs --max-workers" in line]
    assert lines == ["[rank 0] hpcadapt: --policy resize-schedule resizes the job and needs "
                     "--max-workers (the most workers it may grow to)"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not metrics.exists()


@pytest.mark.skipif(not FULL, reason="make test-long")
def test_the_host_staged_plane_is_rebuilt_across_a_grow_and_a_shrink(tmp_path):
    """The data plane GPUs use when ranks share one, here with CPU tensors: a new
    communicator per cluster version, replicas identical after each resize."""
    from conftest import grow_and_shrink

    rows = grow_and_shrink(tmp_path, ["--data-plane", "host-staged"])
    assert {r["world_size"] for r in rows if r["event"] == "step"} == {1, 2}


def test_a_warm_spare_is_taken_by_a_grow_and_replaced_and_nothing_is_left(tmp_path):
    """--warm-spares 1 with room for 3: a spare starts with the job and reports warm; the
    grow it then triggers is joined by that very process (its pid in the resize line),
    a new spare starts in the freed slot; SIGKILLed while idle, it is replaced; at the end
    no spare process and no spare folder is left."""
    import glob
    import signal
    import subprocess
    import sys

    from conftest import mpiexec, wait_for
    from procs import processes_mentioning

    metrics, stop, grow = tmp_path / "m.jsonl", tmp_path / "STOP", tmp_path / "GROW"
    err = tmp_path / "err"
    spares = tmp_path / "spares"
    spares.mkdir()

    def warm():
        """{folder: pid} of the spares that said they are warm (a folder the job removes
        between the listing and the read is skipped)."""
        found = {}
        for path in glob.glob(str(spares / "hpcadapt-spare-*" / "warm-0")):
            try:
                with open(path, encoding="utf-8") as f:
                    found[os.path.dirname(path)] = int(f.read())
            except FileNotFoundError:
                continue
        return found

    def resizes():
        return [r for r in complete_rows(metrics) if r["event"] == "resize"]

    with open(err, "w") as ferr:
        proc = subprocess.Popen(
            [mpiexec(), "-n", "1", sys.executable, str(ROOT / "tests" / "scripts" /
                                                     "grow_on_file.py"),
             "--grow-file", str(grow), "--allocator", "local", "--max-workers", "3",
             "--warm-spares", "1", "--metrics-file", str(metrics), "--stop-file", str(stop)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=ferr, text=True,
            env=dict(os.environ, TMPDIR=str(spares)))
        reap_on_teardown(proc, str(metrics))
    try:
        first = wait_for(lambda: warm(), "a warm spare", proc, 300, err)
        (folder, spare_pid), = first.items()
        grow.touch()
        done = wait_for(lambda: [r for r in resizes() if r["ok"]], "the grow", proc, 300, err)
        assert done[0]["new_size"] == 2 and spare_pid in done[0]["pids"], done
        assert not os.path.exists(folder)   # a taken spare's folder goes with the grow
        second = wait_for(lambda: warm(), "a new spare in the free slot", proc, 300, err)
        (_, replacement), = second.items()
        assert replacement != spare_pid
        os.kill(replacement, signal.SIGKILL)
        third = wait_for(lambda: {f: p for f, p in warm().items() if p != replacement},
                         "the killed spare replaced", proc, 300, err)
        assert len(third) == 1
        stop.touch()
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.read_text()
    assert "took 1 spare(s) (1 warm)" in text, text[-3000:]
    assert not glob.glob(str(spares / "hpcadapt-spare-*")), "a spare folder was left"
    assert not processes_mentioning(str(metrics)), "a spare outlived the job"
