"""Issue 44: the gradient path waits for the device only where it must. The data plane's
host transfers of tensors (``.item()``, ``float()``, ``.cpu()``, ``.tolist()``), counted
while its hooks, bucket launches and ``synchronize`` run, on 2 real ranks: none on an
unmonitored step; one on a monitored step, in ``synchronize`` after backward (this rank's
squared norm and the averaged gradient's together), where there were two, one of them at
the last bucket's launch, inside backward."""

import json

from conftest import ROOT, run_mpi


def test_no_host_transfer_on_unmonitored_steps_and_one_on_monitored_ones(tmp_path):
    out = tmp_path / "steps.jsonl"
    run_mpi(2, [str(ROOT / "tests" / "scripts" / "count_transfers.py"), "--out", str(out),
                "--monitor", "gns", "--monitor-interval", "3", "--no-progress"], timeout=300)
    steps = [json.loads(line) for line in out.read_text().splitlines()]
    monitored = [s for s in steps if s["monitored"]]
    plain = [s for s in steps if not s["monitored"]]
    assert len(steps) == 16 and len(monitored) == 5, steps
    assert all(s["transfers"] == 0 for s in plain), plain
    assert all(s["calls"] == {"cpu": 1} for s in monitored), monitored
