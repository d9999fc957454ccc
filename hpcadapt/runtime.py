"""The world: which processes train together now, and the cluster version that names it.

A resize replaces the communicator and bumps the version; everything that caches
per-world resources (fusion buckets, NCCL communicators) compares versions to rebuild."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from mpi4py import MPI

from . import config
from .errors import ConfigurationError

__all__ = ["WorldInfo", "World", "init", "world", "is_initialized", "shutdown"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorldInfo:
    """A snapshot of one process's place in the world."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_name: str
    cluster_version: int


class World:
    """The communicator of the current workers and what is derived from it.

    The world owns its communicator (a duplicate, so user traffic on COMM_WORLD never
    matches ours) and frees it on ``replace`` or ``free``."""

    def __init__(self, comm: MPI.Intracomm, *, cluster_version: int = 0, own: bool = True):
        self._comm: Optional[MPI.Intracomm] = comm
        self._own = own
        self._version = cluster_version
        self._local: Optional[MPI.Intracomm] = None
        self._derive()

    def _derive(self) -> None:
        comm = self.comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        if self._local is not None:
            self._local.Free()
        # Processes that share memory form one node; their rank order decides local ranks.
        self._local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank: int = self._local.Get_rank()
        self.local_size: int = self._local.Get_size()
        self.node_name: str = config.slurm_node_name() or MPI.Get_processor_name()

    @property
    def comm(self) -> MPI.Intracomm:
        if self._comm is None:
            raise ConfigurationError("this world has been shut down; call hpcadapt.init() again")
        return self._comm

    @property
    def cluster_version(self) -> int:
        return self._version

    def info(self) -> WorldInfo:
        return WorldInfo(self.rank, self.size, self.local_rank, self.local_size,
                         self.node_name, self._version)

    def replace(self, comm: MPI.Intracomm, *, version: Optional[int] = None) -> None:
        """Adopt a new communicator after a resize; the version goes up exactly once (or
        becomes ``version``: a joining worker takes the running job's)."""
        old = self._comm
        self._comm = comm
        self._version = self._version + 1 if version is None else version
        self._derive()
        if old is not None and self._own and old != MPI.COMM_NULL:
            old.Free()
        self._own = True
        log.debug("world replaced: size %d, cluster version %d", self.size, self._version)

    def free(self) -> None:
        if self._local is not None:
            self._local.Free()
            self._local = None
        if self._comm is not None and self._own:
            self._comm.Free()
        self._comm = None

    def __repr__(self) -> str:
        return (f"World(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
                f"node={self.node_name!r}, version={self._version})")


_world: Optional[World] = None


def init(comm: Optional[MPI.Intracomm] = None) -> World:
    """Join the world: from ``mpiexec``/``srun`` ranks, or as a single rank with no launcher.

    Idempotent: a second call returns the same world. A process started by
    ``MPI.Comm.Spawn`` (a joining worker) should use ``hpcadapt.elastic`` instead."""
    global _world
    if _world is not None:
        return _world
    base = comm if comm is not None else MPI.COMM_WORLD
    _world = World(base.Dup())
    return _world


def is_initialized() -> bool:
    return _world is not None


def world() -> World:
    """The world set up by ``init()``; raises ConfigurationError before it."""
    if _world is None:
        raise ConfigurationError("hpcadapt is not initialised: call hpcadapt.init() first")
    return _world


def shutdown() -> None:
    """Free hpcadapt's communicators, then wait (idly) for the processes this one was
    launched with. MPI itself is finalised by mpi4py at exit."""
    global _world
    if _world is not None:
        if _world._comm is not None:
            _world.free()
        _world = None
    wait_for_launch_siblings()


def wait_for_launch_siblings(poll_s: float = 0.05) -> None:
    """Processes started together by one mpiexec/srun share COMM_WORLD and cannot finalise
    before each other; one that left the training early waits here, sleeping, instead of
    spinning inside MPI_Finalize. Processes that joined alone pass at once."""
    import time

    if MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
        return
    request = MPI.COMM_WORLD.Ibarrier()
    while not request.Test():
        time.sleep(poll_s)
