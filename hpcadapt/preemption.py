"""Stopping cleanly when the scheduler is about to end the job.

Slurm sends USR1 (or whichever signal ``#SBATCH --signal=SIG@T`` names) some seconds before a
time limit, and TERM before it kills a job (``scancel``, preemption). A handler only notes
the signal; the training then agrees on it at the next step boundary (the flag rides in the
gradient allreduce, so every rank stops at the same step), saves its state and exits with
``EXIT_REQUEUE`` so that the job script can requeue the job."""

from __future__ import annotations

import logging
import signal
from typing import Dict, Optional, Sequence

__all__ = ["StopSignals", "EXIT_REQUEUE", "parse_signal"]

log = logging.getLogger(__name__)

# EX_TEMPFAIL from sysexits.h: a temporary failure, to be retried (the job script requeues).
EXIT_REQUEUE = 75


def parse_signal(name: str) -> signal.Signals:
    """``USR1``, ``SIGUSR1`` or ``10`` -> signal.SIGUSR1; ValueError otherwise."""
    text = name.strip().upper()
    if text.isdigit():
        return signal.Signals(int(text))
    if not text.startswith("SIG"):
        text = "SIG" + text
    try:
        return signal.Signals[text]
    except KeyError:
        raise ValueError(f"unknown signal {name!r}; use a name like USR1 or TERM") from None


class StopSignals:
    """Remembers the first of ``signals`` received; ``received`` is its name (or None)."""

    def __init__(self, signals: Sequence[signal.Signals] = (signal.SIGUSR1, signal.SIGTERM)):
        self.signals = tuple(signals)
        self.received: Optional[str] = None
        self._previous: Dict[signal.Signals, object] = {}

    def _handle(self, signum: int, _frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            log.warning("%s received: the job saves its state at the next step boundary",
                        self.received)

    def install(self) -> "StopSignals":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
