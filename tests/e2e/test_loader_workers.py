"""The user's DataLoader workers are forks of a rank, not ranks: they never run the rank's
exception hook (which would abort the job's communicator from a forked child, and hang) or
its stop-signal handler, they die with their rank however it dies, and the temporary folder
of a killed worker is swept by the job's other processes at the end."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from procs import ChildOutput, alive

FORKED_HOOK = r"""
import os, sys
from hpcadapt.base import lifecycle
lifecycle.install_abort_on_exception()
pid = os.fork()
if pid == 0:
    try:
        raise RuntimeError("boom in a forked child")
    except RuntimeError:
        sys.excepthook(*sys.exc_info())
    os._exit(3)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
"""


def test_a_forked_child_does_not_run_the_ranks_exception_hook():
    proc = subprocess.run([sys.executable, "-c", FORKED_HOOK], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "child exit 3" in proc.stdout, (proc.stdout, proc.stderr)
    assert "RuntimeError: boom in a forked child" in proc.stderr
    assert "aborting" not in proc.stderr and "[rank" not in proc.stderr, proc.stderr


FORKED_SIGNAL = r"""
import logging, os, signal, sys
logging.basicConfig(level=logging.INFO, format="%(process)d %(message)s")
from hpcadapt.base.preemption import StopSignals
stops = StopSignals.named(["USR1"], saves=True).install()
pid = os.fork()
if pid == 0:
    os.kill(os.getpid(), signal.SIGUSR1)
    settle = sum(range(100))  # the handler runs between bytecodes
    os._exit(0 if stops.received is None else 5)
_, status = os.waitpid(pid, 0)
code = os.waitstatus_to_exitcode(status)
os.kill(os.getpid(), signal.SIGUSR1)
settle = sum(range(100))
print("child exit", code, "rank received", stops.received, flush=True)
"""


def test_a_stop_signal_is_the_ranks_alone_not_its_forked_workers():
    """One SIGUSR1 to the rank and one to its fork: one 'received' line, the rank's."""
    proc = subprocess.run([sys.executable, "-c", FORKED_SIGNAL], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "child exit 0 rank received SIGUSR1" in proc.stdout, (proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if "SIGUSR1 received" in line]
    assert len(lines) == 1, proc.stderr


BUSY_RANK = r"""
import os, sys, time
import torch
from torch.utils.data import DataLoader, Dataset
from hpcadapt.data.loader import WorkerStart

class Stuck(Dataset):
    # A worker inside __getitem__ never reaches torch's own parent check between batches.
    def __len__(self):
        return 100
    def __getitem__(self, i):
        # One write per line: two workers' prints could interleave into one unreadable line.
        os.write(1, f"worker {os.getpid()}\n".encode())
        time.sleep(3600)

loader = DataLoader(Stuck(), batch_size=2, num_workers=2,
                    worker_init_fn=WorkerStart(os.getpid(), None))
next(iter(loader))
"""


def _wait(predicate, what, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    pytest.fail(f"no {what} within {timeout} s")


def test_loader_workers_die_with_a_rank_killed_by_sigkill():
    proc = subprocess.Popen([sys.executable, "-c", BUSY_RANK], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    workers = set()
    output, deadline = ChildOutput(proc.stdout), time.monotonic() + 120
    try:
        while len(workers) < 2:
            line = output.readline(deadline)
            assert line is not None, f"no two loader workers within 120 s (saw {workers})"
            assert line, "the rank ended before its workers started"
            if line.startswith("worker "):
                workers.add(int(line.split()[1]))
        proc.kill()
        proc.wait(timeout=60)
        _wait(lambda: not any(alive(w) for w in workers), "end of the orphaned workers")
        from hpcadapt.data.loader import sweep_dead_worker_dirs

        assert sweep_dead_worker_dirs() == 2  # their folders, which nobody else removes
    finally:
        proc.kill()
        proc.wait(timeout=60)
        for w in workers:
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.stdout.close()


def test_a_killed_workers_folder_is_swept_and_a_live_ones_kept(tmp_path):
    from hpcadapt.data.loader import sweep_dead_worker_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"hpcadapt-worker-{dead.pid}-abc"
    live = tmp_path / f"hpcadapt-worker-{os.getpid()}-def"
    other = tmp_path / "pymp-unrelated"
    for d in (gone, live, other):
        d.mkdir()
        (d / "listener").write_text("x")
    link = tmp_path / f"hpcadapt-worker-{dead.pid}-link"
    link.symlink_to(other)
    assert sweep_dead_worker_dirs(str(tmp_path)) == 1
    assert not gone.exists() and live.exists() and other.exists() and link.is_symlink()
    assert (other / "listener").exists()  # never followed through the link
    for d in (live, other):
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    link.unlink()
