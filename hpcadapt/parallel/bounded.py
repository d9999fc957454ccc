"""Bounded-delay aggregation (MLFabric): workers send updates to an aggregator without
waiting for each other, and an update that is too stale is dropped.

The job runs it in rounds of ``round_steps`` global batches (fewer at an epoch's end);
between rounds everything synchronous goes on as usual (policies, resizes, checkpoints,
stop votes). In a round rank 0 is the aggregator and ranks 1.. are the workers:

* the aggregator hands out the round's samples in batches of ``ceil(B / W)`` (global batch
  B, W workers); a worker computes the gradient of its batch on the model it holds and
  sends it with that model's version, then receives its next batch;
* queued updates are taken shortest job first (fewest samples: the short batches of an
  epoch's end before full ones) and aggregated, weighted by samples, up to one global
  batch per application, made with the user's optimizer on rank 0's model at the job's
  rate scaled by samples / B (the linear rule: the model moves as far per sample as in a
  synchronous step; a ramp's rate is the one of the global batch being applied);
* the model's version counts the global batches applied (as synchronous steps do), so a
  delay -- versions between the model an update was computed on and the one it would be
  applied to -- means the same whatever the number of workers. An update whose delay
  exceeds ``max_delay`` is dropped and its samples are handed out again, so every sample
  of a round is applied exactly once; an update whose loss or gradient is not finite is
  skipped (its samples count as used, as a skipped synchronous step's do);
* a worker receives the model with its next batch when it has fallen ``max_delay``
  versions behind (at least one), and always after a drop.

Floating buffers (BatchNorm's running statistics) come with each update; the aggregator
keeps the latest applied. Integer buffers (BatchNorm's ``num_batches_tracked``) stay rank
0's, which trains nothing in a round: they do not advance there. Messages are point-to-point on the world's communicator (their
own context: they never meet a collective); every wait is bounded by the world's
PeerWatch (a dead peer raises PeerFailure)."""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Tuple

import numpy as np
import torch
from hpcadapt.comm.mpi import MPI

from hpcadapt.comm.world import ABANDONED, World, wait_request

__all__ = ["FlatModel", "Aggregator", "AsyncWorker", "RoundReport", "Assignment"]

TAG_UPDATE_HEAD, TAG_UPDATE_BODY = 7101, 7102
TAG_REPLY_HEAD, TAG_REPLY_INDICES, TAG_REPLY_MODEL = 7103, 7104, 7105
WORK, DONE = 0.0, 1.0


class FlatModel:
    """A model's parameters and floating buffers as one host vector (what a pull carries),
    and its gradients and buffers as another (what an update carries)."""

    def __init__(self, model: torch.nn.Module):
        self.params = list(model.parameters())
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        dtypes = {t.dtype for t in self.params + self.buffers}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        if self.dtype not in (torch.float32, torch.float64, torch.float16):
            self.dtype = torch.float32  # bfloat16 has no numpy twin: travels as float32
        self.np_dtype = torch.empty(0, dtype=self.dtype).numpy().dtype
        self.param_numel = sum(p.numel() for p in self.params)
        self.numel = self.param_numel + sum(b.numel() for b in self.buffers)

    def _cat(self, tensors: List[torch.Tensor]) -> np.ndarray:
        if not tensors:
            return np.zeros(0, dtype=self.np_dtype)
        flat = torch.cat([t.detach().reshape(-1).to("cpu", self.dtype) for t in tensors])
        return flat.numpy()

    def model_vector(self) -> np.ndarray:
        return self._cat(self.params + self.buffers)

    def update_vector(self) -> np.ndarray:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return self._cat(grads + self.buffers)

    def _write(self, tensors: List[torch.Tensor], vec: np.ndarray) -> None:
        src = torch.from_numpy(vec)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                k = t.numel()
                t.copy_(src[offset:offset + k].view_as(t))
                offset += k

    def load_model(self, vec: np.ndarray) -> None:
        self._write([p.data for p in self.params] + self.buffers, vec)

    def load_buffers(self, vec: np.ndarray) -> None:
        self._write(self.buffers, vec[self.param_numel:])

    def set_gradients(self, vec: np.ndarray) -> None:
        src = torch.from_numpy(vec)
        offset = 0
        for p in self.params:
            k = p.numel()
            p.grad = src[offset:offset + k].view_as(p).to(p.device, p.dtype).clone()
            offset += k


@dataclass
class Assignment:
    """A batch handed to a worker: its id in the round and its dataset indices."""

    batch_id: int
    indices: np.ndarray


@dataclass
class _Update:
    rank: int
    version: int
    samples: int
    loss_sum: float
    compute_s: float
    batch_id: int
    body: np.ndarray
    arrival: int


@dataclass
class RoundReport:
    """What one round did (the aggregator's count; workers know only their own part)."""

    samples: int = 0                  # samples the round covered (all applied)
    applied_updates: int = 0
    dropped_updates: int = 0
    nonfinite_updates: int = 0        # loss or gradient not finite: skipped, samples used
    applications: int = 0             # optimizer steps on the aggregator's model
    delays_applied: Dict[int, int] = field(default_factory=dict)  # delay -> updates
    delays_dropped: Dict[int, int] = field(default_factory=dict)
    loss_sum: float = 0.0             # over the applied updates' samples
    updates: Dict[int, int] = field(default_factory=dict)        # worker -> updates sent
    trained: Dict[int, int] = field(default_factory=dict)        # worker -> samples applied
    compute_s: Dict[int, float] = field(default_factory=dict)    # worker -> compute seconds
    pulls: int = 0
    round_s: float = 0.0
    # (global batch slot in the round, worker, indices) of every applied update
    applied: List[Tuple[int, int, np.ndarray]] = field(default_factory=list)

    def to_dict(self) -> Dict[str, object]:
        return {"samples": self.samples, "applied_updates": self.applied_updates,
                "dropped_updates": self.dropped_updates,
                "nonfinite_updates": self.nonfinite_updates, "applications": self.applications,
                "delays_applied": {str(k): v for k, v in sorted(self.delays_applied.items())},
                "delays_dropped": {str(k): v for k, v in sorted(self.delays_dropped.items())},
                "updates_per_worker": {str(k): v for k, v in sorted(self.updates.items())},
                "pulls": self.pulls, "round_s": self.round_s}


def _finite(u: "_Update") -> bool:
    return bool(np.isfinite(u.loss_sum) and np.isfinite(u.body).all())


class Aggregator:
    """Rank 0's side of a round. ``apply(samples, slot)`` steps rank 0's model with the
    gradient set in ``.grad`` (the job's optimizer at the scaled rate; ``slot``: the global
    batches applied so far in the round); ``flat`` reads and writes that model."""

    def __init__(self, world: World, flat: FlatModel, indices: np.ndarray, *,
                 global_batch: int, max_delay: int,
                 apply: Callable[[int, int], None]):
        if world.rank != 0 or world.size < 2:
            raise ValueError("the aggregator is rank 0 of a world of two or more")
        self.world, self.flat = world, flat
        self.global_batch, self.max_delay, self.apply = global_batch, max_delay, apply
        self.workers = list(range(1, world.size))
        per_batch = max(1, math.ceil(global_batch / len(self.workers)))
        self.todo: Deque[Assignment] = collections.deque(
            Assignment(i, indices[s:s + per_batch])
            for i, s in enumerate(range(0, len(indices), per_batch)))
        self.again: Deque[Assignment] = collections.deque()  # dropped: handed out first
        self.out: Dict[int, Assignment] = {}          # batch id -> handed out, not applied
        self.model_version = {w: 0 for w in self.workers}
        self.idle: List[int] = []
        self.total = len(indices)
        self.applied_samples = 0
        self.report = RoundReport(samples=self.total)
        self._sends: List[Tuple[MPI.Request, object]] = []
        self._heads: Dict[int, Tuple[MPI.Request, np.ndarray]] = {}  # posted per worker
        self._arrivals = 0

    def run(self) -> RoundReport:
        t0 = time.perf_counter()
        try:
            for w in self.workers:
                self._post_head(w)
                self._hand_out(w, pull=False)
            queue: List[_Update] = []
            while self.applied_samples < self.total:
                self._receive(queue, block=not queue)
                self._decide(queue)
            for w in self.idle:
                self._send_head(w, DONE, pull=False, n=0, batch_id=-1)
            self.idle = []
            self._finish_sends()
            self._cancel_heads()
        except BaseException:
            ABANDONED.append((self._sends, self._heads))
            raise
        self.report.round_s = time.perf_counter() - t0
        return self.report

    # -- messages --------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The model's version, counted in global batches applied (as synchronous steps
        count them): W workers' updates of B / W samples move it by one, so a delay means
        the same whatever the number of workers (counted per application, it grew with W
        and dropped ever more work: 28% of updates at 4 workers, 68% at 16, simulated)."""
        return self.applied_samples // self.global_batch

    def _post_head(self, worker: int) -> None:
        buf = np.empty(6, dtype=np.float64)
        self._heads[worker] = (self.world.comm.Irecv(buf, worker, TAG_UPDATE_HEAD), buf)

    def _receive(self, queue: List[_Update], *, block: bool) -> None:
        """Take the updates that have arrived (waiting, bounded, for one when ``block``).
        One receive is posted per worker: MPICH does not match MPI.ANY_SOURCE across
        processes that joined dynamically."""
        workers = list(self._heads)
        while True:
            ready = [w for w in workers if self._heads[w][0].Test()]
            if not ready and block:
                i = self.world.watch.wait_any([self._heads[w][0] for w in workers],
                                              "bounded-delay: waiting for a worker's update")
                ready = [workers[i]]
            if not ready:
                return
            for rank in ready:
                head = self._heads[rank][1]
                body = np.empty(self.flat.numel, dtype=self.flat.np_dtype)
                wait_request(self.world.comm.Irecv(body, rank, TAG_UPDATE_BODY),
                             self.world.watch, f"bounded-delay: rank {rank}'s gradient")
                self._post_head(rank)
                self._arrivals += 1
                queue.append(_Update(rank, int(head[1]), int(head[2]), float(head[3]),
                                     float(head[4]), int(head[5]), body, self._arrivals))
                r = self.report
                r.updates[rank] = r.updates.get(rank, 0) + 1
                r.compute_s[rank] = r.compute_s.get(rank, 0.0) + float(head[4])
            block = False

    def _cancel_heads(self) -> None:
        """The round is over and no update is in flight: the posted receives go."""
        for request, _ in self._heads.values():
            request.Cancel()
            request.Wait()
        self._heads = {}

    def _send(self, buf: np.ndarray, dest: int, tag: int) -> None:
        self._sends.append((self.world.comm.Isend(buf, dest, tag), buf))

    def _send_head(self, dest: int, status: float, *, pull: bool, n: int, batch_id: int) -> None:
        self._send(np.array([status, self.version, 1.0 if pull else 0.0, n, batch_id],
                            dtype=np.float64), dest, TAG_REPLY_HEAD)

    def _finish_sends(self) -> None:
        for req, _ in self._sends:
            wait_request(req, self.world.watch, "bounded-delay: a reply to a worker")
        self._sends = []

    def _reap_sends(self) -> None:
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    # -- deciding ----------------------------------------------------------------------
    def _hand_out(self, worker: int, *, pull: bool) -> None:
        """The worker's next batch (dropped samples first), with the model when it is too
        far behind; idle when there is nothing to hand out yet, DONE when all is applied."""
        queue = self.again if self.again else self.todo
        if not queue:
            if self.applied_samples >= self.total:
                self._send_head(worker, DONE, pull=False, n=0, batch_id=-1)
            else:
                self.idle.append(worker)
            return
        work = queue.popleft()
        behind = self.version - self.model_version[worker]
        pull = pull or (behind >= max(self.max_delay, 1))
        self.out[work.batch_id] = work
        self._send_head(worker, WORK, pull=pull, n=len(work.indices), batch_id=work.batch_id)
        self._send(np.ascontiguousarray(work.indices, dtype=np.int64), worker, TAG_REPLY_INDICES)
        if pull:
            self._send(self.flat.model_vector(), worker, TAG_REPLY_MODEL)
            self.model_version[worker] = self.version
            self.report.pulls += 1

    def _decide(self, queue: List[_Update]) -> None:
        r = self.report
        answer: List[Tuple[int, bool]] = []
        for u in [u for u in queue if self.version - u.version > self.max_delay]:
            queue.remove(u)
            delay = self.version - u.version
            r.dropped_updates += 1
            r.delays_dropped[delay] = r.delays_dropped.get(delay, 0) + 1
            self.again.append(self.out.pop(u.batch_id))
            answer.append((u.rank, True))
        if queue:
            queue.sort(key=lambda u: (u.samples, u.arrival))  # shortest job first
            take: List[_Update] = []
            samples = 0
            for u in list(queue):
                if not take or samples + u.samples <= self.global_batch:
                    take.append(u)
                    samples += u.samples
                    queue.remove(u)
            finite = [u for u in take if _finite(u)]
            kept = {id(u) for u in finite}
            slot = self.version  # the version these updates are applied to
            if finite:
                n = sum(u.samples for u in finite)
                total = np.zeros(self.flat.param_numel, dtype=np.float64)
                for u in finite:
                    total += u.body[:self.flat.param_numel] * (u.samples / n)
                self.flat.set_gradients(total.astype(take[0].body.dtype, copy=False))
                self.flat.load_buffers(max(finite, key=lambda u: u.arrival).body)
                self.apply(n, slot)
                r.applications += 1
            for u in take:
                delay = slot - u.version
                if id(u) in kept:
                    r.delays_applied[delay] = r.delays_applied.get(delay, 0) + 1
                    r.applied_updates += 1
                    r.loss_sum += u.loss_sum
                else:  # its samples count as used, as a skipped synchronous step's do
                    r.nonfinite_updates += 1
                r.trained[u.rank] = r.trained.get(u.rank, 0) + u.samples
                self.applied_samples += u.samples
                r.applied.append((slot, u.rank, self.out.pop(u.batch_id).indices))
                answer.append((u.rank, False))
        for worker, dropped in answer:
            self._hand_out(worker, pull=dropped)
        while self.idle and (self.again or self.applied_samples >= self.total):
            self._hand_out(self.idle.pop(0), pull=False)
        self._reap_sends()


class AsyncWorker:
    """A worker's side of a round: receive a batch (and maybe the model), send the
    gradient computed on it, until the aggregator says the round is done."""

    def __init__(self, world: World, flat: FlatModel):
        self.world, self.flat = world, flat
        self.version = 0
        self._sends: List[Tuple[MPI.Request, object]] = []
        self.updates = 0
        self.pulls = 0

    def next_batch(self) -> Optional[Assignment]:
        """The next batch to train on, or None when the round is over (bounded wait)."""
        comm, watch = self.world.comm, self.world.watch
        try:
            head = np.empty(5, dtype=np.float64)
            wait_request(comm.Irecv(head, 0, TAG_REPLY_HEAD), watch,
                         "bounded-delay: waiting for the aggregator (rank 0)")
            if head[0] == DONE:
                self._finish_sends()
                return None
            n = int(head[3])
            indices = np.empty(n, dtype=np.int64)
            wait_request(comm.Irecv(indices, 0, TAG_REPLY_INDICES), watch,
                         "bounded-delay: the aggregator's batch")
            if head[2] > 0.5:
                vec = np.empty(self.flat.numel, dtype=self.flat.np_dtype)
                wait_request(comm.Irecv(vec, 0, TAG_REPLY_MODEL), watch,
                             "bounded-delay: the aggregator's model")
                self.flat.load_model(vec)
                self.version = int(head[1])
                self.pulls += 1
        except BaseException:
            ABANDONED.append(self._sends)
            raise
        return Assignment(int(head[4]), indices)

    def send_update(self, batch_id: int, samples: int, loss_sum: float,
                    compute_s: float) -> None:
        """Send the gradient in ``.grad`` (and the floating buffers) without waiting."""
        head = np.array([self.world.rank, self.version, samples, loss_sum, compute_s,
                         batch_id], dtype=np.float64)
        body = self.flat.update_vector()
        comm = self.world.comm
        try:
            self._finish_sends()  # the previous update's buffers are free again
            # one by one: a send refused (a revoked world) keeps the other's buffer listed
            for buf, tag in ((head, TAG_UPDATE_HEAD), (body, TAG_UPDATE_BODY)):
                self._sends.append((comm.Isend(buf, 0, tag), buf))
        except BaseException:
            ABANDONED.append(self._sends)  # MPI may still read them until the world goes
            raise
        self.updates += 1

    def _finish_sends(self) -> None:
        for req, _ in self._sends:
            wait_request(req, self.world.watch, "bounded-delay: an update to the aggregator")
        self._sends = []
