"""The step's control values: the loss, each rank's timings and samples, and the stop votes
travel summed over the ranks with the gradients (one reduction, no collective of their own).
``ControlLayout`` names their places in that vector; ``ControlReading`` is what a rank reads
back after the reduction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np

__all__ = ["ControlLayout", "ControlReading", "StepReport", "StepTimes"]


@dataclass(frozen=True)
class StepTimes:
    """Per-rank timings of the previous step, gathered through the control values."""

    step_time: np.ndarray      # seconds, one entry per rank
    compute_time: np.ndarray   # forward + backward (with communication launched inside)
    wait_time: np.ndarray      # waiting for the gradient allreduce to finish
    samples: np.ndarray        # samples each rank trained on in this step


@dataclass(frozen=True)
class StepReport:
    """What the last committed step (round) did, as the monitoring and the policies read
    it: the Job hands it over (``loop.steps.StepRunner.report``)."""

    loss: float                   # the global mean loss
    count: int                    # its global samples
    step_time: float              # seconds, the step (round) whole
    times: Optional[StepTimes]    # per rank: step, compute and wait times, samples
    monitored: bool               # whether it measured the gradient statistics
    used_settings: Dict[str, Any]  # the optimizer's settings as the update applied them
    rate: float                   # the rate of the last update


@dataclass(frozen=True)
class ControlReading:
    """The control values after the reduction, the same on every rank."""

    loss: float              # the mean loss of the step's global batch (NaN: none trained)
    times: StepTimes
    stop_signal: bool        # some rank received a stop signal
    stop_file: bool          # rank 0 found the stop file
    nonfinite_updates: int   # a bounded-delay round's updates skipped as non-finite


@dataclass(frozen=True)
class ControlLayout:
    """Where each value sits: the loss sum first, then four per-rank blocks (step, compute
    and wait time, samples) of ``ranks`` slots each, then the three flags. ``ranks`` is the
    most workers the job can grow to, so the layout stays the same across resizes."""

    ranks: int

    LOSS = 0
    STEP, COMPUTE, WAIT, SAMPLES = range(4)  # the per-rank blocks, in this order
    NONFINITE_UPDATES, STOP_FILE, STOP_SIGNAL = -3, -2, -1

    @property
    def length(self) -> int:
        return 4 + 4 * self.ranks

    def zeros(self) -> np.ndarray:
        return np.zeros(self.length)

    def slot(self, block: int, rank: int) -> int:
        """The index of ``rank``'s value in per-rank ``block`` (STEP, COMPUTE, ...)."""
        return 1 + block * self.ranks + rank

    def put_rank(self, values: np.ndarray, rank: int, *, step_s: float, compute_s: float,
                 wait_s: float, samples: float) -> None:
        for block, value in ((self.STEP, step_s), (self.COMPUTE, compute_s),
                             (self.WAIT, wait_s), (self.SAMPLES, samples)):
            values[self.slot(block, rank)] = value

    def read(self, values: np.ndarray, world_size: int, global_count: int) -> ControlReading:
        """The reduced ``values`` of a step that trained ``global_count`` samples on
        ``world_size`` ranks."""
        start = self.slot
        times = StepTimes(*(values[start(b, 0):start(b, 0) + world_size].copy()
                            for b in (self.STEP, self.COMPUTE, self.WAIT, self.SAMPLES)))
        return ControlReading(
            loss=values[self.LOSS] / global_count if global_count else float("nan"),
            times=times, stop_signal=bool(values[self.STOP_SIGNAL] > 0.5),
            stop_file=bool(values[self.STOP_FILE] > 0.5),
            nonfinite_updates=int(values[self.NONFINITE_UPDATES]))
