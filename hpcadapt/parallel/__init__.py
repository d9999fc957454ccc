"""The data plane: the distributed optimizer, pair averaging, bounded delay and the host or
NCCL collectives under them. Imports ``comm`` and ``base``."""
