"""``straggler-async``: switch to bounded-delay aggregation while a straggler persists, and
back when it goes (MLFabric's answer to stragglers, chosen at run time).

A rank is slow at a check when its compute time per step (per update under bounded delay)
exceeds ``factor`` times the median of the other ranks that trained (the aggregator, rank
0, trains nothing in a bounded-delay round and is left out). Slow for ``patience`` checks
in a row: the job switches to ``bounded-delay`` (``--straggler-async-max-delay``,
``--straggler-async-round-steps``), so the others stop waiting for it. Under bounded delay a
check is one round; no slow rank for ``patience`` rounds switches back to the strategy it
left (by name, with that strategy's default settings). A straggler that is rank 0 is
relieved by the switch itself (it then only aggregates): the job stays asynchronous. With
2 ranks only a slow rank 0 switches (else the one worker left would be the straggler,
training every batch alone); a round in which one rank trained is no evidence either way."""

from __future__ import annotations

import logging
import statistics
from typing import Any, Dict, List, Optional

from hpcadapt.base.strategies import STRATEGIES, BoundedDelay, strategy

from .base import Decision, MetricsSnapshot, Param, Policy
from .params import float_above, non_negative_int, positive_int

__all__ = ["StragglerAsync"]

log = logging.getLogger(__name__)

ASYNC = BoundedDelay.name


class StragglerAsync(Policy):
    name = "straggler-async"
    params = (
        Param("factor", float_above(1.0), 1.5, "slower than this times the others' median"),
        Param("patience", positive_int, 5, "checks in a row (steps; rounds when asynchronous) "
                                           "before switching either way"),
        Param("max-delay", non_negative_int, 1, "the bounded-delay mode's --max-delay"),
        Param("round-steps", positive_int, 20, "the bounded-delay mode's --async-round-steps"),
    )
    reads = ("step", "world_size", "compute_time", "rank_samples")

    def __init__(self, *, factor: float = 1.5, patience: int = 5, max_delay: int = 1,
                 round_steps: int = 20):
        BoundedDelay(max_delay=max_delay, round_steps=round_steps)  # refuses bad settings
        self.factor, self.patience = factor, patience
        self.max_delay, self.round_steps = max_delay, round_steps
        self.interval = 1
        self.slow_streak = 0     # checks in a row with a slow rank
        self.fast_streak = 0     # checks in a row without one (while asynchronous)
        self.left: Optional[str] = None      # the strategy it switched away from
        self.straggler: Optional[int] = None  # the rank that made it switch
        self._said_two = False

    def slow_ranks(self, snap: MetricsSnapshot) -> List[int]:
        """Ranks slower than ``factor`` x the median of the other ranks that trained."""
        times = list(snap.compute_time)
        samples = list(snap.rank_samples) or [1.0] * len(times)
        trained = [r for r, t in enumerate(times) if r < len(samples) and samples[r] > 0
                   and t > 0]
        out = []
        for r in trained:
            others = [times[i] for i in trained if i != r]
            if others and times[r] > self.factor * statistics.median(others):
                out.append(r)
        return out

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        if snap.world_size < 2 or len(snap.compute_time) != snap.world_size:
            return None
        slow = self.slow_ranks(snap)
        metrics = {f"compute_time_rank{i}": t for i, t in enumerate(snap.compute_time)}
        if snap.strategy != ASYNC:
            if snap.world_size < 3:
                # one worker would be left, the straggler itself, training every batch
                # alone: only worth it when the straggler is rank 0 (then it aggregates)
                if any(r != 0 for r in slow) and not self._said_two:
                    self._said_two = True
                    log.info("straggler-async: rank %s is slow, but with 2 ranks bounded "
                             "delay would leave it training alone: no switch",
                             ", ".join(str(r) for r in slow if r != 0))
                slow = [r for r in slow if r == 0]
            self.slow_streak = self.slow_streak + 1 if slow else 0
            if self.slow_streak < self.patience:
                return None
            self.slow_streak, self.fast_streak = 0, 0
            self.left, self.straggler = snap.strategy, slow[0]
            target = BoundedDelay(max_delay=self.max_delay, round_steps=self.round_steps)
            return Decision(reason=f"rank {slow[0]} slower than {self.factor}x the others "
                                   f"for {self.patience} checks: {snap.strategy} -> "
                                   f"{target.describe()}",
                            strategy=target.to_dict(), metrics=metrics, policy=self.name)
        if self.left is None or self.straggler == 0:
            return None  # asynchronous by the user's choice, or rank 0 relieved by it
        trained = sum(1 for n in snap.rank_samples if n > 0)
        if trained < 2:
            return None  # one worker: nobody to compare it with, no evidence either way
        self.fast_streak = 0 if slow else self.fast_streak + 1
        if self.fast_streak < self.patience:
            return None
        back, self.left, self.fast_streak = self.left, None, 0
        return Decision(reason=f"no straggler for {self.patience} rounds: {ASYNC} -> {back}",
                        strategy=strategy(back).to_dict(), metrics=metrics, policy=self.name)

    def on_resize(self, snap: MetricsSnapshot, *, old_size: int, new_size: int):
        self.slow_streak = self.fast_streak = 0
        return None

    def state_dict(self) -> Dict[str, Any]:
        return {"left": self.left, "straggler": self.straggler,
                "slow_streak": self.slow_streak, "fast_streak": self.fast_streak}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        left = state.get("left")
        self.left = left if left in STRATEGIES else None
        straggler = state.get("straggler")
        self.straggler = int(straggler) if straggler is not None else None
        self.slow_streak = int(state.get("slow_streak", 0))
        self.fast_streak = int(state.get("fast_streak", 0))
