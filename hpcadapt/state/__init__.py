"""Training state: what a checkpoint holds, how it is written and read, the per-step commit a
recovery rolls back to. Imports ``parallel``, ``comm`` and ``base``."""
