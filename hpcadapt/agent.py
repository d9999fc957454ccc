"""``python -m hpcadapt.agent [--] COMMAND ...``: keeps a job alive when its rank 0 dies.

Why: the user's foreground command is rank 0's launch (``mpiexec -n 1 ... --initial-workers
N``); the other workers are launches that rank 0 started. When rank 0 dies, the survivors
recover and one of them becomes the coordinator, but the launch the user (or Slurm's job
step) waits on has ended. The agent is what they wait on instead, as torchrun's agent is:

* it runs COMMAND (an argument list, never a shell) and makes itself the child subreaper
  (``PR_SET_CHILD_SUBREAPER``), so the workers' launchers, orphaned when rank 0 dies, become
  its children; it returns only when every one of them has ended;
* it hands the job a private folder (``HPCADAPT_AGENT_DIR``): the coordinator of the moment
  writes its pid there (stop signals sent to the agent go to it alone, and the launcher only
  when there is none yet) and, at the end, the job's
  exit code, which becomes the agent's own. Without that file (no coordinator got to the
  end: every worker died) the agent exits with its first launch's code, and with 75 (requeue)
  where that code says 0 although a training started: the launch was torn down from outside,
  it did not succeed.

Workers run under an agent recover from rank 0's death (``hpcadapt.elastic.recovery``); without
one, rank 0's death ends the job as it always has."""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import List, Optional, Set

from hpcadapt.base import config
from hpcadapt.base.preemption import EXIT_REQUEUE
from hpcadapt.base.agent_files import (AGENT_FILE, COORDINATOR_FILE, EXIT_FILE, STOPPING_FILE,
                                       read_int, write_file, agent_pid, record_coordinator,
                                       record_exit_code, stopping)

__all__ = ["main", "run", "record_coordinator", "record_exit_code", "agent_pid", "stopping"]

_PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _children() -> Optional[Set[int]]:
    """This process's children now (Linux's /proc lists them per thread), or None where
    /proc does not say."""
    kids: Set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
        for task in tasks:
            with open(f"/proc/self/task/{task}/children", encoding="ascii") as f:
                kids.update(int(p) for p in f.read().split())
    except OSError:
        return None
    return kids


def _exit_status(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def run(command: List[str]) -> int:
    """Run ``command`` and wait for it and everything orphaned below it; the job's code."""
    _become_subreaper()
    folder = tempfile.mkdtemp(prefix="hpcadapt-agent-")  # mode 0700
    with open(os.path.join(folder, AGENT_FILE), "x", encoding="ascii") as f:
        f.write(str(os.getpid()))
    env = {**os.environ, config.AGENT_DIR_VARIABLE: folder}
    first_code: Optional[int] = None
    pending: List[int] = []   # signals that came before the first launch started

    def forward(signum, _frame) -> None:
        # A stop asked of the agent: the job ends, it does not recover (job.py reads this).
        write_file(STOPPING_FILE, str(signum), folder)
        if first is None:
            pending.append(signum)
            return
        # To the coordinator alone when there is one: it stops the whole job at the next
        # step boundary (the flag travels in the step's reduction), while the launcher keeps
        # forwarding the job's output. Open MPI's mpirun, signalled itself, tears the job
        # down within a second: its last lines and the summary were lost, exit 1.
        coordinator = read_int(folder, COORDINATOR_FILE)
        if coordinator is not None:
            try:
                os.kill(coordinator, signum)
                return
            except OSError:  # gone (a recovery moves the role): the launch then
                pass
        if first_code is None:  # not reaped yet: the pid is still the launch's
            try:
                os.kill(first.pid, signum)
            except OSError:
                pass

    first = None
    for s in FORWARDED:
        signal.signal(s, forward)  # before the launch: no window where a signal kills us
    # Children this process had before the launch are not the job's: a shell's process
    # substitution (`agent ... 2> >(grep ...) &`) forks its filter before it execs the
    # agent, and that filter ends only when the agent does.
    inherited = _children()
    first = subprocess.Popen(command, env=env)
    for signum in pending:
        forward(signum, None)
    try:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            if pid == first.pid:
                first_code = _exit_status(status)
                first.returncode = first_code
            left = _children()
            if first_code is not None and inherited is not None and left is not None \
                    and left <= inherited:
                break
        code = read_int(folder, EXIT_FILE)
        started = read_int(folder, COORDINATOR_FILE) is not None
        if code is None and not first_code and started:
            # A training that started (its coordinator said so) and ends records its code
            # (job.finish); none here, yet the launch says 0: it was torn down from outside
            # (Slurm's signal to every step of a job kills mpirun's daemons, and mpirun can
            # then end with 0). Not a success: the job script requeues (resuming from the
            # checkpoint, if one was saved).
            sys.stderr.write("hpcadapt agent: the launch ended without the training's end "
                             "(its runtime was torn down); exit 75 so that the job script "
                             "requeues\n")
            return EXIT_REQUEUE
        return code if code is not None else first_code
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m hpcadapt.agent [--] COMMAND [ARG ...]\n"
              "Runs COMMAND (e.g. mpiexec -n 1 python train.py --initial-workers 4 ...) and "
              "waits for every worker it starts, so that the job outlives the death of its "
              "rank 0; exits with the job's exit code.", file=sys.stderr if not args else
              sys.stdout)
        return 2 if not args else 0
    if shutil.which(args[0]) is None and not os.path.exists(args[0]):
        print(f"hpcadapt.agent: {args[0]!r} is not a program on PATH; give the command to "
              f"run, e.g. mpiexec -n 1 python train.py --initial-workers 4", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
