"""Step-based LR schedules under an adaptive batch: step them by progress, not by steps.

When a policy grows the global batch, a step holds more samples, so a cosine over N steps
(or a warm-up over W) written for the starting batch ends too late. ``ProgressLR`` wraps
any ``torch.optim.lr_scheduler`` scheduler and keeps its step count equal to the job's
scale-invariant step count (samples seen / the starting global batch), so the schedule
follows the data, as AdaptDL's and AdaScale's progress do."""

from __future__ import annotations

import math
from typing import Any, Dict

import numpy as np

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.data.loader import split_micro

__all__ = ["ProgressLR", "TrainingProgress"]


class TrainingProgress:
    """The job's progress, for schedulers: read-only, the same on every rank. A part of
    ``hpcadapt.job.Job`` (a mixin over the job's state)."""

    @property
    def global_batch_size(self) -> int:
        """The global batch of the next step (policies change it)."""
        return self._require_setup().hyper.batch_size

    @property
    def local_batch_size(self) -> int:
        """This rank's share of the current step's global batch (0 for an empty share)."""
        if self._part is not None:
            return len(self._part.indices)
        return len(self._require_setup().sampler.peek(self.global_batch_size, self.rank,
                                                      self.size).indices)

    @property
    def accumulation_steps(self) -> int:
        """The micro-batches this rank's share is cut into (``--max-local-batch``): the
        batches the loader yields, and ``job.step`` calls, per step."""
        return max(1, len(split_micro(np.arange(self.local_batch_size),
                                      self.options.max_local_batch)))

    @property
    def samples_seen(self) -> int:
        """Samples trained on in committed steps, over all epochs (the global cursor)."""
        st = self._require_setup()
        return st.epoch * st.sampler.num_samples + st.sampler.cursor

    @property
    def epoch_progress(self) -> float:
        """Training progress in epochs, as a float (2.5: half-way through the third)."""
        st = self._require_setup()
        return self.samples_seen / st.sampler.num_samples

    @property
    def scale_invariant_steps(self) -> float:
        """The steps a run at the starting global batch would have taken for the samples
        seen so far (AdaptDL's progress): a step-based LR schedule keyed on this is the
        same whatever batch sizes the policies chose (see ``hpcadapt.ProgressLR``)."""
        st = self._require_setup()
        return self.samples_seen / st.origin["batch_size"]

    @property
    def gain_steps(self) -> float:
        """AdaScale's scale-invariant iterations: each committed step adds its gain r (the
        ``--lr-rule adascale`` factor, 1 <= r <= B/B0) and, under any other rule, B/B0 (so
        it equals ``scale_invariant_steps``). A schedule keyed on it
        (``ProgressLR(sched, job, key="gain")``) is AdaScale's: it moves as fast as the
        gradient's information, not its samples."""
        return self._require_setup().gain_steps


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
