"""One owner per checkpoint path (hpcadapt.state.lease): a second live job is refused in one
line naming the holder, a requeued job takes its own lease back, a lease whose holder has
ended is taken over, and a finished job removes only what it owns."""

import json
import os
import socket
import subprocess
import sys

import pytest

from hpcadapt import ConfigurationError
from hpcadapt.state.lease import CheckpointLease, lease_path


def _known(states):
    """A stand-in for squeue: job id -> whether Slurm still has it."""
    return lambda job: states.get(job)


def test_a_second_live_slurm_job_is_refused_in_one_line_naming_the_holder(tmp_path):
    ckpt = str(tmp_path / "shared.ckpt")
    first = CheckpointLease(ckpt, job_id="41", job_known=_known({"41": True}))
    token = first.acquire()
    second = CheckpointLease(ckpt, job_id="42", job_known=_known({"41": True}))
    with pytest.raises(ConfigurationError) as err:
        second.acquire()
    line = str(err.value)
    assert "\n" not in line and "is in use by another job (Slurm job 41, pid" in line
    assert "give this job another --checkpoint (or CHECKPOINT)" in line
    assert json.loads(open(lease_path(ckpt)).read())["token"] == token   # untouched
    assert oct(os.stat(lease_path(ckpt)).st_mode & 0o777) == "0o600"


def test_a_requeued_job_takes_its_lease_back_and_an_ended_holder_is_taken_over(tmp_path):
    ckpt = str(tmp_path / "c.ckpt")
    CheckpointLease(ckpt, job_id="41", job_known=_known({})).acquire()
    again = CheckpointLease(ckpt, job_id="41", job_known=_known({"41": True}))
    token = again.acquire()                     # the same job after its requeue
    later = CheckpointLease(ckpt, job_id="50", job_known=_known({"41": False}))
    assert later.acquire() != token             # job 41 has ended: taken over


def test_outside_slurm_a_live_process_holds_and_an_ended_one_does_not(tmp_path):
    ckpt = str(tmp_path / "c.ckpt")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(lease_path(ckpt), "w") as f:   # a lease of that process's
            start = open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[19]
            json.dump({"job": None, "host": socket.gethostname(), "pid": child.pid,
                       "start": start, "token": "t"}, f)
        with pytest.raises(ConfigurationError, match=f"pid {child.pid} on"):
            CheckpointLease(ckpt, job_id=None).acquire()
    finally:
        child.kill()
        child.wait()
    CheckpointLease(ckpt, job_id=None).acquire()   # it ended: this one holds it now


def test_a_finished_job_removes_only_what_it_owns(tmp_path):
    ckpt = tmp_path / "c.ckpt"
    ckpt.write_bytes(b"state")
    mine = CheckpointLease(str(ckpt), job_id="7", job_known=_known({"7": True, "8": True}))
    token = mine.acquire()
    assert mine.release(token, remove_checkpoint=True)
    assert not ckpt.exists() and not os.path.exists(lease_path(str(ckpt)))
    # taken over by job 8 while job 7 ran (its lease was removed by hand): 7 leaves it alone
    ckpt.write_bytes(b"state of job 8")
    CheckpointLease(str(ckpt), job_id="8", job_known=_known({"8": True})).acquire()
    assert not mine.release(token, remove_checkpoint=True)
    assert ckpt.read_bytes() == b"state of job 8" and os.path.exists(lease_path(str(ckpt)))


def test_a_symlink_at_the_lease_is_never_followed(tmp_path):
    ckpt = str(tmp_path / "c.ckpt")
    target = tmp_path / "elsewhere"
    target.write_text("{}")
    os.symlink(target, lease_path(ckpt))
    with pytest.raises(ConfigurationError, match="cannot be read"):
        CheckpointLease(ckpt, job_id=None).acquire()
    assert target.read_text() == "{}"
