"""`benchmarks/run.py gpu` on a machine without a GPU: one line saying what is missing and
how to install it, a non-zero exit, no traceback (the benchmark itself runs where a GPU is).
``--device cpu`` is refused in one line everywhere."""

import subprocess
import sys

import pytest

from conftest import ROOT
from hpcadapt.cuda.device import gpu_problems


def _run(tmp_path, *flags):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "gpu",
                           "--json", str(tmp_path / "x.json"), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    return proc.returncode, out, [line for line in out.splitlines() if line.strip()]


@pytest.mark.skipif(not gpu_problems(), reason="a GPU with CuPy and NCCL is here")
def test_without_a_gpu_the_benchmark_says_what_is_missing_in_one_line(tmp_path):
    rc, out, lines = _run(tmp_path)
    assert rc != 0 and "Traceback" not in out, out[-2000:]
    assert len(lines) == 1, out
    assert "GPU" in lines[0] and "pip install" in lines[0], lines[0]
    assert not (tmp_path / "x.json").exists()


def test_the_cpu_is_refused_in_one_line(tmp_path):
    rc, out, lines = _run(tmp_path, "--device", "cpu")
    assert rc != 0 and "Traceback" not in out, out[-2000:]
    assert len(lines) == 1 and "--device cpu" in lines[0], out
    assert not (tmp_path / "x.json").exists()
