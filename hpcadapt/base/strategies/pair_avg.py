"""``pair-avg`` (KungFu's pair averaging): every step each replica fetches the model of one
random other replica without that peer stopping, takes the mean of the two, then applies its
own gradient (``hpcadapt.parallel.pairavg``)."""

from __future__ import annotations

from dataclasses import dataclass

from hpcadapt.base.strategies.strategy import Strategy


@dataclass(frozen=True)
class PairAveraging(Strategy):
    name = "pair-avg"
    summary = ("average with one random peer's model every step, fetched without the peer "
               "stopping (KungFu)")
    min_workers = 2
    pairs_models = True
