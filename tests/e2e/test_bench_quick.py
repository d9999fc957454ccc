"""benchmarks/run.py: every suite it offers takes ``--quick`` (the real check that each quick
run works is ``make bench-quick``, part of ``make test``), and a run interrupted by SIGTERM
removes the one temporary folder everything it wrote went to."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, reap_on_teardown

BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import run as bench_run  # noqa: E402  (benchmarks/run.py)
from driver_simple import WORKERS  # noqa: E402


def test_run_lists_every_suite_and_all():
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in list(bench_run.BENCHMARKS) + ["all", "--quick", "--keep-tmp"]:
        assert name in proc.stdout, name
    assert sorted(WORKERS) == sorted(k for k, v in bench_run.BENCHMARKS.items()
                                     if v[0] == "driver_simple")


@pytest.mark.parametrize("name", sorted(n for n, v in bench_run.BENCHMARKS.items()
                                        if v[0] != "driver_simple"))
def test_every_driver_takes_quick(name, capsys):
    import importlib

    driver = importlib.import_module(bench_run.BENCHMARKS[name][0])
    with pytest.raises(SystemExit) as stop:
        driver.run(name, ["--quick", "--help"])   # argparse: the help, then exit 0
    assert stop.value.code in (0, None)
    assert "--quick" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(WORKERS))
def test_every_mpi_worker_takes_quick(name):
    proc = subprocess.run([sys.executable, str(BENCH / WORKERS[name]), "--out", "unused",
                           "--quick", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=f"{BENCH}{os.pathsep}"
                                                f"{os.environ.get('PYTHONPATH', '')}"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--quick" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_removes_the_runs_temporary_folder(tmp_path):
    """The runner's folder (TMPDIR of the run) holds a metrics file of a training in flight;
    SIGTERM to the runner: it ends, and the folder is gone."""
    proc = subprocess.Popen([sys.executable, str(BENCH / "run.py"), "strategies", "--quick"],
                            cwd=ROOT, env=dict(os.environ, TMPDIR=str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    reap_on_teardown(proc)
    deadline = time.monotonic() + 240
    while not list(tmp_path.glob("hpcadapt-bench-*/hpcadapt-strategies-*/*.jsonl")):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no training started within 240 s"
        time.sleep(0.1)
    assert len(list(tmp_path.glob("hpcadapt-bench-*"))) == 1
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-3000:]
    assert list(tmp_path.iterdir()) == [], (list(tmp_path.iterdir()), out[-3000:])
