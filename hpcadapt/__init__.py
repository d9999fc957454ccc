"""hpcadapt: adaptive data-parallel PyTorch training over MPI for HPC clusters."""

from .collectives import (Handle, MPICommunicator, ReduceOp, allgather, allgather_async,
                          allreduce, allreduce_async, barrier, barrier_async, broadcast,
                          broadcast_async, communicator)
from . import datasets, models
from .errors import (AllocationError, CommunicationError, ConfigurationError, HpcAdaptError,
                     MembershipError, PolicyError)
from .fusion import grouped_allreduce, grouped_allreduce_async
from .parallel import (DistributedOptimizer, broadcast_object_state, broadcast_optimizer_state,
                       broadcast_parameters)
from .sampler import ElasticSampler
from .runtime import World, WorldInfo, init, is_initialized, shutdown, world

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "world", "is_initialized", "World", "WorldInfo",
    "ReduceOp", "Handle", "MPICommunicator", "communicator",
    "allreduce", "allreduce_async", "broadcast", "broadcast_async",
    "allgather", "allgather_async", "barrier", "barrier_async",
    "grouped_allreduce", "grouped_allreduce_async",
    "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
    "broadcast_object_state", "ElasticSampler",
    "HpcAdaptError", "ConfigurationError", "CommunicationError", "MembershipError",
    "AllocationError", "PolicyError",
]
