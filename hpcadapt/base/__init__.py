"""The bottom layer: errors, configuration, typed plans, strategies, metrics records and how a
process ends. Nothing here loads MPI or torch; every other layer may import it."""
