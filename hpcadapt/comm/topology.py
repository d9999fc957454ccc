"""Allreduce topologies: MPI's own (flat), through one leader per node (hierarchical), and a
ring and a binomial tree of our own over point-to-point messages.

Why: which way of reducing is fastest depends on the message size and on how the ranks sit
on nodes (traffic inside a node is cheap, across nodes dear), so the topology is a system
parameter a policy may change at a step boundary (``TopologySwitch``).

A topology object belongs to one communicator (one cluster version): it duplicates it,
builds its node-local and leaders' communicators once, and releases them in ``free()``;
after a resize build a new one. It is a ``collectives.Communicator``: only the allreduce
differs between topologies; broadcast, allgather and barrier are MPI's own on the
duplicate.

Results: every topology returns the same bits on every rank (the ring and the tree reduce
each element once, on one rank, and send the result around; the hierarchical allreduce
broadcasts the leaders' result). Against flat, sums of integers (and of integer-valued
floats below 2**24 for float32, 2**53 for float64) are bit-identical, as are MIN and MAX;
other float sums are added in another order, so they agree within rounding (a relative
difference of about ``size * eps`` of the dtype).

Waits on peers are bounded (``runtime.wait_request`` with the world's ``PeerWatch``).
Building is collective; MPI has no nonblocking split, so the node and leaders' splits
follow a bounded exchange that shows every rank arrived, and only a peer dying between the
two could hang them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from hpcadapt.comm.mpi import MPI

from hpcadapt.base import config
from hpcadapt.comm.buffers import Array, as_buffer
# the same reduction table and AVERAGE division as MPICommunicator, so that flat and the
# other topologies agree on integer averages (floor division) and on refused reductions
from hpcadapt.comm.collectives import (MPI_OPS, Handle, ReduceOp, as_reduce_op, check_same_layout,
                                       divide_in_place)
from hpcadapt.base.errors import CommunicationError, ConfigurationError
from hpcadapt.base.topology_names import Topology, parse_ranks_per_node, parse_topology
from hpcadapt.comm.world import PeerWatch, node_key, wait_request

__all__ = ["Topology", "NodeLayout", "parse_topology", "parse_ranks_per_node",
           "emulated_layout", "layout_from_keys", "build_topology", "TopologyCommunicator",
           "StepHandle", "TopologySwitch"]

log = logging.getLogger(__name__)

# MPI promises tags up to 32767; each allreduce of the ring and the tree takes the next
# one, so that operations in flight together never take each other's messages.
_TAG_SPAN = 32767
_UFUNCS = {"sum": np.add, "average": np.add, "min": np.minimum, "max": np.maximum}

Steps = Iterator[List[MPI.Request]]


@dataclass(frozen=True)
class NodeLayout:
    """Which ranks share a node: ``nodes[i]`` holds node i's ranks in rank order; nodes are
    numbered by their lowest rank, which is the node's leader."""

    nodes: Tuple[Tuple[int, ...], ...]
    emulated: bool

    @property
    def size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def leaders(self) -> Tuple[int, ...]:
        return tuple(n[0] for n in self.nodes)

    def node_of(self, rank: int) -> int:
        for i, ranks in enumerate(self.nodes):
            if rank in ranks:
                return i
        raise ConfigurationError(f"rank {rank} is on no node of {self.nodes}")

    def describe(self) -> str:
        kind = "emulated" if self.emulated else "real"
        return f"{len(self.nodes)} {kind} node(s) of {[len(n) for n in self.nodes]} ranks"


def emulated_layout(size: int, ranks_per_node: int) -> NodeLayout:
    """Pretend nodes of ``ranks_per_node`` consecutive ranks (the last one may be smaller)."""
    k = parse_ranks_per_node(ranks_per_node)
    if k is None or size < 1:
        raise ConfigurationError(f"cannot lay {size} rank(s) out in nodes of {ranks_per_node!r}")
    return NodeLayout(tuple(tuple(range(s, min(s + k, size))) for s in range(0, size, k)),
                      emulated=True)


def layout_from_keys(keys: Sequence[int]) -> NodeLayout:
    """Real nodes from every rank's node key (``runtime.node_key``), in rank order."""
    nodes: Dict[int, List[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(int(key), []).append(rank)
    return NodeLayout(tuple(tuple(r) for r in nodes.values()), emulated=False)


# -- handles over algorithms written as generators ----------------------------------------
class StepHandle(Handle):
    """A Handle over an algorithm written as a generator: each step does its local work
    (adding what arrived) and yields the requests the next step waits for.

    Progress happens only inside ``test()`` and ``wait()`` (there is no thread), so the
    handles of one topology are driven together, oldest first, through ``order`` (the
    handles in flight, in the order they were started, the same on every rank):
    ``test()`` first advances every older handle as far as it can without blocking, then
    this one; ``wait()`` first waits for every older handle, then does this one's
    remaining steps synchronously, each wait bounded by the PeerWatch. So a rank blocked
    on one allreduce never holds up another that a peer is waiting for, however the ranks
    order their waits. With ``ordered`` (algorithms whose later steps are collectives,
    which MPI wants started in the same order on every rank) a handle goes past its first
    step only when every older one has finished."""

    def __init__(self, steps: Steps, finish: Callable[[], Any],
                 watch: Optional[PeerWatch], what: str, order: List["StepHandle"],
                 ordered: bool = False):
        super().__init__(None, finish, watch, what)
        self._steps = steps
        self._pending: List[MPI.Request] = []
        self._exhausted = False
        self._order = order
        self._ordered = ordered
        self._next()  # the first messages leave now
        if not self._exhausted:
            order.append(self)

    def _next(self) -> None:
        try:
            self._pending = next(self._steps)
        except StopIteration:
            self._pending, self._exhausted = [], True

    def _poll(self, older_done: bool) -> bool:
        """Take every step whose requests are done, without blocking; True when finished."""
        if self._done:
            return True
        while not self._exhausted:
            if self._pending and not MPI.Request.Testall(self._pending):
                return False
            self._pending = []
            if self._ordered and not older_done:
                return False
            self._next()
        self._complete()
        return True

    def test(self) -> bool:
        if self._done:
            return True
        older_done = True
        for older in list(self._order):
            if older is self:
                break
            older_done = older._poll(older_done) and older_done
        return self._poll(older_done)

    def wait(self) -> Any:
        if not self._done:
            for older in list(self._order):
                if older is self:
                    break
                older.wait()
            while not self._exhausted:
                for request in self._pending:
                    wait_request(request, self._watch, self._what)
                self._pending = []
                self._next()
            self._complete()
        return self._result

    def _complete(self) -> None:
        try:
            self._order.remove(self)
        except ValueError:
            pass  # finished at once: never in flight
        super()._complete()


def _one(request: MPI.Request) -> Steps:
    """One MPI request as a one-step algorithm."""
    yield [request]


# -- the communicators ------------------------------------------------------------------
class TopologyCommunicator:
    """A Communicator whose allreduce follows one topology; built by ``build_topology``.

    Its allreduces in flight are driven together (``StepHandle``); those of two separate
    topology objects are not, so wait for those in the same order on every rank, or use
    one ``TopologySwitch``."""

    topology: Topology
    ordered = False  # True where a step after the first is a collective (see StepHandle)

    def __init__(self, comm: MPI.Intracomm, watch: Optional[PeerWatch], layout: NodeLayout,
                 *, requested: Optional[Topology] = None, fallback_reason: Optional[str] = None):
        self._comm: Optional[MPI.Intracomm] = comm
        self._watch = watch
        self.layout = layout
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        #: what was asked for, and why another topology runs instead (None when it does not)
        self.requested = requested or self.topology
        self.fallback_reason = fallback_reason
        self._check = config.check_collectives()
        self._seq = 0
        # this topology's handles in flight, oldest first (see StepHandle); a
        # TopologySwitch shares one list among its topologies
        self._order: List[StepHandle] = []

    @property
    def comm(self) -> MPI.Intracomm:
        if self._comm is None:
            raise ConfigurationError(f"this {self.topology.value} topology has been freed; "
                                     "build a new one")
        return self._comm

    def allreduce_async(self, x: Array, op: ReduceOp = ReduceOp.SUM) -> Handle:
        """Reduce ``x`` in place on every rank; the handle's ``wait()`` returns ``x``."""
        op = as_reduce_op(op)
        buf, write_back = as_buffer(x, reduce=True)
        comm = self.comm
        if self._check:
            check_same_layout(comm, [(buf.shape, buf.dtype)], what="allreduce")
        size = self.size
        tag = self._seq % _TAG_SPAN
        self._seq += 1
        steps = self._steps(buf, op, tag) if buf.size and size > 1 else iter(())

        def finish() -> Array:
            if op is ReduceOp.AVERAGE:
                divide_in_place(buf, size)
            write_back()
            return x

        return StepHandle(steps, finish, self._watch,
                          f"a {self.topology.value} allreduce", self._order,
                          self.ordered)

    def allreduce(self, x: Array, op: ReduceOp = ReduceOp.SUM) -> Array:
        return self.allreduce_async(x, op).wait()

    def _steps(self, buf: np.ndarray, op: ReduceOp, tag: int) -> Steps:
        raise NotImplementedError

    # -- the rest of the Communicator protocol: MPI's own on the duplicate ---------------
    def broadcast_async(self, x: Array, root: int = 0) -> Handle:
        if not 0 <= root < self.size:
            raise CommunicationError(f"root {root} is outside the world of size {self.size}")
        buf, write_back = as_buffer(x)

        def finish() -> Array:
            write_back()
            return x

        return Handle(self.comm.Ibcast(buf, root=root), finish, self._watch, "a broadcast")

    def allgather_async(self, x: Array) -> Handle:
        import torch

        buf, _ = as_buffer(x)
        out = np.empty((self.size,) + buf.shape, dtype=buf.dtype)

        def finish() -> Array:
            return torch.from_numpy(out) if isinstance(x, torch.Tensor) else out

        return Handle(self.comm.Iallgather(buf, out), finish, self._watch, "an allgather")

    def barrier_async(self) -> Handle:
        return Handle(self.comm.Ibarrier(), lambda: None, self._watch, "a barrier")

    def free(self) -> None:
        """Release this topology's communicators (after every handle is waited); idempotent."""
        for name in self._owned():
            comm = getattr(self, name)
            if comm is not None and comm != MPI.COMM_NULL:
                comm.Free()
            setattr(self, name, None)

    def _owned(self) -> Tuple[str, ...]:
        return ("_comm",)

    def __repr__(self) -> str:
        extra = f", instead of {self.requested.value}" if self.fallback_reason else ""
        return (f"{type(self).__name__}(rank={self.rank}, size={self.size}, "
                f"{self.layout.describe()}{extra})")


class FlatAllreduce(TopologyCommunicator):
    """MPI's own Iallreduce: the library picks its algorithm by size."""

    topology = Topology.FLAT

    def _steps(self, buf: np.ndarray, op: ReduceOp, tag: int) -> Steps:
        return _one(self.comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI_OPS[op.value]))


class HierarchicalAllreduce(TopologyCommunicator):
    """Reduce to the node's leader, allreduce among leaders, broadcast inside the node.

    Each stage has a communicator of its own (the reduce and the broadcast inside the
    node, the allreduce among leaders), and later stages start in the order the
    allreduces were issued (``StepHandle``'s ``order``): so every communicator sees its
    collectives in the same order on every rank, however each rank polls its handles."""

    topology = Topology.HIERARCHICAL
    ordered = True

    def __init__(self, comm: MPI.Intracomm, watch: Optional[PeerWatch], layout: NodeLayout,
                 node_reduce: MPI.Intracomm, node_bcast: MPI.Intracomm,
                 leaders_comm: Optional[MPI.Intracomm]):
        super().__init__(comm, watch, layout)
        self._node_reduce: Optional[MPI.Intracomm] = node_reduce
        self._node_bcast: Optional[MPI.Intracomm] = node_bcast
        self._leaders_comm = leaders_comm  # None on ranks that lead no node

    def _owned(self) -> Tuple[str, ...]:
        return ("_node_reduce", "_node_bcast", "_leaders_comm", "_comm")

    def _steps(self, buf: np.ndarray, op: ReduceOp, tag: int) -> Steps:
        reduce, bcast = self._node_reduce, self._node_bcast
        if reduce is None or bcast is None:
            raise ConfigurationError("this hierarchical topology has been freed; build a new one")
        mpi_op = MPI_OPS[op.value]
        leader = reduce.Get_rank() == 0
        alone = reduce.Get_size() == 1
        if not alone:
            send = MPI.IN_PLACE if leader else buf
            yield [reduce.Ireduce(send, buf if leader else None, op=mpi_op, root=0)]
        if leader and self._leaders_comm.Get_size() > 1:
            yield [self._leaders_comm.Iallreduce(MPI.IN_PLACE, buf, op=mpi_op)]
        if not alone:
            yield [bcast.Ibcast(buf, root=0)]


def _chunks(n: int, parts: int) -> List[Tuple[int, int]]:
    """``parts`` contiguous [start, stop) ranges covering n elements, sizes differing by at
    most one (the first ``n % parts`` one longer); empty ranges when n < parts."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


class RingAllreduce(TopologyCommunicator):
    """Reduce-scatter then allgather around the ring, over Isend/Irecv.

    The array is cut in ``size`` chunks; in step s of the reduce-scatter rank r sends chunk
    (r - s) to its right neighbour and adds chunk (r - s - 1) from its left one, so after
    size-1 steps it holds chunk (r + 1) reduced; the allgather passes the reduced chunks on
    around the ring. Empty chunks (arrays shorter than the ring) send nothing."""

    topology = Topology.RING

    def _steps(self, buf: np.ndarray, op: ReduceOp, tag: int) -> Steps:
        comm, p, r = self.comm, self.size, self.rank
        flat = buf.reshape(-1)
        bounds = _chunks(flat.size, p)
        right, left = (r + 1) % p, (r - 1) % p
        ufunc = _UFUNCS[op.value]
        tmp = np.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype)  # the longest chunk
        for s in range(p - 1):
            (ra, rb), (sa, sb) = bounds[(r - s - 1) % p], bounds[(r - s) % p]
            requests = []
            if rb > ra:
                requests.append(comm.Irecv(tmp[:rb - ra], source=left, tag=tag))
            if sb > sa:
                requests.append(comm.Isend(flat[sa:sb], dest=right, tag=tag))
            yield requests
            if rb > ra:
                ufunc(flat[ra:rb], tmp[:rb - ra], out=flat[ra:rb])
        for s in range(p - 1):
            (ra, rb), (sa, sb) = bounds[(r - s) % p], bounds[(r - s + 1) % p]
            requests = []
            if rb > ra:
                requests.append(comm.Irecv(flat[ra:rb], source=left, tag=tag))
            if sb > sa:
                requests.append(comm.Isend(flat[sa:sb], dest=right, tag=tag))
            yield requests


class TreeAllreduce(TopologyCommunicator):
    """Binomial reduce to rank 0, then binomial broadcast back down the same tree.

    Rank r's parent is r without its lowest set bit; rank r adds its children's partial
    results in the order r+1, r+2, r+4, ... (a fixed order: the same bits every run)."""

    topology = Topology.TREE

    def _steps(self, buf: np.ndarray, op: ReduceOp, tag: int) -> Steps:
        comm, p, r = self.comm, self.size, self.rank
        flat = buf.reshape(-1)
        ufunc = _UFUNCS[op.value]
        tmp: Optional[np.ndarray] = None
        mask = 1
        while mask < p:
            if r & mask:
                yield [comm.Isend(flat, dest=r - mask, tag=tag)]
                break
            if r + mask < p:
                if tmp is None:
                    tmp = np.empty_like(flat)
                yield [comm.Irecv(tmp, source=r + mask, tag=tag)]
                ufunc(flat, tmp, out=flat)
            mask <<= 1
        # down the tree: from the parent, then to the children, largest subtree first
        if r:
            yield [comm.Irecv(flat, source=r - (r & -r), tag=tag)]
            mask = (r & -r) >> 1
        else:
            mask = 1 << (max(p - 1, 1).bit_length() - 1)
        children = []
        while mask:
            if r + mask < p:
                children.append(comm.Isend(flat, dest=r + mask, tag=tag))
            mask >>= 1
        if children:
            yield children


_CLASSES = {Topology.FLAT: FlatAllreduce, Topology.RING: RingAllreduce,
            Topology.TREE: TreeAllreduce}


# -- building -------------------------------------------------------------------------------
def _comm_and_watch(world_comm: Any, watch: Optional[PeerWatch]
                    ) -> Tuple[MPI.Intracomm, Optional[PeerWatch], Optional[List[int]]]:
    """(communicator, watch, node keys if known) from a World or an MPI communicator."""
    if isinstance(world_comm, MPI.Intracomm):
        return world_comm, watch, None
    comm = getattr(world_comm, "comm", None)
    if not isinstance(comm, MPI.Intracomm):
        raise ConfigurationError(f"build_topology takes a hpcadapt World or an MPI "
                                 f"intracommunicator, got {type(world_comm).__name__}")
    peers = getattr(world_comm, "peers", None)
    keys = [key for _, key, _ in peers] if peers else None
    return comm, watch if watch is not None else getattr(world_comm, "watch", None), keys


def build_topology(name: Union[str, Topology], world_comm: Any, *,
                   ranks_per_node: Union[None, int, str] = None,
                   watch: Optional[PeerWatch] = None) -> TopologyCommunicator:
    """A communicator whose allreduce follows topology ``name`` on ``world_comm`` (a World,
    whose PeerWatch bounds the waits, or an MPI intracommunicator with an optional
    ``watch``). Collective: every rank calls it with the same arguments.

    ``ranks_per_node`` (see ``parse_ranks_per_node``) groups consecutive ranks into pretend
    nodes; by default the real nodes count. A hierarchical topology with one node, or one
    rank per node, is flat, with the reason logged once (rank 0) and kept in
    ``fallback_reason``. Raises ConfigurationError for an unknown name or flag value (before
    any communication), PeerFailure when a peer dies or stays silent while it is built."""
    topology = parse_topology(name)
    k = parse_ranks_per_node(ranks_per_node)
    comm, watch, keys = _comm_and_watch(world_comm, watch)
    dup, request = comm.Idup()
    wait_request(request, watch, f"building the {topology.value} topology")
    try:
        if k is not None:
            layout = emulated_layout(dup.Get_size(), k)
        else:
            if keys is None:
                mine = np.array([node_key()], dtype=np.int64)
                table = np.empty(dup.Get_size(), dtype=np.int64)
                wait_request(dup.Iallgather(mine, table), watch, "the node keys' exchange")
                keys = table.tolist()
            layout = layout_from_keys(keys)
        if topology is not Topology.HIERARCHICAL:
            return _CLASSES[topology](dup, watch, layout)
        reason = None
        if len(layout.nodes) == 1:
            reason = f"all {layout.size} ranks are on one node"
        elif len(layout.nodes) == layout.size:
            reason = f"every node holds one rank ({len(layout.nodes)} nodes)"
        if reason is not None:
            if dup.Get_rank() == 0:
                log.info("hierarchical allreduce falls back to flat: %s (%s)", reason,
                         layout.describe())
            return FlatAllreduce(dup, watch, layout, requested=Topology.HIERARCHICAL,
                                 fallback_reason=reason)
        rank = dup.Get_rank()
        node = layout.node_of(rank)
        node_reduce = dup.Split(node, rank)
        node_bcast, request = node_reduce.Idup()
        wait_request(request, watch, "building the hierarchical topology")
        leader = layout.leaders[node] == rank
        leaders_comm = dup.Split(0 if leader else MPI.UNDEFINED, rank)
        return HierarchicalAllreduce(dup, watch, layout, node_reduce, node_bcast,
                                     leaders_comm if leader else None)
    except BaseException:
        dup.Free()
        raise


class TopologySwitch:
    """The topology in use, changed at a step boundary by ``switch``.

    Each topology is built on its first use and kept until ``free()`` (so switching back
    costs nothing); building is collective, so every rank switches at the same boundary
    (the step boundary's plan says which). Handles already in flight finish on the
    topology they started on; all the switch's handles are driven together, oldest first
    (``StepHandle``), so ranks may wait for them in any order."""

    def __init__(self, world_comm: Any, *, ranks_per_node: Union[None, int, str] = None,
                 watch: Optional[PeerWatch] = None,
                 initial: Union[str, Topology] = Topology.FLAT):
        self._world_comm = world_comm
        self._ranks_per_node = parse_ranks_per_node(ranks_per_node)
        self._watch = watch
        self._built: Dict[Topology, TopologyCommunicator] = {}
        self._order: List[StepHandle] = []
        self._current = self._get(parse_topology(initial))

    def _get(self, topology: Topology) -> TopologyCommunicator:
        built = self._built.get(topology)
        if built is None:
            built = self._built[topology] = build_topology(
                topology, self._world_comm, ranks_per_node=self._ranks_per_node,
                watch=self._watch)
            built._order = self._order  # one line of handles across a switch
        return built

    @property
    def current(self) -> TopologyCommunicator:
        return self._current

    @property
    def rank(self) -> int:
        return self._current.rank

    @property
    def size(self) -> int:
        return self._current.size

    def switch(self, name: Union[str, Topology]) -> TopologyCommunicator:
        """Use topology ``name`` from now on (collective the first time); returns it."""
        self._current = self._get(parse_topology(name))
        return self._current

    def allreduce_async(self, x: Array, op: ReduceOp = ReduceOp.SUM) -> Handle:
        return self._current.allreduce_async(x, op)

    def allreduce(self, x: Array, op: ReduceOp = ReduceOp.SUM) -> Array:
        return self._current.allreduce(x, op)

    def broadcast_async(self, x: Array, root: int = 0) -> Handle:
        return self._current.broadcast_async(x, root)

    def allgather_async(self, x: Array) -> Handle:
        return self._current.allgather_async(x)

    def barrier_async(self) -> Handle:
        return self._current.barrier_async()

    def free(self) -> None:
        for built in self._built.values():
            built.free()
        self._built.clear()
