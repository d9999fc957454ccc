"""Which communicator carries a model's gradients and state, chosen by the parameters'
device, and kept current with the world.

- ``mpi``: CPU tensors over MPI (``MPICommunicator``).
- ``host-staged``: tensors of any device through host buffers over MPI
  (``hpcadapt.cuda.staged``): CUDA without NCCL, or ranks sharing a GPU (NCCL refuses two
  ranks on one device). On CPU tensors it is the same path with plain copies, which is how
  the CPU tests cover it.
- ``nccl``: CUDA tensors over NCCL through CuPy (``hpcadapt.cuda.nccl``), one GPU per rank.

MPI always carries the bootstrap, the decisions and the resizes; the data plane only the
gradients and the state broadcasts. It is rebuilt whenever the cluster version changes, the
old NCCL communicator aborted first (a communicator with a dead or departed member must not
block the process). For CUDA tensors the ranks agree on the plane at every rebuild: NCCL
only when every rank can use it and no two ranks share a GPU, else host-staged. A grow can
bring a joiner onto a GPU a rank already uses (NCCL refuses that: seen on a GPU, a grow from
1 to 2 ended the job), or a rank whose NCCL is missing."""

from __future__ import annotations

import hashlib
import logging
from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.comm.world import World

__all__ = ["PLANES", "resolve_plane", "agreed_cuda_plane", "gpu_key", "DataPlane"]

log = logging.getLogger("hpcadapt.dataplane")

PLANES = ("auto", "mpi", "host-staged", "nccl")


def resolve_plane(device: torch.device, requested: str = "auto") -> str:
    """The concrete plane for parameters on ``device`` (``auto``: MPI on the CPU; on CUDA,
    NCCL when CuPy with NCCL is there, else host-staged). ConfigurationError in one line for
    a plane that cannot carry tensors of that device."""
    if requested not in PLANES:
        raise ConfigurationError(f"data plane {requested!r}: choose one of {list(PLANES)}")
    if device.type == "cpu":
        if requested == "nccl":
            raise ConfigurationError("data plane 'nccl' carries CUDA tensors; the parameters "
                                     "are on the CPU (move the model to the GPU first)")
        return "host-staged" if requested == "host-staged" else "mpi"
    if device.type != "cuda":
        raise ConfigurationError(f"parameters on {device}: hpcadapt trains on cpu or cuda")
    if requested == "mpi":
        raise ConfigurationError(f"data plane 'mpi' carries CPU tensors; the parameters are "
                                 f"on {device}: use 'nccl' or 'host-staged'")
    if requested == "auto":
        from hpcadapt.cuda.device import gpu_problems

        return "host-staged" if gpu_problems() else "nccl"
    return requested


def agreed_cuda_plane(ranks: List[Tuple[int, bool]]) -> str:
    """The plane every rank uses, from each rank's (GPU key, can use NCCL): NCCL only when
    all can and no two keys are equal (NCCL allows one rank per GPU), else host-staged."""
    keys = [key for key, _ in ranks]
    if all(can for _, can in ranks) and len(set(keys)) == len(keys):
        return "nccl"
    return "host-staged"


def gpu_key(index: int) -> int:
    """This rank's physical GPU as a number: the node and the device's UUID (two ranks of
    one node that see different CUDA_VISIBLE_DEVICES still tell the same GPU apart)."""
    from hpcadapt.comm.world import node_key

    props = torch.cuda.get_device_properties(index)
    device_id = str(getattr(props, "uuid", "") or getattr(props, "pci_bus_id", "") or index)
    digest = hashlib.blake2b(f"{node_key()}|{device_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFFFFFFFFFF


class DataPlane:
    """The communicator of one device's tensors for the current world."""

    def __init__(self, world: World, device: torch.device, plane: str = "auto"):
        self.world = world
        self.device = device
        self.plane = resolve_plane(device, plane)
        # What this rank could use; ``plane`` is what the ranks agreed for this world.
        self.capable = self.plane
        self._comm: Any = None
        self._version: Optional[int] = None
        # The allreduce topology over MPI (hpcadapt.comm.topology) and the emulated nodes it
        # sees; set between steps, applied at the next cluster version.
        self.topology = "flat"
        self.ranks_per_node: Optional[int] = None
        self._topology_comm: Any = None
        self._built_for: Any = None

    def current(self) -> Any:
        """The communicator for the world's cluster version (built on first use and after
        every change)."""
        key = (self.topology, self.ranks_per_node)
        if self._comm is None or self._version != self.world.cluster_version \
                or self._built_for != key:
            self.close()
            self._comm = self._build()
            self._version = self.world.cluster_version
            self._built_for = key
        return self._comm

    def _mpi(self) -> Any:
        """The MPI communicator of the gradients: MPI's own allreduce (flat) or a topology
        of hpcadapt's, built collectively for this world."""
        from hpcadapt.comm.collectives import MPICommunicator

        if self.topology == "flat" and self.ranks_per_node is None or self.world.size == 1:
            return MPICommunicator(self.world)
        from hpcadapt.comm.topology import build_topology

        self._topology_comm = build_topology(self.topology, self.world,
                                             ranks_per_node=self.ranks_per_node)
        return self._topology_comm

    def _agree(self) -> str:
        """CUDA tensors: the plane every rank of this world uses (a bounded allgather of
        each rank's GPU key and whether it can use NCCL); rank 0 says so when it changes."""
        if self.device.type != "cuda" or self.world.size == 1:
            return self.capable
        from hpcadapt.comm.world import wait_request

        mine = np.array([gpu_key(self.device.index or 0), int(self.capable == "nccl")],
                        dtype=np.int64)
        every = np.empty((self.world.size, 2), dtype=np.int64)
        wait_request(self.world.comm.Iallgather(mine, every), self.world.watch,
                     "the data plane's agreement")
        plane = agreed_cuda_plane([(int(k), bool(c)) for k, c in every])
        if plane != self.plane and self.world.rank == 0:
            log.warning("gradients over %s from now on (%d workers%s)", plane, self.world.size,
                        ": ranks share a GPU or lack NCCL" if plane != "nccl" else "")
        return plane

    def _build(self) -> Any:
        self.plane = self._agree()
        if self.plane == "mpi":
            return self._mpi()
        if self.plane == "host-staged":
            from hpcadapt.cuda.staged import HostStagedCommunicator

            return HostStagedCommunicator(self._mpi())
        from hpcadapt.cuda.nccl import NCCLCommunicator

        return NCCLCommunicator(self.world.comm, self.device.index or 0,
                                watch=self.world.watch)

    def close(self, *, abandon: bool = False) -> None:
        """Let go of the communicator: NCCL's is aborted (never waits on a peer); a
        topology's sub-communicators are freed, or, when a peer died in them
        (``abandon``), kept referenced and never freed (freeing would wait on the dead)."""
        comm, self._comm = self._comm, None
        topo, self._topology_comm = self._topology_comm, None
        if topo is not None:
            if abandon:
                from hpcadapt.comm.world import ABANDONED

                ABANDONED.append(topo)
            else:
                topo.free()
        abort = getattr(comm, "abort", None)
        if abort is not None:
            abort()
