"""``job.log_epoch(test_accuracy=..., ema_accuracy=...)``: the user's own epoch metrics are
kept in the metrics file, the summary and the plot (a user script on real MPI ranks), and a
value that is not a number, or a name the epoch line has already, is one clear line."""

import json
import math

import numpy as np
import pytest
import torch

from conftest import ROOT, run_mpi
from hpcadapt.base.errors import ConfigurationError
from hpcadapt.base.metrics import RESERVED_EPOCH_KEYS, user_metrics

SCRIPT = str(ROOT / "tests" / "scripts" / "user_metrics.py")


def test_numbers_of_every_kind_become_floats():
    got = user_metrics({"a": 1, "b": 0.5, "c": np.float32(1.5), "d": np.int64(7),
                        "e": torch.tensor(2.0), "f": np.array(3.0), "g": math.nan,
                        "h": -math.inf})
    assert got == {"a": 1.0, "b": 0.5, "c": 1.5, "d": 7.0, "e": 2.0, "f": 3.0,
                   "g": pytest.approx(math.nan, nan_ok=True), "h": -math.inf}
    assert all(type(v) is float for v in got.values())


@pytest.mark.parametrize("value,kind", [
    ("fine", "a str ('fine')"), ([0.5, 0.7], "a list ([0.5, 0.7])"), (None, "a NoneType (None)"),
    (True, "a bool (True)"), (torch.tensor([1.0, 2.0]), "a torch.Tensor (tensor([1., 2.]))"),
    (1 + 2j, "a complex ((1+2j))")])
def test_a_value_that_is_not_a_number_is_named_with_its_type(value, kind):
    with pytest.raises(ConfigurationError) as exc:
        user_metrics({"ema_accuracy": 0.5, "bad": value})
    assert str(exc.value) == (f"log_epoch: the metric 'bad' is {kind}, not a number; pass an "
                              f"int, a float or a 0-d tensor")


@pytest.mark.parametrize("name", ["loss", "step", "epoch_time_s", "time_s", "event"])
def test_a_name_of_the_epoch_lines_own_is_refused(name):
    assert name in RESERVED_EPOCH_KEYS
    with pytest.raises(ConfigurationError, match=f"the metric name '{name}' is a built-in "
                                                 f"field of the epoch record; rename it"):
        user_metrics({name: 0.25})


@pytest.mark.slow
def test_user_metrics_reach_the_file_the_summary_and_the_plot(tmp_path):
    metrics, summary = tmp_path / "m.jsonl", tmp_path / "s.json"
    run_mpi(2, [SCRIPT, "--epochs", "2", "--no-progress", "--metrics-file", str(metrics),
                "--summary-json", str(summary)], timeout=300)
    epochs = [json.loads(l) for l in metrics.read_text().splitlines()
              if '"event": "epoch"' in l]
    assert [(r["ema_accuracy"], r["grad_norm"], r["margin"], r["steps_seen"], r["nothing_yet"])
            for r in epochs] == [(0.25, 1.5, 2.0, 4.0, None), (0.375, 1.5, 3.0, 8.0, None)]
    assert all(r["test_accuracy"] == 0.5 and r["loss"] > 0 for r in epochs)  # built-ins intact
    assert json.loads(summary.read_text())["user_metrics"] == {
        "ema_accuracy": 0.375, "grad_norm": 1.5, "margin": 3.0, "steps_seen": 8.0,
        "nothing_yet": None}
    matplotlib = pytest.importorskip("matplotlib")
    from hpcadapt.plot import build_figure, load_metrics, main

    fig = build_figure({"run": load_metrics(str(metrics))}, ["ema_accuracy", "margin"])
    try:
        by_step = {}
        for ax in fig.axes:   # the left column: against steps
            by_step.setdefault(ax.get_gid(), ax)
        assert list(by_step["ema_accuracy"].lines[0].get_ydata()) == [0.25, 0.375]
        assert list(by_step["margin"].lines[0].get_xdata()) == [4, 8]
    finally:
        matplotlib.pyplot.close(fig)
    assert main([str(metrics), "-o", str(tmp_path / "m.png"), "--metric", "ema_accuracy"]) == 0


@pytest.mark.slow
def test_a_metric_that_is_not_a_number_ends_the_job_with_one_line():
    proc = run_mpi(2, [SCRIPT, "--case", "string", "--no-progress"], check=False, timeout=300)
    assert proc.returncode != 0
    line = ("hpcadapt: log_epoch: the metric 'note' is a str ('fine'), not a number; pass an "
            "int, a float or a 0-d tensor")
    assert f"[rank 0] {line}" in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_an_epoch_line_shows_what_the_script_logged_and_nothing_it_did_not():
    """A script that logs only its own metric gets no 'test accuracy nan' on its epoch
    lines."""
    proc = run_mpi(2, [SCRIPT, "--epochs", "1", "--own-only", "--no-progress"], timeout=300)
    lines = [line for line in proc.stderr.splitlines() if "epoch 0:" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "ema_accuracy 0.25" in lines[0] and "accuracy nan" not in lines[0], lines
    assert "test accuracy" not in lines[0], lines
