"""The Job's life as one value: the phase this process is in and the transitions between
them, as torch elastic's agent keeps a ``WorkerState``. The loop reads whether training is
over from it (``Job._over``); the membership (a join, a shrink) and the stops (a signal, a
stop file, divergence, a failure) move it; nothing else keeps a flag of its own for it."""

from __future__ import annotations

import enum
from typing import Dict, FrozenSet, Optional

__all__ = ["Phase", "JobPhase", "TRANSITIONS"]


class Phase(enum.Enum):
    JOINING = "joining"    # started to join a running job; holds no training state yet
    TRAINING = "training"  # holds the training state and trains
    FINISHED = "finished"  # --stop-file ended training here, as a finished run (exit 0)
    STOPPED = "stopped"    # a stop signal, divergence or an unrecoverable failure (75 or 1)
    LEFT = "left"          # this rank left the job in a shrink


#: where each phase may go. A stop after the stop file (a failure at the end) wins; a stop
#: may be told again (its state turned out not saved); nothing comes back from LEFT.
TRANSITIONS: Dict[Phase, FrozenSet[Phase]] = {
    Phase.JOINING: frozenset({Phase.TRAINING, Phase.STOPPED, Phase.LEFT}),
    Phase.TRAINING: frozenset({Phase.FINISHED, Phase.STOPPED, Phase.LEFT}),
    Phase.FINISHED: frozenset({Phase.STOPPED}),
    Phase.STOPPED: frozenset({Phase.STOPPED}),
    Phase.LEFT: frozenset(),
}


class JobPhase:
    """This process's phase, why it ended, and whether it holds the training state (a
    joiner does once it joined, or once a recovery handed it the agreed state; a joiner
    stopped before that still holds none). A transition not in ``TRANSITIONS`` is a bug:
    RuntimeError."""

    def __init__(self, *, joining: bool):
        self.phase = Phase.JOINING if joining else Phase.TRAINING
        self.holds_state = not joining
        self._why: Optional[str] = None
        self._saved = True

    def _move(self, to: Phase) -> None:
        if to not in TRANSITIONS[self.phase]:
            raise RuntimeError(f"hpcadapt bug: the job cannot go from {self.phase.value} to "
                               f"{to.value}")
        self.phase = to

    def took_state(self) -> None:
        """A join completed, or a recovery handed this process the agreed state."""
        self.holds_state = True
        if self.phase is Phase.JOINING:
            self._move(Phase.TRAINING)

    def finish(self, why: str) -> None:
        """Training ends here as a finished run (the stop file)."""
        self._move(Phase.FINISHED)
        self._why = why

    def stop(self, why: str, *, saved: bool = True) -> None:
        """Training stopped early; ``saved``: whether the state was saved (a requeue may
        resume it)."""
        self._move(Phase.STOPPED)
        self._why, self._saved = why, saved

    def not_saved(self) -> None:
        """The stop's state turned out not saved (rank 0's word)."""
        self.stop(self._why or "a stop", saved=False)

    def leave(self) -> None:
        """This rank left the job in a shrink."""
        self._move(Phase.LEFT)

    @property
    def over(self) -> bool:
        """Whether training is over on this rank (the loop ends at the next boundary)."""
        return self.phase in (Phase.FINISHED, Phase.STOPPED, Phase.LEFT)

    @property
    def left(self) -> bool:
        return self.phase is Phase.LEFT

    @property
    def finished_by_stop_file(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def stopped(self) -> Optional[str]:
        """Why training stopped early, ending in "; state NOT saved" when the state could
        not be saved; None unless STOPPED."""
        if self.phase is not Phase.STOPPED:
            return None
        return self._why if self._saved else f"{self._why}; state NOT saved"

    @property
    def saved(self) -> bool:
        """A stop's state was saved (exit 75 may requeue it)."""
        return self.phase is Phase.STOPPED and self._saved

    def __repr__(self) -> str:
        return f"JobPhase({self.phase.value}, why={self._why!r})"
