"""Stop signals: a signal to any one rank stops every rank at the same step boundary, rank 0
saves the state, the job exits with 75, and a restart resumes exactly where it stopped."""

from __future__ import annotations

import collections
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, mpiexec
from hpcadapt.preemption import EXIT_REQUEUE, StopSignals, parse_signal

EPOCHS = 12


def test_parse_signal_and_handler_keeps_the_first():
    assert parse_signal("usr1") == signal.SIGUSR1 and parse_signal("SIGTERM") == signal.SIGTERM
    with pytest.raises(ValueError, match="unknown signal"):
        parse_signal("HUP2")
    stops = StopSignals([signal.SIGUSR2]).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        assert stops.received == "SIGUSR2"
    finally:
        stops.restore()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def _train(tmp_path, samples: str, extra=()):
    return [mpiexec(), "-n", "2", sys.executable, "-m", "hpcadapt.train", "--epochs", str(EPOCHS),
            "--no-progress", "--sample-log", str(tmp_path / samples), "--threads", "1"] + list(extra)


def _summary(stdout: str) -> dict:
    return json.loads([l for l in stdout.splitlines() if l.startswith("{")][-1])


def _rank_pids(folder) -> dict:
    pids = {}
    for path in glob.glob(os.path.join(folder, "samples-*.jsonl")):
        with open(path) as f:
            line = f.readline()
        if line.endswith("\n"):
            pids[json.loads(line)["rank"]] = int(path.rsplit("-", 1)[1].split(".")[0])
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_to_one_rank_saves_state_and_the_restart_finishes_exactly_once(tmp_path, sig):
    ckpt = tmp_path / "state.ckpt"
    flags = ["--checkpoint", str(ckpt), "--metrics-file", str(tmp_path / "m.jsonl")]
    reference = subprocess.run(_train(tmp_path, "ref-samples"), cwd=ROOT, capture_output=True,
                               text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr[-3000:]

    first = subprocess.Popen(_train(tmp_path, "samples", flags), cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    pids = {}
    while time.monotonic() < deadline and len(pids) < 2:
        pids = _rank_pids(tmp_path / "samples")
        time.sleep(0.05)
    time.sleep(0.5)
    os.kill(pids[1], sig)  # rank 1 only: the others learn it through the allreduce
    out, err = first.communicate(timeout=300)
    assert first.returncode == EXIT_REQUEUE, err[-3000:]
    assert ckpt.exists()
    stopped = _summary(out)
    assert stopped["stopped"] and 0 < stopped["steps"] < EPOCHS * 45
    assert f"stopped on a stop signal on another rank at epoch {stopped['epochs']}, " \
           f"step {stopped['steps']}; state saved" in err

    second = subprocess.run(_train(tmp_path, "samples", flags), cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {ckpt} at epoch {stopped['epochs']}, step {stopped['steps']}" in second.stderr
    assert not ckpt.exists()
    seen = collections.Counter()
    for path in glob.glob(str(tmp_path / "samples" / "*.jsonl")):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                seen.update((row["epoch"], i) for i in row["indices"])
    assert len(seen) == EPOCHS * 1438 and set(seen.values()) == {1}
    # Same seed, same size: the interrupted training is the uninterrupted one, bit for bit.
    assert _summary(second.stdout)["final_test_accuracy"] == \
        _summary(reference.stdout)["final_test_accuracy"]
    assert _summary(second.stdout)["steps"] == _summary(reference.stdout)["steps"]


def test_a_signal_during_start_up_waits_for_the_handler(tmp_path):
    """Slurm may signal a requeued job the moment it starts, while torch still loads."""
    ckpt = tmp_path / "state.ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "hpcadapt.train", "--epochs", "2",
                             "--no-progress", "--checkpoint", str(ckpt)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(0.3)  # the interpreter is up; torch is not loaded yet
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_REQUEUE, err[-3000:]
    assert _summary(out)["steps"] == 1 and ckpt.exists()
    assert "stopped on SIGUSR1 at epoch 0, step 1; state saved" in err


def test_a_state_that_cannot_be_saved_is_not_requeued(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "hpcadapt.train", "--epochs", "2",
                             "--no-progress", "--checkpoint", "/proc/hpcadapt-no/state.ckpt"],
                            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]  # not 75: the job script must not requeue
    assert "but the state could not be saved to /proc/hpcadapt-no/state.ckpt" in err
    assert _summary(out)["stopped"] == "SIGTERM; state NOT saved"
