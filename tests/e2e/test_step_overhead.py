"""Issue 44, counted where CI runs: on 202 small parameters and 2 real ranks, the aten
operations hpcadapt's data plane adds to a plain step, per parameter, are no more than
what torch DDP's reducer adds on the same model (gloo), and the data plane moves a tensor
to the host 0 times on an unmonitored step and once on a monitored one. The benchmark
``benchmarks/run.py step-overhead`` measures them; this runs its quick mode and reads its
JSON (counts, not times: they hold on any machine)."""

import json
import subprocess
import sys

from conftest import ROOT


def test_the_data_plane_adds_no_more_aten_ops_per_parameter_than_ddp_and_syncs_once(tmp_path):
    out = tmp_path / "step-overhead.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "step-overhead",
                           "--quick", "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    ratios, rows = result["ratios"], result["rows"]
    assert result["config"]["parameters"] == 202 and result["config"]["ranks"] == 2
    # DDP's reducer adds work for every parameter; a plain step is the common floor
    assert rows["torch_ddp"]["added_ops_per_param"] >= 1, rows
    assert 0 <= ratios["step_ops_per_param_vs_ddp"] <= 1, rows
    assert ratios["host_transfers_unmonitored_step"] == 0
    assert ratios["host_transfers_monitored_step"] == 1
