"""GPU data plane (``hpcadapt.cuda``): the device each rank trains on (``device``), NCCL
collectives over CuPy on a stream of their own (``nccl``, ``streams``), and CUDA tensors over
MPI through pinned host memory (``staged``) where NCCL cannot serve (no NCCL, or ranks sharing
a GPU).

``hpcadapt.parallel.dataplane`` picks among them for the optimizer; the host collectives themselves
refuse CUDA tensors with a clear error. The device-generic parts are tested on the CPU
(tests/unit/test_cuda_cpu.py, tests/mpi/test_cuda_staged_mpi.py); the GPU-only calls in
tests/e2e/test_cuda_gpu.py, which skips without a GPU (first run on an H200: docs/guides/gpus.md)."""

if __name__ == "cuda":
    # Imported as a top-level ``cuda``: Python started in the repository's root (``python -m
    # pytest``, ``python -m hpcadapt.train``) finds this folder first, and it would hide
    # NVIDIA's ``cuda`` namespace (``cuda.pathfinder``, ``cuda.bindings``: CuPy imports
    # them, and failed as "CuPy is not installed" on the GPU machine). Let those resolve.
    import pkgutil

    __path__ = pkgutil.extend_path(__path__, __name__)
