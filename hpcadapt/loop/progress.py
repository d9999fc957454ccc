"""Step-based LR schedules under an adaptive batch: step them by progress, not by steps.

When a policy grows the global batch, a step holds more samples, so a cosine over N steps
(or a warm-up over W) written for the starting batch ends too late. ``ProgressLR`` wraps
any ``torch.optim.lr_scheduler`` scheduler and keeps its step count equal to the job's
scale-invariant step count (samples seen / the starting global batch), so the schedule
follows the data, as AdaptDL's and AdaScale's progress do."""

from __future__ import annotations

import math
from typing import Any, Dict

from hpcadapt.base.errors import ConfigurationError

__all__ = ["ProgressLR"]


class ProgressLR:
    """``ProgressLR(scheduler, job)``: call ``step()`` after every ``job.step(...)`` as you
    would call ``scheduler.step()``; it steps ``scheduler`` as many times as the job's
    ``scale_invariant_steps`` moved (0 or more). Register it with the job
    (``extra={"scheduler": sched}``) so that it travels with resizes, recoveries and
    checkpoints. Write the wrapped schedule in steps at the starting global batch.
    ``key="gain"`` keys it on ``job.gain_steps`` instead (AdaScale's progress, with
    ``--lr-rule adascale``)."""

    def __init__(self, scheduler: Any, job: Any, *, key: str = "samples"):
        if key not in ("samples", "gain"):
            raise ConfigurationError(f"ProgressLR key must be 'samples' or 'gain', got {key!r}")
        self.scheduler = scheduler
        self.job = job
        self.key = key
        # The optimizer's scheduler is keyed on progress (job.setup's check reads this).
        optimizer = getattr(scheduler, "optimizer", None)
        if optimizer is not None:
            optimizer._hpcadapt_progress_lr = True

    @property
    def last_epoch(self) -> int:
        """The wrapped scheduler's step count (scale-invariant steps taken)."""
        return int(self.scheduler.last_epoch)

    def step(self) -> None:
        progress = self.job.gain_steps if self.key == "gain" else self.job.scale_invariant_steps
        target = math.floor(progress + 1e-9)
        while self.scheduler.last_epoch < target:
            self.scheduler.step()

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self) -> Dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
