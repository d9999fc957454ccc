"""GPU data plane (``hpcadapt.cuda``): NCCL collectives over CuPy.

Not built yet: no GPU was available to develop and verify it on. Until it exists, the host
collectives refuse CUDA tensors with a clear error instead of copying them silently."""
