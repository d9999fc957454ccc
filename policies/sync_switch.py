"""``sync-switch``: change the synchronisation strategy while training runs (KungFu's
adaptive SGD: model averaging early, S-SGD once the gradients say so or the cluster grows).

Triggers, any combination: a schedule of ``STEP:STRATEGY`` points; the noise scale reaching
a threshold (a large noise scale means large batches still help: averaging gradients exactly
then pays); the world reaching a size. A trigger switches to ``--sync-switch-to`` once; the
schedule's points apply in order. The strategies' own settings come with the decision
(``--sync-switch-sma-alpha``, ``-period``, ``-max-delay``, ``-round-steps``)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.base.strategies import SMA, STRATEGIES, BoundedDelay, LocalSGD, pick

from .base import Decision, MetricsSnapshot, Param, Policy
from .params import choice, non_negative_int, positive_float, positive_int, step_map

__all__ = ["SyncSwitch"]


class SyncSwitch(Policy):
    name = "sync-switch"
    params = (
        Param("steps", step_map(choice(STRATEGIES)), [],
              "STEP:STRATEGY points, e.g. 200:ssgd,400:sma"),
        Param("to", choice(STRATEGIES), "ssgd", "the strategy the triggers below switch to"),
        Param("noise-scale", positive_float, None,
              "switch once the measured gradient noise scale reaches this (samples)"),
        Param("workers", positive_int, None, "switch once the job has this many workers"),
        Param("sma-alpha", positive_float, SMA.sma_alpha,
              "sma's pull towards the average, in (0, 1]"),
        Param("period", positive_int, LocalSGD.period, "local-sgd's steps between model averages"),
        Param("max-delay", non_negative_int, BoundedDelay.max_delay, "bounded-delay's --max-delay"),
        Param("round-steps", positive_int, BoundedDelay.round_steps,
              "bounded-delay's --async-round-steps"),
    )
    reads = ("step", "world_size", "noise_scale")

    def __init__(self, *, steps: List[Tuple[int, str]] = (), to: str = "ssgd",
                 noise_scale: Optional[float] = None, workers: Optional[int] = None,
                 sma_alpha: float = SMA.sma_alpha, period: int = LocalSGD.period,
                 max_delay: int = BoundedDelay.max_delay,
                 round_steps: int = BoundedDelay.round_steps):
        if not steps and noise_scale is None and workers is None:
            raise ConfigurationError(
                "--policy sync-switch needs a trigger: --sync-switch-steps 200:ssgd, "
                "--sync-switch-noise-scale N or --sync-switch-workers K")
        self.settings = {"sma_alpha": sma_alpha, "period": period, "max_delay": max_delay,
                         "round_steps": round_steps}
        for name in STRATEGIES:
            pick(name, self.settings)  # a setting out of range is refused now, not later
        self.steps = list(steps)
        self.to = to
        self.noise_scale = noise_scale
        self.workers = workers
        # The noise scale needs the gns monitor; every 10th step (a monitored step averages
        # the gradients whatever the strategy, so every step would make it S-SGD).
        self.requires = ("gns",) if noise_scale is not None else ()
        self.reads = ("step", "world_size") + (("noise_scale",) if noise_scale is not None
                                               else ())
        self.interval = 10
        self.next = 0          # the first schedule point not yet applied
        self.triggered = False  # a metric trigger has fired (once)

    def _decide(self, name: str, current: str, why: str, metrics: Dict[str, float]
                ) -> Optional[Decision]:
        if name == current:
            return None
        target = pick(name, self.settings)
        return Decision(reason=f"{why}: {current} -> {target.describe()}",
                        strategy=target.to_dict(), policy=self.name, metrics=metrics)

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        if self.next < len(self.steps) and snap.step >= self.steps[self.next][0]:
            at, name = self.steps[self.next]
            self.next += 1
            return self._decide(name, snap.strategy, f"scheduled at step {at}",
                                {"step": float(snap.step)})
        if self.triggered:
            return None
        if self.workers is not None and snap.world_size >= self.workers:
            self.triggered = True
            return self._decide(self.to, snap.strategy,
                                f"{snap.world_size} workers (>= {self.workers})",
                                {"world_size": float(snap.world_size)})
        if self.noise_scale is not None and snap.monitored and math.isfinite(snap.noise_scale) \
                and snap.noise_scale >= self.noise_scale:
            self.triggered = True
            return self._decide(self.to, snap.strategy,
                                f"noise scale {snap.noise_scale:.0f} >= {self.noise_scale:g}",
                                {"noise_scale": float(snap.noise_scale)})
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {"next": self.next, "triggered": self.triggered}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.next = int(state.get("next", 0))
        self.triggered = bool(state.get("triggered", False))
