"""Host collectives over MPI on numpy arrays and CPU torch tensors, blocking and asynchronous.

``allreduce`` and ``broadcast`` work in place and return their input; ``allgather``
returns a new array (or tensor) with the ranks' inputs stacked along a new leading
axis. Every ``*_async`` call returns a Handle: ``test()`` polls (and drives MPI's
progress), ``wait()`` blocks and returns the result."""

from __future__ import annotations

import enum
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np
import torch
from hpcadapt.comm import world as _runtime
from hpcadapt.comm.mpi import MPI

from hpcadapt.base import config
from hpcadapt.comm.buffers import Array, as_buffer, layout_signature
from hpcadapt.base.errors import CommunicationError, on_every_rank
from hpcadapt.comm.world import World, wait_request, world as current_world

__all__ = [
    "ReduceOp", "Handle", "Communicator", "MPICommunicator", "communicator",
    "allreduce", "allreduce_async", "broadcast", "broadcast_async",
    "allgather", "allgather_async", "barrier", "barrier_async",
]


class ReduceOp(enum.Enum):
    """Reductions; AVERAGE is a SUM divided by the world size on every rank."""

    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"


# keyed by the enum's value: hashing a str is cheaper than hashing an Enum member
MPI_OPS = {"sum": MPI.SUM, "average": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}


class Handle:
    """An operation in flight. ``wait()`` returns its result; ``test()`` says if it is done."""

    def __init__(self, request: Optional[MPI.Request], finish: Callable[[], Any],
                 watch: Optional[_runtime.PeerWatch] = None, what: str = "a collective"):
        self._request = request
        self._finish = finish
        self._watch = watch
        self._what = what
        self._result: Any = None
        self._done = False
        self._failure: Optional[BaseException] = None

    def test(self) -> bool:
        """Whether it is done. Never raises: a failure seen here (ULFM: the request ended
        in error, inside a gradient hook, say) is kept for ``wait`` to raise, where the
        caller handles it, and the operation stays not done."""
        if self._done:
            return True
        if self._failure is not None:
            return False
        try:
            finished = self._request is None or self._request.Test()
        except _runtime.FAILURES as exc:
            self._failure = _runtime.as_failure(exc, self._what)
            return False
        if finished:
            self._complete()
        return self._done

    def wait(self) -> Any:
        """The result; a wait on peers is bounded (``runtime.PeerWatch``): PeerFailure when
        a peer is dead or silent past the deadline, instead of waiting forever."""
        if self._failure is not None:
            raise self._failure
        if not self._done:
            request = self._request
            if request is not None and not _runtime.wait_request_done(request, self._what):
                if self._watch is not None:
                    self._watch.wait(request, self._what)
                else:
                    request.Wait()
            self._complete()
        return self._result

    def _complete(self) -> None:
        self._request = None
        self._result = self._finish()
        self._done = True


class Communicator(Protocol):
    """What the data plane needs from a backend (MPI on the host, NCCL on GPUs)."""

    rank: int
    size: int

    def allreduce_async(self, x: Array, op: ReduceOp = ReduceOp.SUM) -> Handle: ...
    def broadcast_async(self, x: Array, root: int = 0) -> Handle: ...
    def allgather_async(self, x: Array) -> Handle: ...
    def barrier_async(self) -> Handle: ...


class MPICommunicator:
    """Collectives on the communicator of a World (it follows the world across resizes)."""

    def __init__(self, world: World):
        self._world = world
        self._check = config.check_collectives()

    @property
    def comm(self) -> MPI.Intracomm:
        return self._world.comm

    @property
    def rank(self) -> int:
        return self._world.rank

    @property
    def size(self) -> int:
        return self._world.size

    # -- asynchronous ---------------------------------------------------------------
    def allreduce_async(self, x: Array, op: ReduceOp = ReduceOp.SUM) -> Handle:
        op = as_reduce_op(op)
        buf, write_back = as_buffer(x, reduce=True)
        self._check_layout("allreduce", buf)
        size = self.size
        request = self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI_OPS[op._value_])

        def finish() -> Array:
            if op is ReduceOp.AVERAGE:
                divide_in_place(buf, size)
            write_back()
            return x

        return Handle(request, finish, getattr(self._world, "watch", None), "an allreduce")

    def broadcast_async(self, x: Array, root: int = 0) -> Handle:
        self._check_root(root)
        buf, write_back = as_buffer(x)
        self._check_layout("broadcast", buf)
        request = self.comm.Ibcast(buf, root=root)

        def finish() -> Array:
            write_back()
            return x

        return Handle(request, finish, getattr(self._world, "watch", None), "a broadcast")

    def allgather_async(self, x: Array) -> Handle:
        buf, _ = as_buffer(x)
        self._check_layout("allgather", buf)
        out = np.empty((self.size,) + buf.shape, dtype=buf.dtype)
        request = self.comm.Iallgather(buf, out)

        def finish() -> Array:
            return torch.from_numpy(out) if isinstance(x, torch.Tensor) else out

        return Handle(request, finish, getattr(self._world, "watch", None), "an allgather")

    def barrier_async(self) -> Handle:
        return Handle(self.comm.Ibarrier(), lambda: None, getattr(self._world, "watch", None), "a barrier")

    # -- blocking: a nonblocking call and a bounded wait (a dead peer raises PeerFailure
    # instead of hanging); a request that is done at once costs about a microsecond ------
    def _wait(self, request: MPI.Request, what: str) -> None:
        wait_request(request, getattr(self._world, "watch", None), what)

    def allreduce(self, x: Array, op: ReduceOp = ReduceOp.SUM) -> Array:
        op = as_reduce_op(op)
        buf, write_back = as_buffer(x, reduce=True)
        if self._check:
            self._check_layout("allreduce", buf)
        self._wait(self._world.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI_OPS[op._value_]),
                   "an allreduce")
        if op is ReduceOp.AVERAGE:
            divide_in_place(buf, self.size)
        write_back()
        return x

    def broadcast(self, x: Array, root: int = 0) -> Array:
        self._check_root(root)
        buf, write_back = as_buffer(x)
        self._check_layout("broadcast", buf)
        self._wait(self.comm.Ibcast(buf, root=root), "a broadcast")
        write_back()
        return x

    def allgather(self, x: Array) -> Array:
        return self.allgather_async(x).wait()

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier(), "a barrier")

    # -- checks -------------------------------------------------------------------
    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise CommunicationError(f"root {root} is outside the world of size {self.size}")

    def _check_layout(self, what: str, buf: np.ndarray) -> None:
        if self._check:
            check_same_layout(self.comm, [(buf.shape, buf.dtype)], what=what)


def check_same_layout(comm: MPI.Intracomm, items: Sequence, *, what: str) -> None:
    """Raise CommunicationError on every rank if the (shape, dtype) lists differ.

    One allreduce of two int64s: max(sig) == min(sig) iff all ranks agree."""
    sig = layout_signature(items)
    pair = np.array([sig, -sig], dtype=np.int64)
    wait_request(comm.Iallreduce(MPI.IN_PLACE, pair, op=MPI.MAX), None, f"{what}'s check")
    if pair[0] != -pair[1]:
        mine = ", ".join(f"{tuple(s)}:{d}" for s, d in items)
        raise on_every_rank(CommunicationError(
            f"{what}: ranks passed tensors of different shapes or dtypes "
            f"(rank {comm.Get_rank()} has [{mine}]); every rank must pass the same layout"))


def divide_in_place(buf: np.ndarray, size: int) -> None:
    """Turn a SUM into an AVERAGE in place (floor division for integer dtypes)."""
    if size > 1:
        if np.issubdtype(buf.dtype, np.integer):
            np.floor_divide(buf, size, out=buf)
        else:
            np.multiply(buf, 1.0 / size, out=buf)


def as_reduce_op(op: Any) -> ReduceOp:
    if op.__class__ is ReduceOp:
        return op
    try:
        return ReduceOp(str(op).lower())
    except ValueError:
        raise CommunicationError(
            f"unknown reduction {op!r}; choose one of {[o.value for o in ReduceOp]}") from None


_communicators: dict = {}
_default: list = [None]  # the communicator of the initialised world, for the module functions


def communicator(world: Optional[World] = None) -> MPICommunicator:
    """The MPICommunicator of ``world`` (default: the one from ``hpcadapt.init()``)."""
    if world is None:
        cached = _default[0]
        if cached is not None and cached._world is _runtime._world:
            return cached
        _default[0] = communicator(current_world())
        return _default[0]
    w = world
    comm = _communicators.get(id(w))
    if comm is None or comm._world is not w:
        comm = _communicators[id(w)] = MPICommunicator(w)
    return comm


# Module-level conveniences on the initialised world, in the manner of Horovod.
def allreduce(x: Array, op: ReduceOp = ReduceOp.SUM) -> Array:
    return communicator().allreduce(x, op)


def allreduce_async(x: Array, op: ReduceOp = ReduceOp.SUM) -> Handle:
    return communicator().allreduce_async(x, op)


def broadcast(x: Array, root: int = 0) -> Array:
    return communicator().broadcast(x, root)


def broadcast_async(x: Array, root: int = 0) -> Handle:
    return communicator().broadcast_async(x, root)


def allgather(x: Array) -> Array:
    return communicator().allgather(x)


def allgather_async(x: Array) -> Handle:
    return communicator().allgather_async(x)


def barrier() -> None:
    communicator().barrier()


def barrier_async() -> Handle:
    return communicator().barrier_async()
