"""The low-level API only (hpcadapt.init() and the collectives, no Job): rank 1 raises after
an allreduce while rank 0 goes on to the next one; the whole job must end, not hang."""

import numpy as np

import hpcadapt

world = hpcadapt.init()
values = np.ones(4)
hpcadapt.allreduce(values)
if world.rank == 1:
    raise RuntimeError("low-level user code failed on purpose on rank 1")
for _ in range(1000000):
    hpcadapt.allreduce(values)
