"""The allreduce topologies by name, and the parsing of the flags that name them: values a
plan or a policy checks without loading MPI (the topologies themselves: comm/topology.py)."""

from __future__ import annotations

import enum
from typing import Optional, Union

import numpy as np

from hpcadapt.base.errors import ConfigurationError

__all__ = ["Topology", "parse_topology", "parse_ranks_per_node"]


class Topology(enum.Enum):
    """How an allreduce travels.

    FLAT: MPI's own ``Iallreduce`` on the whole communicator.
    HIERARCHICAL: reduce inside each node to its lowest rank (the leader), allreduce among
    the leaders, broadcast inside each node. With one node, or one rank per node, it is
    flat (the reason is logged).
    RING: reduce-scatter then allgather around the ring of ranks, the array cut in
    ``size`` chunks: each rank sends and receives ``2 (size-1)/size`` of the array.
    TREE: binomial reduce to rank 0, then binomial broadcast: ``log2(size)`` rounds each
    way, whole arrays."""

    FLAT = "flat"
    HIERARCHICAL = "hierarchical"
    RING = "ring"
    TREE = "tree"


def parse_topology(name: Union[str, Topology]) -> Topology:
    """The Topology called ``name`` (case-insensitive); ConfigurationError listing the
    choices otherwise."""
    if isinstance(name, Topology):
        return name
    try:
        return Topology(str(name).strip().lower())
    except ValueError:
        raise ConfigurationError(
            f"unknown allreduce topology {name!r}; choose one of "
            f"{', '.join(t.value for t in Topology)}") from None


def parse_ranks_per_node(value: Union[None, int, str]) -> Optional[int]:
    """The emulated-nodes flag (``--ranks-per-node``): None, ``""`` or ``"auto"`` mean the
    real nodes; a whole number k >= 1 groups consecutive ranks into pretend nodes of k (the
    last one smaller when k does not divide the world size). ConfigurationError otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "auto"):
            return None
        k = int(text) if text.isdigit() else None
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        k = int(value)
    else:
        k = None
    if k is None or k < 1:
        raise ConfigurationError(
            f"ranks per node {value!r} is not usable: give a whole number >= 1 (consecutive "
            "ranks form pretend nodes of that many) or 'auto' (the real nodes)")
    return k
