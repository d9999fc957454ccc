"""``topology-auto``: choose the gradients' allreduce topology from the world's layout, and
try another when the exchange gets slower (KungFu's AUTO strategy and its interference
detector, on hpcadapt's topologies).

* At the start and after every resize: hierarchical when the world spans several nodes with
  several ranks on some node (traffic inside a node is cheap, across nodes dear), else flat.
* Every step each rank's time waiting for the exchange arrives in the snapshot (the control
  reduction carries every rank's). Over a window of ``window`` steps each rank compares its
  median wait with the first window after the last change (the reference); a rank whose
  throughput fell below ``threshold`` of the reference (its wait grew beyond 1/threshold)
  votes for a change; a majority switches to the next candidate, and the reference starts
  again. Pure: rank 0 decides, the plan applies it on every rank."""

from __future__ import annotations

import statistics
from typing import Any, Dict, List, Optional

from .base import Decision, MetricsSnapshot, Param, Policy
from .params import fraction_open, positive_int

__all__ = ["TopologyAuto", "layout_choice"]


def layout_choice(world_size: int, nodes: int) -> str:
    """The topology the layout suggests."""
    return "hierarchical" if 1 < nodes < world_size else "flat"


class TopologyAuto(Policy):
    name = "topology-auto"
    params = (
        Param("threshold", fraction_open, 0.8,
              "a rank votes for another topology when its exchange throughput falls below "
              "this fraction of the reference window's"),
        Param("window", positive_int, 20, "steps per window of measured wait times"),
    )
    reads = ("step", "world_size")

    def __init__(self, *, threshold: float = 0.8, window: int = 20):
        self.threshold = threshold
        self.window = window
        self.reference: Optional[List[float]] = None  # per-rank median wait, first window
        self.current: List[List[float]] = []           # this window's per-rank waits
        self.tried: List[str] = []                      # topologies since the last layout

    def _candidates(self, snap: MetricsSnapshot) -> List[str]:
        first = layout_choice(snap.world_size, snap.nodes)
        rest = ["ring", "tree", "flat"] + (["hierarchical"] if snap.nodes > 1 else [])
        return [first] + [t for t in rest if t != first]

    def _restart(self) -> None:
        self.reference, self.current = None, []

    def _by_layout(self, snap: MetricsSnapshot, why: str) -> Optional[Decision]:
        self._restart()
        choice = layout_choice(snap.world_size, snap.nodes)
        self.tried = [choice]
        if choice == snap.topology:
            return None
        return Decision(reason=f"{why}: {snap.world_size} ranks on {snap.nodes} node(s)",
                        topology=choice, policy=self.name,
                        metrics={"world_size": float(snap.world_size),
                                 "nodes": float(snap.nodes)})

    def before_train(self, snap: MetricsSnapshot) -> Optional[Decision]:
        return self._by_layout(snap, "layout at the start")

    def on_resize(self, snap: MetricsSnapshot, *, old_size: int, new_size: int
                  ) -> Optional[Decision]:
        return self._by_layout(snap, f"layout after the resize {old_size} -> {new_size}")

    def after_step(self, snap: MetricsSnapshot) -> Optional[Decision]:
        waits = list(snap.wait_time)
        if snap.world_size < 2 or len(waits) != snap.world_size or snap.resizing:
            return None
        self.current.append(waits)
        if len(self.current) < self.window:
            return None
        means = [statistics.median(col) for col in zip(*self.current)]  # robust to spikes
        self.current = []
        if self.reference is None or len(self.reference) != len(means):
            self.reference = means
            return None
        slower = sum(1 for m, r in zip(means, self.reference)
                     if r > 0 and m > r / self.threshold)
        if 2 * slower <= len(means):
            return None
        untried = [t for t in self._candidates(snap)
                   if t != snap.topology and t not in self.tried]
        if not untried:
            # every candidate was tried since the last layout decision: stay (no flapping)
            self._restart()
            return None
        choice = untried[0]
        self.tried.append(choice)
        self._restart()
        return Decision(reason=f"{slower} of {len(means)} ranks measured the exchange below "
                               f"{self.threshold:g} of its reference throughput on "
                               f"{snap.topology}", topology=choice, policy=self.name,
                        metrics={"slower_ranks": float(slower),
                                 "world_size": float(snap.world_size)})

    def state_dict(self) -> Dict[str, Any]:
        return {"reference": self.reference, "tried": list(self.tried)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.reference = state.get("reference")
        self.tried = list(state.get("tried", []))
        self.current = []
