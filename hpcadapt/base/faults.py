"""Fault injection for tests and drills: a rank SIGKILLs itself (or sends itself another
signal) at a named point of the step flow, so that an event can be placed where a random
one rarely lands (the plan's broadcast, a join's merge, a state transfer, a recovery).

``HPCADAPT_FAULT=PHASE:RANK:STEP[:SIGNAL][,...]`` (read once, when the job starts: ``arm``):
the process that is rank RANK of its launch (mpirun/mpiexec/srun; never a worker started to
join) sends
itself SIGNAL (default SIGKILL: a crash, no clean-up) when it first reaches PHASE at step
STEP or later; a signal other than SIGKILL is sent once (SIGUSR1: a stop asked right
there). Phases: ``gradient`` (before the step's gradient exchange completes; a
bounded-delay worker: before it sends its update), ``plan``
(before a boundary's plan broadcast), ``join`` (before the running job merges with spawned
joiners), ``state`` (before rank 0 sends the state to joiners), ``recovery`` (on entering
the recovery from another rank's death), ``formation`` (in a recovery, after the survivors
agreed and before their new world has formed). Unset, each point costs one comparison."""

from __future__ import annotations

import os
import signal
from typing import List, Optional, Tuple

__all__ = ["arm", "point", "PHASES"]

PHASES = ("gradient", "plan", "join", "state", "recovery", "formation")

Fault = Tuple[str, int, int, int]   # phase, launch rank, step, signal number


def _parse(text: str) -> List[Fault]:
    faults: List[Fault] = []
    for part in filter(None, text.split(",")):
        fields = part.split(":")
        try:
            if len(fields) not in (3, 4):
                raise ValueError
            sig = signal.Signals[fields[3]] if len(fields) == 4 else signal.SIGKILL
            fault = (fields[0], int(fields[1]), int(fields[2]), int(sig))
        except (ValueError, KeyError):
            raise SystemExit(f"HPCADAPT_FAULT={text!r}: give PHASE:RANK:STEP[:SIGNAL] "
                             f"(comma-separated), PHASE one of {', '.join(PHASES)}, SIGNAL a "
                             f"name such as SIGUSR1") from None
        if fault[0] not in PHASES:
            raise SystemExit(f"HPCADAPT_FAULT={text!r}: unknown phase {fault[0]!r}; one of "
                             f"{', '.join(PHASES)}")
        faults.append(fault)
    return faults


def _this_process(faults: List[Fault]) -> List[Fault]:
    """The faults that are this process's: the launch rank they name, not a joiner."""
    from hpcadapt.base.config import JOIN_DIR_VARIABLE, SPAWNED_VARIABLE, launch_rank

    if not faults or os.environ.get(JOIN_DIR_VARIABLE) or os.environ.get(SPAWNED_VARIABLE):
        return []
    rank = launch_rank()
    return [f for f in faults if f[1] == rank]


_faults: Optional[List[Fault]] = None   # this process's, once the first point is reached


def arm() -> None:
    """Read HPCADAPT_FAULT now (the job does at its start, so a wrong value is refused there,
    not at the first point reached)."""
    global _faults
    if _faults is None:
        _faults = _this_process(_parse(os.environ.get("HPCADAPT_FAULT", "")))


def point(phase: str, step: int) -> None:
    """Send this process the signal HPCADAPT_FAULT names for this point (SIGKILL: die here,
    as a crash would)."""
    arm()
    for fault in list(_faults) if _faults else ():
        if fault[0] == phase and step >= fault[2]:
            if fault[3] != signal.SIGKILL:
                _faults.remove(fault)  # once
            os.kill(os.getpid(), fault[3])
