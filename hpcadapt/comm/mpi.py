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
without them."""

from __future__ import annotations

import os

ENVIRONMENT_DEFAULTS = {"UCX_TLS": "^cma", "OMPI_MCA_coll": "^han"}


def _set_environment_defaults() -> None:
    for name, value in ENVIRONMENT_DEFAULTS.items():
        os.environ.setdefault(name, value)


_set_environment_defaults()
from mpi4py import MPI  # noqa: E402  (starts MPI)

__all__ = ["MPI", "ENVIRONMENT_DEFAULTS"]
