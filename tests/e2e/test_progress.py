"""Progress for schedulers under an adaptive batch: the example's cosine schedule, wrapped in
hpcadapt.ProgressLR, follows the samples seen, so it ends at the end of the run even though
gns-batch grew the batch and the run took far fewer steps than the schedule's length."""

import json
import math
import sys

import pytest

from conftest import ROOT, mpiexec, run_mpi

pytestmark = pytest.mark.slow


def test_a_cosine_keyed_on_progress_ends_with_the_run_under_gns_batch(tmp_path):
    metrics = tmp_path / "m.jsonl"
    epochs, samples, batch = 3, 2000, 16
    run_mpi(2, [str(ROOT / "examples" / "mnist1d_adamw.py"), "--epochs", str(epochs),
                "--samples", str(samples), "--workers", "0", "--batch-size", str(batch),
                "--cosine", "--policy", "gns-batch", "--gns-batch-max", "256",
                "--gns-batch-warmup", "10", "--gns-batch-interval", "5",
                "--gns-batch-cooldown", "10", "--metrics-file", str(metrics)])
    steps = [r for r in map(json.loads, metrics.read_text().splitlines())
             if r["event"] == "step"]
    length = epochs * math.ceil(samples * 0.8 / batch)  # the schedule, in steps at batch 16
    assert max(r["batch_size"] for r in steps) > batch  # gns-batch grew it
    assert len(steps) < length / 2
    rates = [r["lr"] for r in steps]
    assert all(b <= a for a, b in zip(rates, rates[1:]))  # a cosine only falls
    assert rates[-1] < 0.02 * rates[0]  # and it reached its end with the run


def _on_a_terminal(command, timeout=300):
    """What ``command`` writes to a terminal (its stderr a pty; each output line as a
    terminal shows it: the text after its last carriage return), and its stdout."""
    import os
    import pty
    import select
    import subprocess
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=slave,
                            stdin=subprocess.DEVNULL, text=True)
    os.close(slave)
    raw, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the pty's other end closed: everything was read
                    break
                if not chunk:
                    break
                raw += chunk
            elif proc.poll() is not None:
                break
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=60)
        os.close(master)
    shown = [line.rstrip("\r").split("\r")[-1]  # a pty ends lines with \r\n
             for line in raw.decode(errors="replace").split("\n")]
    return shown, out, proc.returncode


def test_the_progress_bar_on_a_terminal_never_shares_a_line_with_a_log_line():
    """Issue 43: `...batch 32 on 2 workers   [rank 0] INFO hpcadapt.job: epoch 0: ...`: the
    progress line was never ended before a log line. Under mpiexec on a terminal: a bar with
    the total, percent, rate and time left; every log line on a line of its own."""
    shown, out, code = _on_a_terminal(
        [mpiexec(), "-n", "2", sys.executable, str(ROOT / "tests" / "scripts" / "bad_input.py"),
         "--case", "ok"])
    assert code == 0, shown
    logs = [line for line in shown if "[rank 0]" in line]
    assert any("epoch 1: loss" in line for line in logs), shown
    assert all(line.startswith("[rank 0]") for line in logs), shown  # nothing glued before
    assert not [line for line in logs if "%|" in line or "sample/s" in line], shown
    assert [line for line in shown if line.startswith("100%|") and "128/128" in line
            and "epoch 1 step 8" in line], shown
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 8


def test_off_a_terminal_progress_is_a_line_with_the_share_left_and_quiet_silences_it():
    """In a Slurm output file (a pipe here) a line every --progress-every seconds (0: every
    step) and one at the end, no carriage returns; --quiet: none."""
    script = [str(ROOT / "tests" / "scripts" / "bad_input.py"), "--case", "ok"]
    lines = run_mpi(2, script + ["--progress-every", "0"]).stderr.splitlines()
    progress = [line for line in lines if line.startswith("progress: ")]
    assert len(progress) == 8 + 1, lines  # each of the 8 steps, and the end
    assert progress[0].startswith("progress: 12% (16/128 samples), ")
    assert progress[-1].startswith("progress: 100% (128/128 samples), 0:00 left, ")
    assert "epoch 1 step 8 loss " in progress[-1] and "\r" not in "".join(lines)
    assert not [line for line in run_mpi(2, script + ["--quiet"]).stderr.splitlines()
                if line.startswith("progress")]
