"""Slurm integration (``hpcadapt.slurm``): a Slurm allocator behind hpcadapt.allocator's
``Allocator`` protocol, job scripts and signals.

Not built yet. Jobs already run under ``srun --mpi=pmi2 python -m hpcadapt.train`` with the
local allocator (grows stay on the job's own nodes)."""
