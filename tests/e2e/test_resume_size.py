"""A job that grew, stopped and resumed (a restart, a Slurm requeue) comes back at the size
its checkpoint was written by: it grows back before the first step (--resume-size saved,
the default), or stays at the launch's size when asked (--resume-size launch) or when it
cannot grow (no --max-workers), saying so in one line either way."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, complete_rows, mpiexec, reap_on_teardown, wait_for

pytestmark = pytest.mark.slow

TRAIN = [sys.executable, "-m", "hpcadapt.train", "--no-progress", "--batch-size", "32",
         "--allocator", "local", "--launcher", "process", "--epochs", "1000"]


def _run(args, timeout=300):
    proc = subprocess.run([mpiexec(), "-n", "1"] + TRAIN + args, cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)
    return proc


@pytest.fixture(scope="module")
def grown_checkpoint(tmp_path_factory):
    """A checkpoint written by a job that trained on 2 workers (one joined)."""
    folder = tmp_path_factory.mktemp("grown")
    ckpt, metrics = folder / "c.ckpt", folder / "m.jsonl"
    proc = subprocess.Popen([mpiexec(), "-n", "1"] + TRAIN +
                            ["--max-workers", "2", "--initial-workers", "2", "--checkpoint",
                             str(ckpt), "--metrics-file", str(metrics)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reap_on_teardown(proc, str(metrics))
    grown = wait_for(lambda: [r for r in complete_rows(metrics)
                              if r.get("event") == "resize" and r.get("ok")], "the join", proc)
    wait_for(lambda: sum(r.get("event") == "step" for r in complete_rows(metrics)) >= 3,
             "step 3", proc)
    os.kill(grown[0]["pids"][0], signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    return ckpt


def _steps_after(ckpt, more):
    """--max-steps for a resume of ``ckpt`` that trains ``more`` steps (the signal reached the
    job at a step that depends on the machine's speed: read it from the stop record)."""
    stop = [r for r in complete_rows(ckpt.parent / "m.jsonl") if r.get("event") == "stop"]
    return str(stop[-1]["step"] + more)


def _copy(ckpt, tmp_path):
    target = tmp_path / "c.ckpt"
    shutil.copy(ckpt, target)
    return target


def _resizes(metrics):
    return [r for r in complete_rows(metrics) if r.get("event") == "resize"]


def test_a_resume_grows_back_to_the_size_the_checkpoint_was_written_by(grown_checkpoint,
                                                                      tmp_path):
    ckpt, metrics = _copy(grown_checkpoint, tmp_path), tmp_path / "m.jsonl"
    proc = _run(["--max-workers", "2", "--checkpoint", str(ckpt),
                 "--max-steps", _steps_after(grown_checkpoint, 5),
                 "--metrics-file", str(metrics)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(r["old_size"], r["new_size"], r["ok"], r["reason"]) for r in _resizes(metrics)] \
        == [(1, 2, True, "resuming at the checkpoint's 2 workers")]
    steps = [r for r in complete_rows(metrics) if r.get("event") == "step"]
    assert steps and all(r["world_size"] == 2 for r in steps)
    assert proc.stderr.count("the checkpoint was written by 2 workers: growing back to 2") == 1


@pytest.mark.parametrize("flags, line", [
    (["--max-workers", "2", "--resume-size", "launch"],
     "the checkpoint was written by 2 workers; --resume-size launch: training goes on at 1"),
    ([], "the checkpoint was written by 2 workers; without --max-workers the job cannot grow "
         "back: training goes on at 1"),
])
def test_a_resume_at_the_launch_size_says_so(grown_checkpoint, tmp_path, flags, line):
    ckpt, metrics = _copy(grown_checkpoint, tmp_path), tmp_path / "m.jsonl"
    proc = _run(flags + ["--checkpoint", str(ckpt), "--max-steps",
                         _steps_after(grown_checkpoint, 3),
                         "--metrics-file", str(metrics)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _resizes(metrics) == []
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]
    summary = json.loads([l for l in proc.stdout.splitlines() if l.startswith("{")][-1])
    assert summary["world_size"] == 1
