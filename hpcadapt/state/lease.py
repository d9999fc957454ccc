"""One owner per checkpoint: the job that first uses a ``--checkpoint`` path holds it until it
ends, so that a second job with the same path cannot resume from the first one's live state
and then delete it (two Slurm jobs given one ``CHECKPOINT`` lost 4,401 steps that way).

The lease is a small file beside the checkpoint, ``PATH.owner`` (JSON: the Slurm job id, the
host, rank 0's pid and its start time, a random token). It is created with O_EXCL, never
through a symlink, with mode 0600. A holder is alive while its process runs (same host: the
pid with the same start time) or, under Slurm, while its job is known to ``squeue`` (pending,
requeued or running). A requeued job has its old job id and takes its own lease back; a lease
whose holder is gone is taken over with a line saying so. The token travels to every rank
with the resume's verdict, so whichever rank finishes as rank 0 removes what the job owns, and
only that."""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import subprocess
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from hpcadapt.base.errors import ConfigurationError

__all__ = ["Holder", "CheckpointLease", "lease_path"]

log = logging.getLogger("hpcadapt.job")


def lease_path(checkpoint: str) -> str:
    return checkpoint + ".owner"


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _slurm_job_known(job_id: str) -> Optional[bool]:
    """Whether Slurm still has the job (pending, requeued, running); None: cannot tell."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        # squeue says "Invalid job id specified" for a job it no longer knows
        return False if "Invalid job id" in out.stderr else None
    states = out.stdout.split()
    return bool(states) and not all(s in ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT",
                                          "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY")
                                    for s in states)


@dataclass(frozen=True)
class Holder:
    """Who holds a checkpoint path."""

    job: Optional[str]    # the Slurm job id, None outside Slurm
    host: str
    pid: int
    start: Optional[str]  # the pid's start time: a reused pid is another process
    token: str

    def describe(self) -> str:
        where = f"Slurm job {self.job}, " if self.job else ""
        return f"{where}pid {self.pid} on {self.host}"


class CheckpointLease:
    """Rank 0's hold on ``--checkpoint PATH``. ``acquire`` raises ConfigurationError (one
    line) while another live job holds it; ``release`` removes the lease (and, with
    ``remove_checkpoint``, the checkpoint) only when this job's token is the one in it."""

    def __init__(self, checkpoint: str, *, job_id: Optional[str],
                 job_known: Callable[[str], Optional[bool]] = _slurm_job_known):
        self.checkpoint = checkpoint
        self.path = lease_path(checkpoint)
        self.job_id = job_id
        self.job_known = job_known
        self.token: Optional[str] = None

    def _read(self) -> Optional[Holder]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ConfigurationError(f"--checkpoint {self.checkpoint}: its lease {self.path} "
                                     f"cannot be read ({exc.strerror}); remove it") from None
        with os.fdopen(fd, encoding="utf-8") as f:
            try:
                data = json.load(f)
                return Holder(job=data.get("job"), host=str(data["host"]),
                              pid=int(data["pid"]), start=data.get("start"),
                              token=str(data["token"]))
            except (ValueError, KeyError, TypeError):
                return None   # damaged: nobody's (a write cut short)

    def alive(self, holder: Holder) -> bool:
        """Whether the holder may still use the checkpoint."""
        if holder.job:
            known = self.job_known(holder.job)
            if known is not None:
                return known
        if holder.host == socket.gethostname():
            return _start_time(holder.pid) is not None and \
                _start_time(holder.pid) == holder.start
        return True   # another host, no scheduler to ask: assume it runs

    def acquire(self) -> str:
        """Take the lease (a requeued job takes its own back); returns the token."""
        holder = self._read()
        if holder is not None:
            if self.job_id and holder.job == self.job_id:
                log.info("--checkpoint %s: this job (%s) holds it again after its requeue",
                         self.checkpoint, self.job_id)
            elif self.alive(holder):
                raise ConfigurationError(
                    f"--checkpoint {self.checkpoint} is in use by another job "
                    f"({holder.describe()}): two jobs on one checkpoint resume from and "
                    f"delete each other's state; give this job another --checkpoint (or "
                    f"CHECKPOINT), or remove {self.path} if that job is gone")
            else:
                # the usual resume of a run that stopped (or died) on this path
                log.info("--checkpoint %s: its last holder (%s) has ended; this job holds it "
                         "now", self.checkpoint, holder.describe())
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        me = Holder(job=self.job_id, host=socket.gethostname(), pid=os.getpid(),
                    start=_start_time(os.getpid()), token=secrets.token_hex(8))
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                         0o600)
        except FileExistsError:
            raise ConfigurationError(
                f"--checkpoint {self.checkpoint} was just taken by another job starting at "
                f"the same moment ({self.path}); give this job another --checkpoint") from None
        except OSError as exc:
            raise ConfigurationError(f"--checkpoint {self.checkpoint}: cannot write its lease "
                                     f"{self.path} ({exc.strerror})") from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(me), f)
        self.token = me.token
        return me.token

    def release(self, token: Optional[str], *, remove_checkpoint: bool) -> bool:
        """At the end of a finished training: remove what this job owns. False (nothing
        removed, a line said why) when another live job holds the path now. Ours: our token
        (``token``, from the resume's verdict), our Slurm job, or a holder that has ended (a
        rank 0 that died and whose role moved to this process)."""
        holder = self._read()
        ours = holder is None or holder.token == token or (
            bool(holder.job) and holder.job == self.job_id) or not self.alive(holder)
        if not ours:
            if holder is not None:
                log.warning("--checkpoint %s is held by another job now (%s): left as it is",
                            self.checkpoint, holder.describe())
                return False
        if remove_checkpoint and os.path.exists(self.checkpoint):
            os.unlink(self.checkpoint)
            log.info("training finished; removed the preemption checkpoint %s",
                     self.checkpoint)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        return True
