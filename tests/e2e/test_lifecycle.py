"""hpcadapt.base.lifecycle: how a process of the job ends (one process here; the multi-rank
cases run real ranks in test_user_api.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from hpcadapt.base import config, lifecycle

LAUNCHER_VARIABLES = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID",
                      "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")


def _bare_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(extra)
    return env


@pytest.mark.parametrize("variables,rank", [({}, None), ({"PMI_RANK": "3"}, 3),
                                            ({"SLURM_PROCID": "1"}, 1),
                                            ({"PMI_RANK": "x"}, None)])
def test_the_launch_rank_is_read_from_the_launcher_without_mpi(monkeypatch, variables, rank):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert config.launch_rank() == rank
    assert lifecycle.is_first_rank() == (rank in (None, 0))


def test_an_exception_before_mpi_in_a_single_process_names_rank_0_and_exit_1():
    code = ("from hpcadapt.base.lifecycle import install_abort_on_exception\n"
            "install_abort_on_exception()\n"
            "raise ValueError('before anything')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_bare_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "[rank 0] ValueError: before anything" in proc.stderr
    assert proc.stderr.splitlines()[-1] == ("[rank 0] hpcadapt: uncaught exception on rank 0; "
                                            "ending the job")
    assert "?" not in proc.stderr


def test_the_registered_failure_handler_runs_first_with_the_exception():
    code = ("import sys\n"
            "from hpcadapt.base import lifecycle\n"
            "lifecycle.install_abort_on_exception()\n"
            "lifecycle.set_failure_handler(lambda exc: print('handler saw', repr(exc)))\n"
            "raise KeyError('k')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_bare_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "handler saw KeyError('k')" in proc.stdout


def test_a_kernel_deadline_ends_a_stuck_process_and_is_gone_after_its_block():
    """runtime.KernelDeadline: a block still running at the deadline ends the process
    (SIGALRM's default action, whatever handler was set), and after a block that finished in
    time nothing fires (the previous handler is back)."""
    import subprocess
    import sys

    code = ("import signal, time\n"
            "from hpcadapt.comm.world import KernelDeadline\n"
            "signal.signal(signal.SIGALRM, lambda *a: None)\n"
            "with KernelDeadline(0.5):\n"
            "    pass\n"
            "time.sleep(1.0)\n"
            "print('survived the finished block', flush=True)\n"
            "with KernelDeadline(0.5):\n"
            "    time.sleep(30)\n"
            "print('not reached', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -14, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "survived the finished block", proc.stdout
