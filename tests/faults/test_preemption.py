"""Stop signals: a signal to any one rank stops every rank at the same step boundary, rank 0
saves the state, the job exits with 75, and a restart resumes exactly where it stopped."""

from __future__ import annotations

import collections
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import FULL, ROOT, mpiexec, reap_on_teardown, wait_for
from hpcadapt.base.preemption import EXIT_REQUEUE, StopSignals, parse_signal


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
    return [mpiexec(), "-n", "2", sys.executable, "-m", "hpcadapt.train",
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


def _steps_reported(metrics) -> int:
    return metrics.read_text().count('"event": "step"') if metrics.exists() else 0


def _seen(folder) -> collections.Counter:
    seen: collections.Counter = collections.Counter()
    for path in glob.glob(str(folder / "*.jsonl")):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                seen.update((row["epoch"], i) for i in row["indices"])
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_to_one_rank_saves_state_and_the_restart_finishes_exactly_once(tmp_path, sig):
    """Train until told: the signal goes to rank 1 once the run has reported step 5, so the
    test holds on a fast machine and a slow one. The restart and an uninterrupted reference
    then train to the same step count (--max-steps) and must agree bit for bit."""
    ckpt, metrics = tmp_path / "state.ckpt", tmp_path / "m.jsonl"
    flags = ["--epochs", "1000", "--checkpoint", str(ckpt)]
    first = subprocess.Popen(_train(tmp_path, "samples", flags + ["--metrics-file", str(metrics)]),
                             cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reap_on_teardown(first, str(metrics))
    wait_for(lambda: _steps_reported(metrics) >= 5, "step 5", first)
    # The sample log is buffered: rank 1's first line (with its pid) may come a little later.
    pids = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(_rank_pids(tmp_path / "samples")),
                     "both ranks' sample logs", first)
    os.kill(pids[1], sig)  # rank 1 only: the others learn it through the control reduction
    out, err = first.communicate(timeout=300)
    assert first.returncode == EXIT_REQUEUE, err[-3000:]
    assert ckpt.exists()
    stopped = _summary(out)
    assert stopped["stopped"] == "a stop signal on another rank" and stopped["steps"] >= 5
    assert f"stopped on a stop signal on another rank at epoch {stopped['epochs']}, " \
           f"step {stopped['steps']}; state saved" in err

    total = stopped["steps"] + 2 * 45 + 7  # two more epochs and then some (45 steps each)
    second = subprocess.run(_train(tmp_path, "samples", flags + ["--max-steps", str(total)]),
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {ckpt} at epoch {stopped['epochs']}, step {stopped['steps']}" in second.stderr
    assert not ckpt.exists()
    reference = subprocess.run(_train(tmp_path, "ref-samples", ["--epochs", "1000", "--max-steps",
                                                                str(total)]),
                               cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr[-3000:]
    seen, ref_seen = _seen(tmp_path / "samples"), _seen(tmp_path / "ref-samples")
    assert set(seen.values()) == {1} and seen == ref_seen  # nothing skipped, nothing twice
    full_epochs = max(e for e, _ in seen)
    assert all(sum(1 for (e, _) in seen if e == k) == 1438 for k in range(full_epochs))
    # Same seed, same size: the interrupted training is the uninterrupted one, bit for bit.
    resumed, ref = _summary(second.stdout), _summary(reference.stdout)
    assert resumed["steps"] == ref["steps"] == total
    assert resumed["model_digest"] == ref["model_digest"]
    assert resumed["final_test_accuracy"] == ref["final_test_accuracy"]


def _blocked(pid: int, sig: int) -> bool:
    """Whether ``pid`` blocks ``sig`` now (the SigBlk mask in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(l.split()[1], 16) for l in f if l.startswith("SigBlk:"))
    except (OSError, StopIteration):
        return False
    return bool(mask & (1 << (sig - 1)))


STARTS = {
    "module": [sys.executable, "-m", "hpcadapt.train"],
    "package": [sys.executable, "-m", "hpcadapt"],
    "console-script": [os.path.join(os.path.dirname(sys.executable), "hpcadapt-train")],
    "user-script": [sys.executable, str(ROOT / "examples" / "mnist1d_adamw.py"), "--samples",
                    "500", "--workers", "0"],
}


@pytest.mark.parametrize("start", sorted(STARTS))
def test_a_signal_during_start_up_waits_for_the_handler(tmp_path, start):
    """Slurm may signal a requeued job the moment it starts, while torch still loads: the
    signal is sent as soon as the process blocks it, before any handler exists, through
    every way of starting."""
    ckpt = tmp_path / "state.ckpt"
    proc = subprocess.Popen(STARTS[start] + ["--epochs", "2", "--no-progress", "--checkpoint",
                                             str(ckpt)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reap_on_teardown(proc, str(ckpt))
    wait_for(lambda: _blocked(proc.pid, signal.SIGUSR1), "SIGUSR1 blocked", proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_REQUEUE, err[-3000:]
    assert _summary(out)["steps"] == 1 and ckpt.exists()
    assert "stopped on SIGUSR1 at epoch 0, step 1; state saved" in err


def test_a_checkpoint_folder_that_cannot_be_written_is_refused_at_start():
    proc = subprocess.run([sys.executable, "-m", "hpcadapt.train", "--epochs", "2",
                           "--no-progress", "--checkpoint", "/proc/hpcadapt-no/state.ckpt"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--checkpoint /proc/hpcadapt-no/state.ckpt: cannot write in /proc/hpcadapt-no" \
        in proc.stderr and "Traceback" not in proc.stderr


def test_a_state_that_cannot_be_saved_is_not_requeued(tmp_path):
    """The folder was writable at start but is gone when the signal comes."""
    folder, metrics = tmp_path / "gone", tmp_path / "m.jsonl"
    folder.mkdir()
    ckpt = folder / "state.ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "hpcadapt.train", "--epochs", "1000",
                             "--no-progress", "--checkpoint", str(ckpt), "--metrics-file",
                             str(metrics)], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    reap_on_teardown(proc, str(metrics))
    wait_for(lambda: _steps_reported(metrics) >= 3, "step 3", proc)
    shutil.rmtree(folder)   # with the checkpoint's lease in it
    folder.write_text("a file where the folder was")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]  # not 75: the job script must not requeue
    assert f"but the state could not be saved to {ckpt}" in err
    assert _summary(out)["stopped"] == "SIGTERM; state NOT saved"


def _start_and_wait_for_a_step(tmp_path, flags):
    metrics = tmp_path / "m.jsonl"
    proc = subprocess.Popen(_train(tmp_path, "samples", ["--epochs", "1000", "--metrics-file",
                                                         str(metrics)] + flags),
                            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reap_on_teardown(proc, str(metrics))
    wait_for(lambda: _steps_reported(metrics) >= 2, "step 2", proc)
    return proc


def test_a_stop_signal_without_a_checkpoint_ends_the_job_saying_nothing_was_saved(tmp_path):
    """USR1 (Slurm's --signal) to rank 1 with no --checkpoint: it was swallowed and the job
    trained on; now every rank stops at the next step boundary, rank 0 says in one line that
    nothing was saved, and the job exits with 1 (nothing to requeue from)."""
    proc = _start_and_wait_for_a_step(tmp_path, [])
    pids = wait_for(lambda: (lambda p: p if len(p) == 2 else None)(_rank_pids(tmp_path / "samples")),
                    "both ranks' sample logs", proc)
    os.kill(pids[1], signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if "state not saved" in line]
    assert len(lines) == 1 and "no --checkpoint given" in lines[0], err[-3000:]
    assert "Traceback" not in err
    assert _summary(out)["stopped"] == "a stop signal on another rank; state NOT saved"


@pytest.mark.parametrize("saved", [True, pytest.param(False, marks=pytest.mark.skipif(not FULL, reason="make test-long"))])
def test_ctrl_c_stops_at_a_step_boundary_like_a_stop_signal(tmp_path, saved):
    """SIGINT to mpiexec (Ctrl-C), which forwards it to every rank: no KeyboardInterrupt
    traceback from each rank; with --checkpoint the state is saved (exit 75), without it one
    line says nothing was (exit 1)."""
    ckpt = tmp_path / "state.ckpt"
    proc = _start_and_wait_for_a_step(tmp_path, ["--checkpoint", str(ckpt)] if saved else [])
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert _summary(out)["stopped"].startswith("SIGINT")
    if saved:
        assert proc.returncode == EXIT_REQUEUE and ckpt.exists(), err[-3000:]
        assert "stopped on SIGINT at epoch" in err and "state saved" in err
    else:
        assert proc.returncode == 1 and not ckpt.exists(), err[-3000:]
        assert sum("no --checkpoint given, state not saved" in l for l in err.splitlines()) == 1


def test_one_stop_signal_to_the_launcher_is_one_line_for_the_job_not_per_worker(tmp_path):
    """SIGUSR1 to mpiexec, which forwards it to every rank, on 4 ranks of a user's script whose
    loader has 2 workers each: one 'received' line (rank 0's) and one 'stopped' line, none
    from the other ranks or the loader workers; the state is saved (exit 75)."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "state.ckpt"
    result = tmp_path / "result"
    result.mkdir()
    proc = subprocess.Popen([mpiexec(), "-n", "4", sys.executable,
                             str(ROOT / "tests" / "scripts" / "rollback_user.py"), "--epochs",
                             "1000", "--num-workers", "2", "--result-dir", str(result),
                             "--no-progress", "--checkpoint", str(ckpt), "--metrics-file",
                             str(metrics)], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    reap_on_teardown(proc, str(metrics))
    wait_for(lambda: _steps_reported(metrics) >= 3, "step 3", proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_REQUEUE and ckpt.exists(), err[-3000:]
    said = [line for line in err.splitlines() if "SIGUSR1" in line]
    assert len(said) == 2, said
    assert "SIGUSR1 received" in said[0] and "stopped on SIGUSR1 at epoch" in said[1], said
