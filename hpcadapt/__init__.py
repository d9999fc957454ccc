"""hpcadapt: adaptive data-parallel PyTorch training over MPI for HPC clusters.

The names below load on first use (PEP 562), so ``import hpcadapt`` itself does not load
torch or MPI: ``python -m hpcadapt.train`` blocks the scheduler's stop signals before the
heavy imports (about 2.6 s) instead of after them."""

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_HOMES = {
    ".comm.world": ["init", "shutdown", "world", "is_initialized", "World", "WorldInfo"],
    ".comm.collectives": ["ReduceOp", "Handle", "MPICommunicator", "communicator", "allreduce",
                     "allreduce_async", "broadcast", "broadcast_async", "allgather",
                     "allgather_async", "barrier", "barrier_async"],
    ".comm.fusion": ["grouped_allreduce", "grouped_allreduce_async"],
    ".parallel.optimizer": ["DistributedOptimizer", "broadcast_parameters",
                            "broadcast_optimizer_state"],
    ".comm.tell": ["broadcast_object_state"],
    ".data.sampler": ["ElasticSampler"],
    ".job": ["Job"],
    ".base.options": ["JobOptions"],
    ".base.strategies": ["Strategy", "STRATEGIES", "strategy", "register_strategy"],
    ".data.loader": ["ElasticDataLoader"],
    ".loop.progress": ["ProgressLR"],
    ".args": ["add_arguments"],
    ".base.preemption": ["block_stop_signals", "EXIT_REQUEUE"],
    ".state.training": ["UserState", "TrainingState"],
    ".builtin_training": ["evaluate_accuracy"],
    ".base.errors": ["HpcAdaptError", "ConfigurationError", "CommunicationError", "MembershipError",
                "AllocationError", "PolicyError"],
}
_WHERE = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [name for names in _HOMES.values() for name in names]


_SUBMODULES = ("datasets", "models")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return import_module(f".{name}", __name__)
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hpcadapt' has no attribute {name!r}")
    value = getattr(import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
