"""Membership changes: joins (started, spawned or warm spares), leaves, the allocators that
find workers (local, Slurm) and the survivors' recovery. Imports ``comm`` and ``base``."""
