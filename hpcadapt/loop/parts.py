"""What the loop's collaborators read of the Job: its parts (the options, the world, the
training state, the user's model, optimizer, loader and extra state), never another
collaborator, which each is handed on its own. The Job satisfies it; a unit test passes a
plain object with these values."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    from hpcadapt.base.options import JobOptions
    from hpcadapt.comm.world import World
    from hpcadapt.data.loader import ElasticDataLoader
    from hpcadapt.parallel.optimizer import DistributedOptimizer
    from hpcadapt.state.training import TrainingState, UserState

__all__ = ["JobParts", "PART_NAMES"]

#: the attributes of ``JobParts``: all a collaborator may read through it (a test reads the
#: code of hpcadapt/loop/ for it)
PART_NAMES = ("options", "world", "state", "model", "optimizer", "loader", "extra")


class JobParts(Protocol):
    options: "JobOptions"
    world: "World"
    state: Optional["TrainingState"]   # None until job.setup
    model: Any                         # the user's torch.nn.Module
    optimizer: "DistributedOptimizer"  # wraps the user's optimizer
    loader: "ElasticDataLoader"
    extra: "UserState"
