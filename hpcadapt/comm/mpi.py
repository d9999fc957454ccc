"""The one place hpcadapt imports mpi4py, whose import starts MPI: the environment MPI must
see is set just before, so no module depends on being imported after another for it.

* UCX's cross-memory-attach transport aborts the whole process ("process_vm_readv ... No such
  process") when a peer dies in the middle of a transfer, so a dead worker would take every
  survivor with it; the shared-memory copy transports do the same work (ddp benchmark
  unchanged).
* Open MPI's hierarchical collectives (coll/han) hang on a communicator that joins processes
  of separate spawns (a grow of two or more workers: each is spawned alone), so they are left
  out; hpcadapt's own topologies do that work.

Values the user set are kept. A process that imported mpi4py before hpcadapt started MPI
without them.

A joiner the job spawned (Open MPI) watches, while its MPI starts, the rank 0 that spawned
it: when a parent dies during the spawn, the joiner's MPI_Init never returns (seen: the
training ended, the launcher waited on that joiner for good); once rank 0 is gone the
joiner ends with one line instead."""

from __future__ import annotations

import os
import sys

from hpcadapt.base.config import SPAWNED_BY_VARIABLE

ENVIRONMENT_DEFAULTS = {"UCX_TLS": "^cma", "OMPI_MCA_coll": "^han"}


def _set_environment_defaults() -> None:
    for name, value in ENVIRONMENT_DEFAULTS.items():
        os.environ.setdefault(name, value)


# The watcher: a process of its own, since MPI_Init holds the interpreter's lock (a thread
# would never run). It ends when its stdin closes (MPI started, or the joiner died), and
# kills the joiner when the spawning rank 0's pid is gone first. It imports only
# hpcadapt.base (no torch, no MPI: about 0.1 s).
_WATCHER = """
import os, select, signal, sys
from hpcadapt.base.lifecycle import pid_alive
joiner, spawner = int(sys.argv[1]), int(sys.argv[2])
while not select.select([sys.stdin], [], [], 0.2)[0]:
    if not pid_alive(spawner):
        sys.stderr.write("hpcadapt: the job that spawned this worker ended while its MPI "
                         "started; this worker exits\\n")
        os.kill(joiner, signal.SIGKILL)
        break
"""


def _watch_the_spawner():
    """A spawned joiner (``HPCADAPT_SPAWNED_BY=NODE:PID``, on rank 0's node): the watcher
    process while its MPI starts, or None."""
    import subprocess

    from hpcadapt.base.lifecycle import node_key

    try:
        node, pid = (int(x) for x in os.environ.get(SPAWNED_BY_VARIABLE, "").split(":"))
    except ValueError:
        return None
    if node != node_key():
        return None  # another node's pid says nothing here
    # hpcadapt where this process found it, first on the watcher's path
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    try:
        return subprocess.Popen([sys.executable, "-c", _WATCHER, str(os.getpid()), str(pid)],
                                stdin=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=path))
    except OSError:
        return None


def _stop_watching(watcher) -> None:
    if watcher is not None:
        watcher.stdin.close()
        try:
            watcher.wait(timeout=5.0)
        except Exception:  # noqa: BLE001 - a watcher that lingers is killed, never waited on
            watcher.kill()


_set_environment_defaults()
_watcher = _watch_the_spawner()
from mpi4py import MPI  # noqa: E402  (starts MPI)
_stop_watching(_watcher)
os.environ.pop(SPAWNED_BY_VARIABLE, None)  # read once: never by a process this one starts

__all__ = ["MPI", "ENVIRONMENT_DEFAULTS"]
