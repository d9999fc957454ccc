"""The Slurm test cluster (``cluster.py``, also run as ``slurm/testcluster/up`` and ``down``)
and a watcher that records what ``squeue`` and ``sinfo`` show while a job runs (tests and
the slurm-resize benchmark)."""
