"""Data-parallel PyTorch: gradients averaged by bucketed asynchronous allreduce from backward hooks.

Each parameter's ``.grad`` is a view into a flat bucket, so gradients accumulate where the
collective reads them and nothing is packed or unpacked. When the last gradient of a bucket
is ready (a post-accumulate-grad hook), the bucket is scaled by this rank's weight and its
allreduce starts while backward goes on; ``step()`` waits for the rest and steps the wrapped
optimizer. Right after the last bucket's launch (on a monitored step: in ``synchronize``,
once this rank's squared gradient norm has reached the host with the averaged one's, in one
transfer after backward) the step's control values (that norm, the caller's metrics: loss,
timings, stop votes) start in a small float64 allreduce of their own on the host, under
whatever strategy or plane: the monitors and the stop votes never depend on the gradient exchange (KungFu and
the strategies that keep gradients local need that), at the cost of one tiny collective.

The model's buffers (BatchNorm's running statistics and ``num_batches_tracked``, any
registered buffer; ``buffers=``) are rank 0's on every rank after every step, as DDP's
``broadcast_buffers`` keeps them: one flat byte buffer, packed after backward and broadcast
in one nonblocking collective started with the control reduction and finished with it, so
it adds no blocking point to the step (``BufferBroadcast``). The same under model averaging
(the control reduction is the one collective every strategy waits for each step): the
running statistics are read only in evaluation, of rank 0's replica, whose statistics the
broadcast never changes, and DDP broadcasts them whatever its communication hook.

The buckets live on the parameters' device and travel over that device's data plane
(``hpcadapt.parallel.dataplane``: MPI for CPU tensors, NCCL or host-staged for CUDA tensors); a
step's gradient norms reach the host only on monitored steps.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch

from hpcadapt.base import config
from hpcadapt.comm import world as _runtime
from hpcadapt.comm.collectives import Handle, MPICommunicator, ReduceOp, check_same_layout
from hpcadapt.parallel.dataplane import DataPlane
from hpcadapt.base.errors import CommunicationError, ConfigurationError
from hpcadapt.comm.fusion import Bucket, plan_buckets
from hpcadapt.parallel.broadcasts import (BufferBroadcast, broadcast_optimizer_state,
                                          broadcast_parameters)
from hpcadapt.comm.world import World, wait_request, world as current_world
from hpcadapt.base.strategies import SSGD, Strategy

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
           "GradientStats", "BufferBroadcast"]

log = logging.getLogger(__name__)


class StepSettings(Protocol):
    """Where the optimizer reads each step's strategy and allreduce topology (the job's
    ``TrainingState`` owns them)."""

    strategy: Strategy
    topology: str


class _OwnSettings:
    """The optimizer's own settings, for standalone use (``set_strategy``): S-SGD, flat."""

    def __init__(self, strategy: Optional[Strategy] = None, topology: str = "flat"):
        self.strategy = strategy if strategy is not None else SSGD()
        self.topology = topology


class GradientStats:
    """What one synchronised step tells about its gradients (identical on every rank).

    ``local_sqnorm_mean``: sum_i w_i |g_i|^2 over ranks (w_i = this rank's share of the
    global batch); ``global_sqnorm``: |g_avg|^2 of the averaged gradient; ``extras``: the
    caller's staged values summed over ranks (the control reduction, in float64)."""

    __slots__ = ("local_sqnorm_mean", "global_sqnorm", "extras")

    def __init__(self, local_sqnorm_mean: float, global_sqnorm: float, extras: np.ndarray):
        self.local_sqnorm_mean = local_sqnorm_mean
        self.global_sqnorm = global_sqnorm
        self.extras = extras


class _Slot:
    """One parameter's place in its bucket: the bucket and the view of its gradient there
    (``p.grad`` while nothing replaced it). Made once per parameter; its hook is bound to it,
    so that the hook looks nothing up."""

    __slots__ = ("state", "view")

    def __init__(self):
        self.state: Optional["_BucketState"] = None
        self.view: Optional[torch.Tensor] = None


class _BucketState:
    __slots__ = ("bucket", "params", "pending", "handle", "launched", "sqnorm")

    def __init__(self, bucket: Bucket, params: List[torch.nn.Parameter]):
        self.bucket = bucket
        self.params = params
        self.pending = len(params)
        self.handle: Optional[Handle] = None
        self.launched = False
        self.sqnorm: Optional[torch.Tensor] = None


class DistributedOptimizer:
    """Wrap a model's optimizer for data-parallel training over the current world.

    ``named_parameters``: the model's parameters (order decides bucketing), all on one
    device. ``data_plane``: how the gradients travel, "auto" (MPI for CPU parameters; NCCL
    for CUDA ones when CuPy with NCCL is installed, else host-staged), "mpi",
    "host-staged" or "nccl" (see ``hpcadapt.parallel.dataplane``). At construction, parameters and
    optimizer state are broadcast from rank 0 and the parameter layout is checked across
    ranks (CommunicationError if it differs). ``buffers``: the model's buffers
    (``model.buffers()``), made rank 0's on every rank at construction and after every
    step (DDP's ``broadcast_buffers``); none by default."""

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[Tuple[str, torch.nn.Parameter]], *,
                 world: Optional[World] = None, bucket_bytes: Optional[int] = None,
                 extra_slots: int = 0, track_grad_norms: bool = False,
                 broadcast_initial_state: bool = True, data_plane: str = "auto",
                 buffers: Iterable[torch.Tensor] = ()):
        self.optimizer = optimizer
        self._world = world if world is not None else current_world()
        self._bucket_bytes = bucket_bytes if bucket_bytes is not None else config.bucket_bytes()
        if self._bucket_bytes <= 0:
            raise ConfigurationError(f"bucket_bytes must be positive, got {self._bucket_bytes}")
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ConfigurationError("the model has no parameters that require gradients")
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ConfigurationError("parameter names must be unique")
        self._named = named
        self._plane = DataPlane(self._world, _one_device(named), data_plane)
        if self._plane.plane == "nccl":
            from hpcadapt.cuda.nccl import nccl_dtype

            for name, p in named:
                try:
                    nccl_dtype(p.dtype)
                except CommunicationError as exc:
                    raise ConfigurationError(f"parameter {name!r}: {exc}") from None
        self._buffers = BufferBroadcast(list(buffers), self._plane.device)
        self._extra_slots = int(extra_slots)
        self.track_grad_norms = track_grad_norms
        self._weight = None  # this rank's share of the global batch; None = 1/size
        self._staged_extras = torch.zeros(max(self._extra_slots, 0) + 1, dtype=torch.float64)
        self._skip_sync = False
        self._synchronized = False  # synchronize() ran since the last backward
        # A failure met inside a gradient hook (ULFM: starting or testing a collective on a
        # revoked communicator), raised by ``synchronize`` where the job handles it: an
        # exception out of a hook would surface from autograd's backward instead.
        self._hook_failure: Optional[BaseException] = None
        # where the strategy and the allreduce topology are read at each step: the job's
        # training state (``follow``), or the optimizer's own (``set_strategy``, standalone)
        self._settings: StepSettings = _OwnSettings()
        self._sync_grads = True       # this step averages gradients (the strategy, monitors)
        self._model_alpha: Optional[float] = None  # this step's pull towards the average
        # this step's models' average in flight: (buckets, their tensors, handles)
        self._model_avg: Optional[Tuple[List[Bucket], List[List[torch.Tensor]],
                                        List[Handle]]] = None
        self._control: Optional[MPICommunicator] = None
        self._control_inflight: Optional[Tuple[Handle, np.ndarray]] = None
        self._pairs = None            # pair averaging's window (hpcadapt.parallel.pairavg)
        self._pair_failure: Optional[Exception] = None  # raised in synchronize
        self._version = -1
        self._buckets: List[_BucketState] = []
        # each parameter's slot: a hook whose .grad is already the slot's view (every step
        # of the job after the first) has nothing to copy and builds no view
        self._slots: Dict[torch.nn.Parameter, _Slot] = {p: _Slot() for _, p in named}
        # a gradient may live outside the buckets (set to None, or written by a backward
        # whose hooks did not take it: no_sync, a strategy that keeps gradients local)
        self._strays_possible = True
        self._launched = 0
        self._hooks = []
        self.last_stats: Optional[GradientStats] = None
        comm = self._world.comm
        check_same_layout(comm, [(t.shape, t.dtype) for t in
                                 [p for _, p in named] + self._buffers.buffers],
                          what="DistributedOptimizer")
        if broadcast_initial_state:
            broadcast_parameters([p for _, p in named] + self._buffers.buffers, root=0,
                                 world=self._world)
            broadcast_optimizer_state(self.optimizer, root=0, world=self._world)
        self._build()
        for _, p in named:
            self._hooks.append(p.register_post_accumulate_grad_hook(
                functools.partial(self._on_grad_ready, self._slots[p])))

    # -- optimizer interface ---------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients. With ``set_to_none`` (the default, as in torch) autograd
        writes fresh gradients and the hooks copy them into the buckets; otherwise (what
        the job's step does) the buckets are zeroed in place, ``.grad`` stays their views
        and backward accumulates into them directly."""
        self.ensure_current()
        if set_to_none:
            for _, p in self._named:
                p.grad = None
            self._strays_possible = True
            return
        if self._strays_possible:
            # Once after anything that may have left a gradient outside the buckets; a
            # job's steady state never comes here (its hooks took every gradient).
            slots = self._slots
            stray = [p for _, p in self._named if p.grad is not slots[p].view]
            for p in stray:
                p.grad = None  # a gradient outside the buckets (a strategy switch's) is old
            if stray:
                self._reattach_views()
            self._strays_possible = False
        for b in self._buckets:
            b.bucket.flat.zero_()

    def step(self, closure=None):
        """Average the gradients (unless ``synchronize()`` already did since the last
        backward) and step the wrapped optimizer. With a gradient scaler (mixed precision):
        ``opt.synchronize(); scaler.step(opt); scaler.update()``, so that the scaler unscales
        and checks the averaged gradients, not local ones still in flight."""
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    # -- data parallel controls ------------------------------------------------------
    def set_local_weight(self, weight: Optional[float]) -> None:
        """This rank's share of the global batch (local samples / global samples) for the
        coming step; None means an equal share. The average gradient is sum_i w_i g_i."""
        if weight is not None and not (0.0 <= weight <= 1.0):
            raise ConfigurationError(f"local weight must be in [0, 1], got {weight}")
        self._weight = weight

    def stage_extras(self, values: Sequence[float]) -> None:
        """Values summed over ranks in the coming step's control reduction
        (``last_stats.extras``)."""
        if len(values) != self._extra_slots:
            raise ConfigurationError(
                f"expected {self._extra_slots} extra values, got {len(values)}")
        self._staged_extras[1:] = torch.as_tensor(values, dtype=torch.float64)

    def set_extra_slots(self, n: int) -> None:
        """Change the number of metric slots (from the next step's control reduction)."""
        if n != self._extra_slots:
            self._extra_slots = int(n)
            self._staged_extras = torch.zeros(n + 1, dtype=torch.float64)

    def follow(self, settings: "StepSettings", ranks_per_node: Optional[int] = None) -> None:
        """Read the strategy and the allreduce topology from ``settings`` (the job's
        ``TrainingState``, their one owner) at each step from now on, instead of keeping
        copies; ``ranks_per_node``: emulated nodes (``--ranks-per-node``), fixed for the
        job. A change of either is taken at the next ``begin_step``, on every rank alike
        (the owner changes them at the same boundary everywhere)."""
        self._settings = settings
        self._set_ranks_per_node(ranks_per_node)

    def _set_ranks_per_node(self, ranks_per_node: Optional[int]) -> None:
        if ranks_per_node != self._plane.ranks_per_node:
            self._plane.ranks_per_node = ranks_per_node
            self._version = -1  # the next step takes the new communicator (collective)

    def set_topology(self, topology: str, ranks_per_node: Optional[int] = None) -> None:
        """Standalone use (no job): the allreduce topology over MPI
        (``hpcadapt.comm.topology``) from the next step on; every rank must call it at the
        same point."""
        self._settings = _OwnSettings(self._settings.strategy, topology)
        self._set_ranks_per_node(ranks_per_node)
        self._take_topology()

    def _take_topology(self) -> None:
        """The communicator follows the settings' topology: a new one is formed at the next
        use (collective) when it changed."""
        if self._settings.topology != self._plane.topology:
            self._plane.topology = self._settings.topology
            self._version = -1  # the next step takes the new communicator (collective)

    @property
    def topology(self) -> str:
        return self._plane.topology

    @property
    def data_plane(self) -> str:
        """The plane the gradients travel on: ``mpi``, ``host-staged`` or ``nccl``."""
        return self._plane.plane

    def set_strategy(self, strategy: Strategy) -> None:
        """Standalone use (no job): the synchronisation strategy from the next step on
        (``hpcadapt.base.strategies``)."""
        self._settings = _OwnSettings(strategy, self._settings.topology)

    @property
    def strategy(self) -> Strategy:
        """The synchronisation strategy this step follows (read from its owner)."""
        return self._settings.strategy

    def begin_step(self, step: int) -> None:
        """Before forward: what this step exchanges. Under model averaging the models'
        allreduce starts here (the parameters do not change until the update) and is
        finished in ``synchronize``; gradients are averaged under S-SGD and on monitored
        steps (``track_grad_norms``), else each replica keeps its own."""
        self._take_topology()
        self.ensure_current()
        self._sync_grads = self.strategy.averages_gradients or self.track_grad_norms \
            or self._world.size == 1
        alpha = self.strategy.model_alpha(step) if self._world.size > 1 else None
        self._model_alpha = alpha
        if alpha is not None:
            self._start_model_average()
        if self.strategy.pairs_models and self._world.size > 1:
            self._start_pair_fetch(step)
        elif self._pairs is not None:
            self._release_pairs(abandon=False)  # the strategy left pair-avg, on every rank

    def _start_pair_fetch(self, step: int) -> None:
        """Pair averaging: publish this replica's parameters (as the last update left them)
        and start reading one random peer's; ``synchronize`` mixes them in. The window is
        made for the world's cluster version (collective, every rank at this step); a peer
        found dead on the way is raised from ``synchronize``, where the job recovers."""
        from hpcadapt.parallel.pairavg import PairExchange, choose_peer

        params = [p.data for _, p in self._named]
        try:
            pairs = self._pairs
            if pairs is not None and pairs.cluster_version != self._world.cluster_version:
                self._release_pairs(abandon=False)
                pairs = None
            if pairs is None:
                # everyone is here before the (unbounded) collective creation
                wait_request(self._world.comm.Ibarrier(), self._world.watch,
                             "the pair window's creation")
                pairs = self._pairs = PairExchange(self._world, params)
                self._world.releases.append(self._release_pairs)
                pairs.publish(params)
                # every rank has published before anyone reads
                wait_request(self._world.comm.Ibarrier(), self._world.watch,
                             "the pair window's first publication")
            else:
                pairs.publish(params)
            pairs.start_fetch(choose_peer(step, self._world.rank, self._world.size))
        except _runtime.PeerFailure as exc:
            self._pair_failure = exc

    def _finish_pair_average(self) -> None:
        """v <- (v + v_peer) / 2, before this rank's own update."""
        if self._pair_failure is not None:
            exc, self._pair_failure = self._pair_failure, None
            raise exc
        if self._pairs is None or not self._pairs.fetching:
            return
        theirs = self._pairs.finish_fetch()
        with torch.no_grad():
            for (_, p), flat in zip(self._named, theirs):
                peer = flat.view(p.dtype).view(p.shape)
                p.add_(peer.to(p.device) if p.device.type != "cpu" else peer).mul_(0.5)

    def _release_pairs(self, abandon: bool) -> None:
        """Free the pair window (collective), or keep it unfreed when a peer died."""
        pairs, self._pairs = self._pairs, None
        if pairs is None:
            return
        if self._release_pairs in self._world.releases:
            self._world.releases.remove(self._release_pairs)
        if abandon:
            pairs.abandon()
        else:
            pairs.free()

    def average_models(self) -> None:
        """Every replica takes the plain average of all (collective; between steps)."""
        self.ensure_current()
        if self._world.size == 1:
            return
        self._model_alpha = 1.0
        self._start_model_average()
        self._finish_model_average()

    def _start_model_average(self) -> None:
        params = [p.data for _, p in self._named]
        groups = [[params[i] for i in g] for g in plan_buckets(params, self._bucket_bytes)]
        buckets = [Bucket.for_tensors(members) for members in groups]
        for bucket, members in zip(buckets, groups):
            bucket.pack(members)
        # one fused allreduce per dtype group; the handles complete in order
        handles = [self._comm.allreduce_async(b.flat, ReduceOp.SUM) for b in buckets]
        self._model_avg = (buckets, groups, handles)

    def _finish_model_average(self) -> None:
        buckets, groups, handles = self._model_avg
        alpha, n = self._model_alpha, float(self._world.size)
        for handle in handles:
            handle.wait()
        with torch.no_grad():
            for bucket, members in zip(buckets, groups):
                offset = 0
                for p in members:
                    k = p.numel()
                    mean = bucket.flat[offset:offset + k].view_as(p).div_(n)
                    if alpha >= 1.0:
                        p.copy_(mean)
                    else:
                        p.mul_(1.0 - alpha).add_(mean, alpha=alpha)
                    offset += k
        self._model_avg = None

    def _start_control(self, local_sqnorm: float = 0.0) -> None:
        """The step's control values (loss, timings, stop votes, and on monitored steps this
        rank's squared gradient norm) in a small float64 allreduce of their own, on the host
        over MPI, whatever carries the gradients (none: they stay local; NCCL; a topology):
        the monitors never depend on the gradient exchange."""
        if self._control is None:
            self._control = MPICommunicator(self._world)  # follows the world's resizes
        values = self._staged_extras.numpy().copy()
        values[0] = local_sqnorm
        self._control_inflight = (self._control.allreduce_async(values, ReduceOp.SUM), values)
        if self._world.size > 1:
            # Backward is done here (forward updated the buffers): rank 0's buffers travel
            # beside the control values and are waited for with them.
            self._buffers.start(self._comm)

    def _finish_control(self) -> np.ndarray:
        handle, values = self._control_inflight
        handle.wait()  # bounded like every wait on a peer
        self._control_inflight = None
        self._buffers.finish(self._world.rank)
        return values

    def _control_reduction(self) -> GradientStats:
        """Gradients stay local: only the control values travel."""
        self._start_control()
        out = self._finish_control()
        return GradientStats(0.0, 0.0, out[1:self._extra_slots + 1].copy())

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally without communicating."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    @property
    def world(self) -> World:
        return self._world

    # -- buckets -----------------------------------------------------------------------
    def ensure_current(self) -> None:
        if self._version == self._world.cluster_version:
            return
        if self._buckets:
            # A resize: the buckets stay (they do not depend on the world), the
            # communicator is the new world's.
            self._comm = self._plane.current()
            self._version = self._world.cluster_version
            self._reset_step()
        else:
            self._build()

    def abandon_in_flight(self) -> None:
        """A peer died in the middle of a step: the buckets' allreduces will never complete
        and MPI may still name their buffers, so those are kept (never reused, never freed)
        and fresh buckets are built on the next use."""
        from hpcadapt.comm.world import ABANDONED

        self._hook_failure = None
        ABANDONED.append(self._buckets)
        if self._model_avg is not None:
            ABANDONED.append(self._model_avg)
            self._model_avg = None
        if self._control_inflight is not None:
            ABANDONED.append(self._control_inflight)
            self._control_inflight = None
        self._buffers.abandon()
        self._release_pairs(abandon=True)
        self._pair_failure = None
        self._buckets = []
        self._version = -1
        self._plane.close(abandon=True)

    def _build(self) -> None:
        """Bucket the parameters in reverse order (the order backward produces gradients)."""
        params = [p for _, p in reversed(self._named)]
        groups = plan_buckets(params, self._bucket_bytes)
        self._buckets = []
        for group in groups:
            members = [params[i] for i in group]
            bucket = Bucket.for_tensors(members)
            offset = 0
            for p in members:
                n = p.numel()
                if p.grad is not None:
                    bucket.flat[offset:offset + n].copy_(p.grad.reshape(-1))
                offset += n
            state = _BucketState(bucket, members)
            self._buckets.append(state)
            for p in members:
                self._slots[p].state = state
        self._comm = self._plane.current()
        self._version = self._world.cluster_version
        self._reattach_views()
        self._reset_step()

    def _reattach_views(self) -> None:
        """Every parameter's ``.grad`` becomes (a new view of) its slot, what it held copied
        in."""
        for state in self._buckets:
            offset = 0
            for p in state.params:
                n = p.numel()
                view = state.bucket.flat[offset:offset + n].view_as(p)
                if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = self._slots[p].view = view
                offset += n

    def _reset_step(self) -> None:
        self._launched = 0
        for b in self._buckets:
            b.pending = len(b.params)
            b.handle = None
            b.launched = False
            b.sqnorm = None

    def _on_grad_ready(self, slot: _Slot, p: torch.nn.Parameter) -> None:
        """A parameter's gradient is accumulated (autograd calls this once per parameter
        and backward: the only Python per parameter, kept to a few attribute reads; the
        checks and the work are per bucket)."""
        self._synchronized = False
        if self._skip_sync or not self._sync_grads:
            self._strays_possible = True  # this backward's gradients stay where they are
            return
        if p.grad is not slot.view:
            self._take_gradient(p)  # the first step, or a new .grad
        state = slot.state
        state.pending -= 1
        if state.pending:
            if state.pending < 0:
                raise CommunicationError(
                    "backward ran twice before step(); wrap the extra backward passes in "
                    "optimizer.no_sync() to accumulate gradients")
            return  # more to come
        if self._hook_failure is not None:
            return  # the step is given up (synchronize raises the failure)
        if self._version != self._world.cluster_version:
            raise CommunicationError(
                "the world changed during backward; resizes apply between steps only")
        try:
            self._launch(state)
            # Drive MPI's progress engine for collectives already in flight (once a bucket).
            for b in self._buckets:
                if b.handle is not None and not b.handle.test():
                    break
        except _runtime.FAILURES as exc:
            self._hook_failure = _runtime.as_failure(exc, "a gradient allreduce's start")

    def _take_gradient(self, p: torch.nn.Parameter) -> None:
        """Move ``p``'s gradient into its bucket slot and make ``p.grad`` the slot's view
        (the rank's share is applied to the whole bucket at its launch). A parameter whose
        hook did not fire this step contributes what its slot holds: zeros when it was
        unused, what earlier micro-batches (``no_sync``) accumulated there when only the
        last one did not use it (the step zeroes the slots at its start)."""
        view = self._slots[p].view
        g = p.grad
        if g is view:
            return
        if g is None:
            view.zero_()
        elif g.data_ptr() != view.data_ptr():
            view.copy_(g)
        p.grad = view

    def _launch(self, state: _BucketState) -> None:
        bucket = state.bucket
        payload = bucket.payload
        w = self._share()
        if w != 1.0:
            payload.mul_(w)  # this rank's share, once for the bucket
        if self.track_grad_norms:
            # payload holds w * g_i: divide the scale back out of the squared norm
            state.sqnorm = torch.dot(payload, payload) / (w * w) if w > 0 else payload.new_zeros(())
        self._launched += 1
        state.handle = self._comm.allreduce_async(bucket.flat, ReduceOp.SUM)
        state.launched = True
        if self._launched == len(self._buckets) and not self.track_grad_norms:
            # Last bucket of this step on this rank (backward is done): the control
            # values follow in their own reduction. On a monitored step they wait for
            # synchronize, which brings this rank's squared norm to the host there, with
            # the global one, in one transfer: nothing waits for the device inside backward.
            self._start_control(0.0)

    def _share(self) -> float:
        return self._weight if self._weight is not None else 1.0 / self._world.size

    def synchronize(self) -> GradientStats:
        """Finish the step's communication: afterwards ``.grad`` holds the averaged gradient
        (S-SGD; under model averaging this rank's own, and the parameters have been pulled
        towards the replicas' average)."""
        self.ensure_current()
        if self._hook_failure is not None:
            failure, self._hook_failure = self._hook_failure, None
            raise failure
        if not self._sync_grads:
            # the fetch ends before the control reduction: a peer cannot publish twice
            # while it is read (hpcadapt.parallel.pairavg)
            self._finish_pair_average()
            self.last_stats = self._control_reduction()
            if self._model_avg is not None:
                self._finish_model_average()
            self._end_step()
            return self.last_stats
        for state in self._buckets:
            if not state.launched:
                for p in state.params:
                    self._take_gradient(p)  # a no-op for those whose hook took theirs
                self._launch(state)
        squares = []
        for state in self._buckets:
            state.handle.wait()
            if self.track_grad_norms:
                payload = state.bucket.payload
                squares.append(torch.dot(payload, payload).double())
        global_sq = 0.0
        if self.track_grad_norms:
            # A monitored step's one transfer of gradient data to the host (a sync on a
            # GPU, after backward): this rank's squared norm and the averaged one's.
            local = torch.stack([b.sqnorm.double() for b in self._buckets
                                 if b.sqnorm is not None]).sum() * self._share()
            norms = torch.stack([local, torch.stack(squares).sum()]).cpu()
            local_sq, global_sq = (float(v) for v in norms.numpy())
            self._start_control(local_sq)
        host = self._finish_control()
        self.last_stats = GradientStats(float(host[0]), global_sq,
                                        host[1:self._extra_slots + 1].copy())
        if self._model_avg is not None:
            self._finish_model_average()
        self._finish_pair_average()  # a monitored pair-avg step
        self._end_step()
        return self.last_stats

    def _end_step(self) -> None:
        """The step's exchange is complete: a later failure does not undo it."""
        self._reset_step()
        self._synchronized = True

    def flat_gradients(self) -> List[torch.Tensor]:
        """The gradient buckets' payloads (views; valid until the next zero_grad)."""
        return [b.bucket.payload for b in self._buckets]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _one_device(named) -> torch.device:
    """The device every parameter is on; ConfigurationError naming one that is elsewhere."""
    first_name, first = named[0]
    for name, p in named:
        if p.device != first.device:
            raise ConfigurationError(
                f"parameter {name!r} is on {p.device} and {first_name!r} on {first.device}: "
                f"move the whole model to one device before wrapping its optimizer")
    return first.device
