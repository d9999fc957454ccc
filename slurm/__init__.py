"""Slurm integration (``hpcadapt.slurm``)."""
