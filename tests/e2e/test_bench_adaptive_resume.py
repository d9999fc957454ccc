"""benchmarks/run.py adaptive keeps each completed run's record in --results and reuses it: a
sweep killed in the middle resumes, redoing only the runs without a record and leaving the
others untouched; a results folder of another setting and --seeds 1 are refused in one line."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, descendants, reap_on_teardown
from procs import processes_mentioning

CMD = [sys.executable, str(ROOT / "benchmarks" / "run.py"), "adaptive", "--quick",
       "--tasks", "mnist1d"]


def _records(results):
    """The run records (every *.json but meta.json), path -> bytes."""
    return {p: p.read_bytes() for p in results.rglob("*.json") if p.name != "meta.json"}


def _kill_all(proc, tmpdir):
    """SIGKILL the runner's process group, everything below it (MPICH's proxy runs in a
    session of its own) and every process whose command line names the run's TMPDIR (the
    ranks, by their metrics files); wait until none is left."""
    pids = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in pids + processes_mentioning(str(tmpdir)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 60
    while processes_mentioning(str(tmpdir)):
        assert time.monotonic() < deadline, "the killed run's ranks are still alive after 60 s"
        time.sleep(0.1)


def _start(args, tmpdir):
    proc = subprocess.Popen(CMD + args, cwd=ROOT, env=dict(os.environ, TMPDIR=str(tmpdir)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return reap_on_teardown(proc, str(tmpdir))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_killed_sweep_resumes_from_its_records(tmp_path):
    results, tmpdir, out = tmp_path / "results", tmp_path / "tmp", tmp_path / "result.json"
    tmpdir.mkdir()
    args = ["--results", str(results), "--json", str(out)]   # the same command both times
    first = _start(args, tmpdir)
    deadline = time.monotonic() + 400
    while not _records(results):
        if first.poll() is not None:
            pytest.fail(f"the sweep ended before its first record:\n{first.stdout.read()[-3000:]}")
        assert time.monotonic() < deadline, "no run record within 400 s"
        time.sleep(0.05)
    assert first.poll() is None, "the sweep ended before it could be killed"
    _kill_all(first, tmpdir)
    before = _records(results)
    for path, data in before.items():   # written whole or not at all
        assert json.loads(data)["task"] == "mnist1d", path
    assert not out.exists()
    second = _start(args, tmpdir)
    try:
        log, _ = second.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        _kill_all(second, tmpdir)
        pytest.fail("the resumed sweep did not end within 600 s")
    assert second.returncode == 0, log[-4000:]
    reused = [int(n) for n in re.findall(r"reused (\d+) runs", log)]
    assert reused and reused[-1] >= len(before), log[-4000:]
    after = _records(results)
    for path, data in before.items():
        assert after[path] == data, f"{path} changed on the resumed sweep"
    result = json.loads(out.read_text())
    runs = result["runs"]["mnist1d"]
    methods = {r["method"] for r in runs}
    assert len(runs) == 2 * len(methods) and len(methods) >= 2   # 2 seeds x every method
    assert {results / r["record"] for r in runs} == set(after)
    assert result["reused_runs"] == reused[-1]
    assert result["reused_runs"] + result["trained_runs"] == len(runs)
    assert result["trained_runs"] >= 1   # killed before the sweep was done: it resumed
    assert all(len(r["evals"]["noise_scale"]) == len(r["evals"]["step"]) for r in runs)


def _refused(args, tmp_path):
    proc = subprocess.run(CMD + args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert proc.returncode != 0, proc.stdout[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_a_results_folder_of_another_version_is_refused_in_one_line(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "meta.json").write_text(json.dumps({"version": 1, "quick": True,
                                                   "budgets": {"mnist1d": 4000}}))
    line = _refused(["--results", str(results)], tmp_path)
    assert str(results) in line and "version" in line and "--results" in line
    assert [p.name for p in results.iterdir()] == ["meta.json"]   # nothing trained


def test_one_seed_is_refused_in_one_line(tmp_path):
    line = _refused(["--seeds", "1", "--results", str(tmp_path / "results")], tmp_path)
    assert "at least 2 seeds" in line
    assert not (tmp_path / "results").exists()
