"""One job per checkpoint (issue 42): a second run given the --checkpoint of a run still
training is refused in one line naming the holder, and trains nothing; the first run finishes
and removes its checkpoint and its lease."""

import os
import socket
import subprocess
import sys

from conftest import ROOT, complete_rows, mpiexec, reap_on_teardown, run_mpi, wait_for

TRAIN = ["-m", "hpcadapt.train", "--dataset", "digits", "--model", "mlp", "--no-progress",
         "--threads", "1"]


def test_a_second_run_on_a_live_runs_checkpoint_is_refused_and_the_first_finishes(tmp_path):
    ckpt, stop, metrics = tmp_path / "shared.ckpt", tmp_path / "STOP", tmp_path / "m.jsonl"
    first = subprocess.Popen([mpiexec(), "-n", "2", sys.executable] + TRAIN + [
        "--epochs", "100000", "--checkpoint", str(ckpt), "--checkpoint-every", "20",
        "--stop-file", str(stop), "--metrics-file", str(metrics)], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    reap_on_teardown(first, str(metrics))
    wait_for(lambda: ckpt.exists() and any(r["event"] == "step" and r["step"] > 25
                                           for r in complete_rows(metrics)),
             "the first run's checkpoint and step 25", first)
    second = run_mpi(2, TRAIN + ["--epochs", "1", "--checkpoint", str(ckpt),
                                 "--metrics-file", str(tmp_path / "second.jsonl")],
                     check=False, timeout=300)
    assert second.returncode == 2, second.stderr[-3000:]
    lines = {l.split("hpcadapt: ", 1)[-1] for l in second.stderr.splitlines()
             if "is in use by another job" in l}
    assert len(lines) == 1, second.stderr[-3000:]   # the same line, from each rank
    line = lines.pop()
    assert f"--checkpoint {ckpt} is in use by another job (pid " in line
    assert f" on {socket.gethostname()})" in line and "give this job another --checkpoint" in line
    assert not any(r["event"] == "step" for r in complete_rows(tmp_path / "second.jsonl"))
    stop.touch()
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert not ckpt.exists() and not os.path.exists(f"{ckpt}.owner")
    assert "resumed from" not in err
