"""`benchmarks/run.py strategies --quick`: the smoke run (2 ranks, 2 epochs) ends, prints its
table and writes JSON with the straggler ratio's key and a row for every run it makes
(ssgd without a slow rank, every strategy with the compute slow-down). Nothing is timed."""

import json
import subprocess
import sys

import pytest

from conftest import FULL, ROOT, reap_on_teardown

# make test runs the same command through make bench-quick (every benchmark's quick mode);
# these finer checks of its output run under make test-long.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not FULL, reason="make test-long (make bench-quick runs it)")]

RUNS = ["ssgd/none", "ssgd/compute", "sma/compute", "local-sgd/compute",
        "pair-avg/compute", "bounded-delay/compute", "sync-switch/compute", "straggler/compute",
        "straggler-async/compute"]


@pytest.mark.timeout(1260)  # nine trainings one after another, each MPI start-up included
def test_quick_run_writes_every_run_and_the_ratio(tmp_path):
    out = tmp_path / "strategies.json"
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "run.py"), "strategies",
                             "--quick", "--json", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    reap_on_teardown(proc)  # its whole session: the MPI jobs it starts go with it
    stdout, _ = proc.communicate(timeout=1200)
    assert proc.returncode == 0, stdout[-4000:]
    result = json.loads(out.read_text())
    assert result["benchmark"] == "strategies"
    assert "best_adaptive_vs_ssgd_time_to_target_straggler" in result["ratios"]
    assert sorted(result["rows"]) == sorted(RUNS)
    for label, row in result["rows"].items():
        # every run trained to the end: two epochs, a final accuracy and a step count
        assert row["final_accuracy"] is not None and 0 <= row["final_accuracy"] <= 1, label
        assert row["steps"] and row["steps"] > 0, (label, row)
        assert len(row["ended"]) == 1, (label, row)
    assert result["target_accuracy"] == pytest.approx(
        result["target_share"] * result["rows"]["ssgd/none"]["final_accuracy"])
    assert "target accuracy" in stdout and "straggler/compute" in stdout
    bd = result["rows"]["bounded-delay/compute"]["bounded_delay"]
    assert bd["applied_updates"] > 0 and "delays_applied" in bd
