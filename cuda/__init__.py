"""GPU data plane (``hpcadapt.cuda``): the device each rank trains on (``device``), NCCL
collectives over CuPy on a stream of their own (``nccl``, ``streams``), and CUDA tensors over
MPI through pinned host memory (``staged``) where NCCL cannot serve (no NCCL, or ranks sharing
a GPU).

``hpcadapt.parallel.dataplane`` picks among them for the optimizer; the host collectives themselves
refuse CUDA tensors with a clear error. The device-generic parts are tested on the CPU
(tests/test_cuda_cpu.py, tests/test_cuda_staged_mpi.py); the GPU-only calls in
tests/test_cuda_gpu.py, which skips without a GPU and has not run on one yet."""
