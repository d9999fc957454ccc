"""Slurm integration (``hpcadapt.slurm``): a Slurm allocator behind hpcadapt.allocator's
``Allocator`` protocol, job scripts and signals.

Not built yet. Fixed-size jobs run under ``srun --mpi=pmi2 python -m hpcadapt.train``;
resizing inside a Slurm job is untested."""
