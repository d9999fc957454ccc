"""Slurm integration (``hpcadapt.slurm``): the job's allocation, an allocator that grows the
job by companion allocations and gives nodes back when it shrinks, the job scripts
(``train.sbatch``, ``bench.sbatch``) and a real test cluster (``testcluster/``).

Commands run from argument lists with validated values; their output goes through the pure
parsers in ``commands``."""

from .allocation import Allocation, in_slurm_job
from .slurm_allocator import SlurmAllocator
from .commands import SlurmCommandError, slurm_available

__all__ = ["Allocation", "SlurmAllocator", "SlurmCommandError", "in_slurm_job",
           "slurm_available"]
