"""``ssgd`` (synchronous SGD): every step averages the gradients (one allreduce, overlapped
with backward); the replicas stay bit-identical."""

from __future__ import annotations

from dataclasses import dataclass

from hpcadapt.base.strategies.strategy import Strategy


@dataclass(frozen=True)
class SSGD(Strategy):
    name = "ssgd"
    summary = "average gradients every step (replicas identical)"
    averages_gradients = True
