"""Broadcast of large host buffers between processes of one node through a memory file.

Why: a join or a recovery moves the whole training state (200 MB for a 25.7M-parameter
model with momentum) between processes of different launches. MPICH carries that over its
network module, and without UCX's cross-memory-attach transport (switched off: a peer's
death in the middle of a transfer aborts the survivors, see ``runtime``) it copies it in
seconds. Here the root writes the bytes once into an anonymous memory file
(``memfd_create``) and every receiver reads them from ``/proc/<root pid>/fd/<fd>``: two
memory copies, no network module, and nothing left behind when any process dies (the file
is gone with its last descriptor). Only tiny messages cross MPI: the file's address, and one
allreduce that says whether every receiver read it.

Receivers on another node, or a kernel that does not let them open the file, make the whole
broadcast fall back to MPI on every rank alike (the allreduce decides, so no rank goes one
way and another the other). Same user only: the file's descriptor is reachable through
``/proc`` by the root's own user (ptrace read access), by nobody else."""

from __future__ import annotations

import logging
import os
from typing import List, Optional, Sequence

import numpy as np
from hpcadapt.comm.mpi import MPI

from hpcadapt.base import config
from hpcadapt.comm.world import PeerWatch, node_key, wait_request

__all__ = ["broadcast_buffers", "available"]

log = logging.getLogger(__name__)

# Below this many bytes MPI's own broadcast is as fast: not worth two extra rounds.
MIN_BYTES = 1 << 20
_HEADER = 6  # node key, pid, fd, total bytes, the file's device and inode
_CHUNK = 1 << 30  # read/write at most 1 GiB per call (the kernel caps one call near 2 GiB)


def available() -> bool:
    """Whether this system can make memory files (Linux 3.17+, Python 3.8+) and the
    configuration allows the node-local path (``HPCADAPT_STATE_TRANSPORT``)."""
    return hasattr(os, "memfd_create") and config.state_transport() == "auto"


def broadcast_buffers(comm: MPI.Intracomm, buffers: Sequence[np.ndarray], root: int,
                      watch: Optional[PeerWatch]) -> bool:
    """Make ``buffers`` (contiguous host arrays, the same sizes on every rank) hold root's
    bytes on every rank of ``comm`` through a memory file. Collective: every rank takes the
    same two small collectives whatever happens locally. True when it worked everywhere;
    False on every rank when it did not (the root could not or may not make the file, a
    receiver on another node, unable to open or read it, or configured otherwise): the
    caller then broadcasts over MPI. PeerFailure when a peer dies or stays silent past
    ``watch``'s deadline."""
    total = sum(b.nbytes for b in buffers)
    if comm.Get_size() < 2 or total < MIN_BYTES:
        return False
    is_root = comm.Get_rank() == root
    fd = -1
    header = np.full(_HEADER, -1, dtype=np.int64)
    try:
        if is_root and available():
            try:
                fd = _write_memfd(buffers, total)
                st = os.fstat(fd)
                header[:] = (node_key(), os.getpid(), fd, total, st.st_dev, st.st_ino)
            except OSError as exc:
                log.warning("state broadcast over MPI: no memory file (%s)", exc)
        wait_request(comm.Ibcast(header, root=root), watch, "a node-local state broadcast")
        ok = np.zeros(1, dtype=np.int64)
        if is_root:
            ok[0] = 1 if fd >= 0 else 0
        elif header[2] >= 0 and available():
            try:
                ok[0] = _read_from(header, buffers, total)
            except OSError as exc:
                log.warning("state broadcast over MPI: the memory file could not be read "
                            "(%s)", exc)
        wait_request(comm.Iallreduce(MPI.IN_PLACE, ok, op=MPI.MIN), watch,
                     "a node-local state broadcast's confirmation")
        return bool(ok[0])
    finally:
        if fd >= 0:
            os.close(fd)


def _write_memfd(buffers: Sequence[np.ndarray], total: int) -> int:
    fd = os.memfd_create("hpcadapt-state", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, total)
        offset = 0
        for buf in buffers:
            view = memoryview(np.ascontiguousarray(buf)).cast("B")
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:done + _CHUNK], offset + done)
            offset += len(view)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_from(header: np.ndarray, buffers: List[np.ndarray], total: int) -> int:
    """1 when this receiver read the root's file into ``buffers``, else 0 (with the reason
    logged at debug level: falling back is normal across nodes)."""
    key, pid, fd, size, dev, ino = (int(x) for x in header)
    if key != node_key():
        log.debug("state broadcast over MPI: the root is on another node")
        return 0
    if size != total:
        log.debug("state broadcast over MPI: the root sends %d bytes, %d expected", size, total)
        return 0
    try:
        # /proc's fd entry is a link by design: following it is how the file is reached.
        own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        log.debug("state broadcast over MPI: the root's memory file cannot be opened (%s)", exc)
        return 0
    try:
        st = os.fstat(own)
        if (st.st_dev, st.st_ino) != (dev, ino) or st.st_size != total:
            # another file than the root's (its pid reused, another node's numbers)
            log.debug("state broadcast over MPI: the file opened is not the root's")
            return 0
        offset = 0
        for buf in buffers:
            view = memoryview(buf).cast("B")
            done = 0
            while done < len(view):
                n = os.preadv(own, [view[done:done + _CHUNK]], offset + done)
                if n <= 0:
                    return 0
                done += n
            offset += len(view)
    finally:
        os.close(own)
    return 1
