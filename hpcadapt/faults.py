"""Fault injection for tests and drills: a rank SIGKILLs itself at a named point of the step
flow, so that a death can be placed where a random kill rarely lands (the plan's broadcast,
a join's merge, a state transfer).

``HPCADAPT_FAULT=PHASE:RANK:STEP`` (read once, at import): the process that is rank RANK of
its launch (mpirun/mpiexec/srun; never a worker started to join) dies when it first reaches
PHASE at step STEP or later. Phases: ``gradient`` (before the step's gradient exchange
completes), ``plan`` (before a boundary's plan broadcast), ``join`` (before the running job
merges with spawned joiners), ``state`` (before rank 0 sends the state to joiners),
``recovery`` (on entering the recovery from another rank's death: a second death while the
survivors shrink). Unset, each point costs one comparison."""

from __future__ import annotations

import os
import signal
from typing import Optional, Tuple

__all__ = ["point", "PHASES"]

PHASES = ("gradient", "plan", "join", "state", "recovery")


def _parse(text: str) -> Optional[Tuple[str, int, int]]:
    if not text:
        return None
    try:
        phase, rank, step = text.split(":")
        parsed = (phase, int(rank), int(step))
    except ValueError:
        raise SystemExit(f"HPCADAPT_FAULT={text!r}: give PHASE:RANK:STEP, PHASE one of "
                         f"{', '.join(PHASES)}") from None
    if phase not in PHASES:
        raise SystemExit(f"HPCADAPT_FAULT={text!r}: unknown phase {phase!r}; one of "
                         f"{', '.join(PHASES)}")
    return parsed


def _this_process(fault: Optional[Tuple[str, int, int]]) -> Optional[Tuple[str, int, int]]:
    """The fault when it is this process's: the launch rank it names, not a joiner."""
    from .config import JOIN_DIR_VARIABLE, SPAWNED_VARIABLE, launch_rank

    if fault is None or os.environ.get(JOIN_DIR_VARIABLE) or \
            os.environ.get(SPAWNED_VARIABLE):
        return None
    return fault if launch_rank() == fault[1] else None


_FAULT = _this_process(_parse(os.environ.get("HPCADAPT_FAULT", "")))


def point(phase: str, step: int) -> None:
    """Die here (SIGKILL, no clean-up: as a crash would) when HPCADAPT_FAULT names this."""
    if _FAULT is not None and _FAULT[0] == phase and step >= _FAULT[2]:
        os.kill(os.getpid(), signal.SIGKILL)
