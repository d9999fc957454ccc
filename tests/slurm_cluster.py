"""The Slurm test cluster as pytest fixtures, for every test module that trains inside a Slurm
job (tests/cluster, tests/faults): ``cluster`` starts the test cluster (slurm/testcluster) when
none is up and stops it afterwards by its recorded PIDs; ``cancel_leftovers`` cancels the jobs
a test started if they still run at its end; ``job_env`` is a job's environment."""

import os
import subprocess
import sys

import pytest

from hpcadapt.slurm.commands import SlurmCommandError, run_slurm

@pytest.fixture(scope="module")
def cluster():
    from hpcadapt.slurm.testcluster.cluster import TestCluster, ensure_packages

    c = TestCluster()
    started = False
    if c.running():
        import warnings

        warnings.warn(f"the Slurm tests use the test cluster already running in {c.root} "
                      f"(started by another run; it is left up)")
    else:
        if os.geteuid() != 0:
            try:
                ensure_packages()
            except Exception as exc:  # not root and Slurm missing: nothing to test against
                pytest.skip(f"no Slurm test cluster possible here: {exc}")
        c.up()
        started = True
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(c.slurm_conf)
    try:
        yield c
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        if started:
            c.down()


def job_env(**extra) -> dict:
    from hpcadapt.slurm.testcluster.watch import job_environment

    return job_environment(sys.executable, **extra)


@pytest.fixture
def cancel_leftovers(cluster):
    """Job ids a test appends here are cancelled at its end if they still run (a test that
    fails must not leave a training of 100000 epochs behind), with their node requests."""
    jobs: list = []
    yield jobs
    if not jobs:
        return
    try:
        active = run_slurm(["squeue", "-h", "-o", "%i|%j"])  # pending and running jobs
    except SlurmCommandError:
        return
    ids = []
    for line in active.splitlines():
        job_id, _, name = line.partition("|")
        if any(job_id == j or name.endswith(f"-{j}") for j in jobs):  # hpcadapt-join-JOB, ...
            ids.append(job_id)
    if ids:
        subprocess.run(["scancel"] + ids, capture_output=True, timeout=60)


def run_as_written(command: str, folder, links) -> str:
    """A documented ``sbatch`` command, in bash in ``folder``, which holds the repository's
    ``links`` (slurm/, the environment, ...) as a user's checkout would; returns the job id
    sbatch printed."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for name in links:
        if not (folder / name).exists():
            (folder / name).symlink_to(root / name)
    proc = subprocess.run(["bash", "--noprofile", "--norc", "-c", command], cwd=folder,
                          env=job_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    said = re.search(r"Submitted batch job (\d+)", proc.stdout)
    assert said, proc.stdout
    return said.group(1)
