"""Shared fixtures: the world, and how to launch MPI jobs from a test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The session's own temporary folder, for the tests and every process they start (TMPDIR is
# inherited): what a test leaves there (loader workers' pymp-*, hpcadapt-* folders) fails
# that test, so that nothing accumulates in /tmp. pytest's own folders and torch's compile
# cache are not a test's leftovers.
import tempfile  # noqa: E402

SESSION_TMP = tempfile.mkdtemp(prefix="hpcadapt-tests-")
os.environ["TMPDIR"] = SESSION_TMP
tempfile.tempdir = None
# pytest's own, torch's compile cache, and Open MPI's session folder (made by MPI_Init in
# this very process, and left by Open MPI): removed with the whole folder at the end.
_NOT_LEFTOVERS = ("pytest-of-", "torchinductor_", "ompi.")


def _temp_entries() -> set:
    return {n for n in os.listdir(SESSION_TMP) if not n.startswith(_NOT_LEFTOVERS)}


@pytest.fixture(autouse=True)
def _nothing_left_in_temp(request):
    before = _temp_entries()
    yield
    left = sorted(_temp_entries() - before)
    for name in left:  # one test fails for them, not every test after it
        shutil.rmtree(os.path.join(SESSION_TMP, name), ignore_errors=True)
    if left:
        pytest.fail(f"{request.node.nodeid} left {left} in the temporary folder")


def pytest_sessionfinish(session, exitstatus):
    if not _temp_entries():
        shutil.rmtree(SESSION_TMP, ignore_errors=True)


# `make test` (CI) runs each repeated-fault test, soak and combination matrix at a size that
# exercises every path; `make test-long` (HPCADAPT_TEST_FULL=1) at the full size, the one
# their names and docstrings state (20 kills, every cell of the matrix, ...).
FULL = os.environ.get("HPCADAPT_TEST_FULL") == "1"


def repeats(full: int, ci: int) -> int:
    """How many times a repeated test repeats: ``full`` under make test-long, else ``ci``."""
    return full if FULL else ci


def mpiexec() -> str:
    """The mpiexec beside this Python (the venv's MPICH wheel), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec on this machine")
    return found


def descendants(pid: int) -> List[int]:
    """Every process below ``pid`` (MPICH's proxy starts a session of its own, so a process
    group does not reach the ranks)."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def run_mpi(n: int, args: List[str], *, timeout: float = 300, env: Optional[dict] = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on ``n`` MPI ranks and return the finished process."""
    import signal

    cmd = [mpiexec(), "-n", str(n), sys.executable] + args
    full_env = dict(os.environ)
    full_env.update(env or {})
    # A timeout kills the launcher and every process below it: loader workers left alive
    # would hold the output pipes open and block the read forever.
    popen = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # what it printed says where it hung
        for pid in [popen.pid] + descendants(popen.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out, err = popen.communicate(timeout=60)
        raise AssertionError(f"{' '.join(cmd)} still running after {timeout} s:\n"
                             f"{(out or '')[-4000:]}\n{(err or '')[-4000:]}") from None
    proc = subprocess.CompletedProcess(cmd, popen.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed with {proc.returncode}:\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 600,
             stderr: Optional[Path] = None):
    """Poll ``predicate`` until it returns something true, and return that; fail at once if
    ``proc`` ends first (showing its stderr, from its pipe or from the file ``stderr``).
    Tests wait for events the run reports this way, never for "long enough"."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            text = stderr.read_text() if stderr is not None else proc.stderr.read()
            pytest.fail(f"the run ended before {what}: {text[-3000:]}")
        time.sleep(0.02)
    pytest.fail(f"no {what} within {timeout} s")


_LIVE_JOBS: List[Tuple[subprocess.Popen, Optional[str]]] = []


def reap_on_teardown(proc: subprocess.Popen, mention: Optional[str] = None) -> subprocess.Popen:
    """Have the test's teardown SIGKILL ``proc`` (its process group when it leads one) and
    every process whose command line holds ``mention`` (a run's unique metrics path, for
    joiners in sessions of their own): a test that fails mid-run leaves no job training
    into the tests after it. Returns ``proc``."""
    _LIVE_JOBS.append((proc, mention))
    return proc


@pytest.fixture(autouse=True)
def _reap_live_jobs():
    yield
    import signal

    while _LIVE_JOBS:
        proc, mention = _LIVE_JOBS.pop()
        if proc.poll() is None:
            try:
                if os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
            except ProcessLookupError:
                pass
            proc.wait()
        if mention:
            from procs import processes_mentioning

            for pid in processes_mentioning(mention):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def run_soak_driver(tmp_path: Path, args: List[str], timeout: float) -> Tuple[dict, str]:
    """tests/drivers/soak.py with ``args`` (its work folder and JSON in ``tmp_path``), in a
    session of its own, reaped at teardown: (its JSON result, its output)."""
    import json
    import signal

    out, work = tmp_path / "soak.json", tmp_path / "work"
    cmd = [sys.executable, str(ROOT / "tests" / "drivers" / "soak.py"), "--workdir", str(work),
           "--json", str(out)] + args
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    # the driver ends what it started; this is the last guard (by the run's unique path)
    reap_on_teardown(proc, str(work / "metrics.jsonl"))
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate(timeout=60)
        raise AssertionError(f"the soak driver itself did not end:\n{log[-4000:]}")
    assert out.exists(), log[-4000:]
    return json.loads(out.read_text()), log


def complete_rows(path: Path) -> List[dict]:
    """The records of a JSON-lines file another process may be writing: only lines ended by
    a newline (a long record reaches the file in more than one write)."""
    import json

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line]


def grow_and_shrink(tmp_path: Path, flags: List[str]) -> List[dict]:
    """``python -m hpcadapt.train FLAGS`` on one rank that grows to 2 and shrinks back to 1
    (local allocator), stopped by its stop file once the metrics show both resizes; checks
    that both succeeded with identical replicas and returns the metrics rows."""
    metrics, stop, err = tmp_path / "grow.jsonl", tmp_path / "STOP", tmp_path / "grow.err"

    def rows():
        return complete_rows(metrics)

    def resizes():
        return [(r["old_size"], r["new_size"], r["ok"]) for r in rows()
                if r["event"] == "resize"]

    with open(err, "w") as ferr:
        proc = subprocess.Popen(
            [mpiexec(), "-n", "1", sys.executable, "-m", "hpcadapt.train", "--epochs",
             "100000", "--no-progress", "--allocator", "local", "--max-workers", "2",
             "--policy", "resize-schedule", "--resize-schedule-steps", "5:2,10:1",
             "--resize-schedule-hold", "30", "--check-replicas", "--metrics-file",
             str(metrics), "--stop-file", str(stop)] + flags,
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=ferr)
    try:
        wait_for(lambda: len(resizes()) >= 2, "the grow and the shrink", proc, 300, err)
        stop.touch()
        assert proc.wait(timeout=300) == 0, err.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert resizes() == [(1, 2, True), (2, 1, True)], resizes()
    assert all(r["replicas_identical"] for r in rows()
               if r["event"] == "resize" and r["new_size"] > 1)
    return rows()


@pytest.fixture(scope="session")
def world():
    import hpcadapt

    return hpcadapt.init()
