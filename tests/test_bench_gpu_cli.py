"""`benchmarks/run.py gpu` on a machine without a GPU: one line saying what is missing and
how to install it, a non-zero exit, no traceback (the benchmark itself runs where a GPU is)."""

import subprocess
import sys

import pytest

from conftest import ROOT
from hpcadapt.cuda.device import gpu_problems


def _run(tmp_path, *flags):
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "gpu",
                           "--json", str(tmp_path / "gpu.json"), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not gpu_problems(), reason="a GPU with CuPy and NCCL is here")
def test_without_a_gpu_the_benchmark_says_what_is_missing_in_one_line(tmp_path):
    proc = _run(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out, out[-2000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert "GPU" in lines[0] and 'pip install "hpcadapt[cuda]"' in lines[0]
    assert not (tmp_path / "gpu.json").exists()


def test_the_cpu_is_refused_in_one_line(tmp_path):
    proc = _run(tmp_path, "--device", "cpu")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out
    assert len([line for line in out.splitlines() if line.strip()]) == 1, out
