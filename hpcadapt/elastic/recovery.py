"""Recovery in place: after a worker dies, the survivors agree on who is gone and form a new
world without it, with no restart.

MPICH neither completes nor fails a collective when a peer dies (its fault-tolerance calls
are out of reach through mpi4py), so the survivors talk point to point, on the world's
notice communicator (``World.notices``), which needs only live peers:

1. a rank that notices a death (a pid gone, a launcher exited, or a notice received) sends
   its mask of dead ranks to every rank it believes alive, and collects theirs, merging as
   masks arrive (a rank another one reports dead is not waited for);
2. a second round exchanges the merged masks: equal everywhere, or the recovery fails;
3. the survivors build their communicator with ``MPI_Comm_create_group``, which involves the
   group's members only.

A rank silent through the first round's deadline (--peer-timeout: stuck in a call with the
dead peer) is counted dead too. A death during the second round, or survivors that disagree,
raise PeerFailure: the job then ends as before recovery existed (state saved, exit 75).

Under Open MPI with ULFM (``mpirun --with-ft ulfm``) the MPI does this itself, for any
rank of any launch (``shrink``): the rank that saw the death revokes the world's
communicators, so every survivor's operation on them fails and it comes here too; ``Shrink``
then gives every survivor the same communicator of the living, in the old rank order."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

import numpy as np
from hpcadapt.comm.mpi import MPI

from hpcadapt.comm.world import ABANDONED, NOTICE_TAG, PeerFailure, World

log = logging.getLogger(__name__)

__all__ = ["Agreement", "agree", "shrink", "unrecoverable", "form_world"]


@dataclass(frozen=True)
class Agreement:
    """What every survivor agreed on: the dead ranks and the survivors (old world ranks)."""

    dead: Tuple[int, ...]
    survivors: Tuple[int, ...]


def agree(world: World, suspects: Iterable[int], deadline_s: float) -> Agreement:
    """Two rounds of mask exchange among the ranks believed alive (see the module text)."""
    n, me = world.size, world.rank
    mask = np.zeros(n, dtype=np.int8)
    for r in suspects:
        if 0 <= r < n:
            mask[r] = 1
    t_end = time.perf_counter() + deadline_s
    for round_tag in (NOTICE_TAG, NOTICE_TAG + 1):
        first = round_tag == NOTICE_TAG
        received = _exchange(world, mask, round_tag,
                             t_end if first else time.perf_counter() + deadline_s,
                             count_silent_dead=first)
        if round_tag == NOTICE_TAG:
            for other in received.values():
                mask |= other
            continue
        for r, other in received.items():
            if not np.array_equal(other, mask):
                raise PeerFailure(f"the survivors disagree on who died (rank {r} sees "
                                  f"{_ranks(other)}, this rank {_ranks(mask)})", cause="timeout")
    if mask[me]:
        raise PeerFailure("the other survivors consider this rank dead", cause="timeout")
    dead = tuple(_ranks(mask))
    return Agreement(dead, tuple(r for r in range(n) if r not in dead))


def _exchange(world: World, mask: np.ndarray, tag: int, t_end: float,
              count_silent_dead: bool = False) -> dict:
    """Send ``mask`` to every rank it does not mark dead and receive theirs; a rank that
    becomes known dead meanwhile (locally, or in a mask received) is no longer waited for.
    A rank silent past ``t_end`` is counted dead (``count_silent_dead``) or ends the
    recovery. Requests to or from the dead are abandoned, never waited on."""
    comm, me = world.notices, world.rank
    sent = mask.copy()
    peers = [r for r in range(world.size) if r != me and not mask[r]]
    ABANDONED.append(sent)
    for r in peers:
        ABANDONED.append(comm.Isend(sent, dest=r, tag=tag))
    buffers = {r: np.empty_like(mask) for r in peers}
    pending = {r: comm.Irecv(buffers[r], source=r, tag=tag) for r in peers}
    received = {}
    while pending:
        for r, req in list(pending.items()):
            if req.Test():
                received[r] = buffers.pop(r)
                del pending[r]
                mask |= received[r]
        for r in world.watch.dead_ranks():
            mask[r] = 1
        for r in [r for r in pending if mask[r]]:
            ABANDONED.extend([pending.pop(r), buffers.pop(r)])
        if pending and time.perf_counter() > t_end:
            if not count_silent_dead:
                raise PeerFailure(f"rank(s) {sorted(pending)} did not answer during the "
                                  f"recovery (--peer-timeout)", cause="timeout")
            # Silent for the whole deadline: as good as dead (stuck in a call with the dead
            # peer; it ends itself at its own deadline). The second round checks that every
            # survivor counted it so.
            log.warning("rank(s) %s did not answer within --peer-timeout during the "
                        "recovery: counted as dead", sorted(pending))
            for r in list(pending):
                mask[r] = 1
                ABANDONED.extend([pending.pop(r), buffers.pop(r)])
        if pending:
            time.sleep(0.0005)
    return received


def shrink(world: World) -> Tuple[Agreement, MPI.Intracomm]:
    """ULFM: revoke the world's communicators, shrink to the living (collective over them;
    blocking, so the caller bounds it with a watchdog) and name the dead by comparing the
    two groups. Returns the agreement and the survivors' communicator."""
    comm = world.comm
    for c in (comm, world.notices):
        try:
            c.Revoke()
        except MPI.Exception:  # revoked already by another rank
            pass
    new = comm.Shrink()
    old_group, new_group = comm.Get_group(), new.Get_group()
    try:
        survivors = tuple(int(r) for r in MPI.Group.Translate_ranks(
            new_group, list(range(new.Get_size())), old_group))
    finally:
        old_group.Free()
        new_group.Free()
    dead = tuple(r for r in range(world.size) if r not in survivors)
    return Agreement(dead, survivors), new


def unrecoverable(world: World, agreement: Agreement, *, coordinator_may_move: bool,
                  launch_survives: bool = False) -> Optional[str]:
    """Why the survivors cannot go on without the dead (None when they can): a dead rank's
    launch still holds survivors (its launcher ends them too, unless ``launch_survives``:
    ULFM), no rank is left, or rank 0 died where its role cannot move (no
    ``hpcadapt.agent`` keeps the job: its launch was what the user or the job step waited
    on)."""
    if not agreement.survivors:
        return "no rank survived"
    for d in agreement.dead if not launch_survives else ():
        shared = [r for r in agreement.survivors if world.launches[r] == world.launches[d]]
        if shared:
            return (f"rank {d} was started by the same launch (mpiexec/srun) as rank(s) "
                    f"{shared}, which its launcher ends with it")
    if 0 in agreement.dead and not coordinator_may_move:
        return ("rank 0 (the coordinator) died and no agent keeps the job: start it under "
                "`python -m hpcadapt.agent` with --initial-workers for its role to move")
    return None


def form_world(comm: MPI.Intracomm, survivors: Tuple[int, ...]) -> MPI.Intracomm:
    """The survivors' communicator, in their old rank order (collective over them only)."""
    group = comm.Get_group().Incl(list(survivors))
    try:
        return comm.Create_group(group, tag=NOTICE_TAG + 2)
    finally:
        group.Free()


def _ranks(mask: np.ndarray) -> List[int]:
    return [int(r) for r in np.flatnonzero(mask)]
