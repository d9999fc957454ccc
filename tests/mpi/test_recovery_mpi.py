"""The survivors' agreement (hpcadapt.elastic.recovery.agree) on real MPI ranks: a rank that stays
silent through the first round's deadline (stuck in a call with a dead peer) is counted
dead by every other rank, which go on without it, instead of failing the whole job."""

import numpy as np
import pytest

import hpcadapt
from hpcadapt.elastic import recovery
from hpcadapt.comm.world import NOTICE_TAG

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def w():
    return hpcadapt.init()


def test_agreement_without_a_death_names_no_one(w):
    agreement = recovery.agree(w, [], deadline_s=60.0)
    assert agreement.dead == () and agreement.survivors == tuple(range(w.size))


def test_a_suspect_is_agreed_dead_by_all(w):
    suspect = w.size - 1
    if w.rank == suspect:  # the suspect takes no part (it is dead to the others)
        _drain(w, senders=range(1, w.size - 1))
    else:
        agreement = recovery.agree(w, [suspect] if w.rank == 0 else [], deadline_s=60.0)
        assert agreement.dead == (suspect,)
        assert agreement.survivors == tuple(range(w.size - 1))
    w.comm.Barrier()


def test_a_rank_silent_past_the_deadline_is_counted_dead(w):
    silent = w.size - 1
    # The others start the agreement together (a barrier of their own) with a deadline that
    # a loaded machine's scheduling cannot miss: only the silent rank may be counted dead.
    others = w.comm.Split(0 if w.rank != silent else 1, w.rank)
    if w.rank == silent:
        w.comm.Barrier()  # until the others have agreed without it
        _drain(w, senders=range(w.size - 1))
    else:
        others.Barrier()
        agreement = recovery.agree(w, [], deadline_s=5.0)
        assert agreement.dead == (silent,)
        assert agreement.survivors == tuple(range(w.size - 1))
        w.comm.Barrier()
    w.comm.Barrier()
    others.Free()


def _drain(w, senders):
    """Take the first round's masks the others sent this rank (a rank that knew it dead
    sends none; no rank sends it the second round's), so that no message is left for a
    later test."""
    buf = np.empty(w.size, dtype=np.int8)
    for r in senders:
        w.notices.Recv(buf, source=r, tag=NOTICE_TAG)
