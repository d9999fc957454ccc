"""BatchNorm's running statistics kept consistent across ranks, through a 3 -> 2 shrink, on
real MPI ranks training a real model (issue 23: they drifted apart and --check-replicas,
comparing parameters only, said the replicas were identical)."""

import json

import pytest

from conftest import ROOT, run_mpi

SCRIPT = ROOT / "tests" / "scripts" / "bn_buffers.py"


def _train(tmp_path, flags):
    """3 ranks shrunk to 2 at step 4, 14 steps; what each rank ends with."""
    run_mpi(3, [str(SCRIPT), "--out", str(tmp_path), "--no-progress", "--max-workers", "3",
                "--policy", "resize-schedule", "--resize-schedule-steps", "4:2",
                "--max-steps", "14"] + flags, timeout=300)
    ends = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert [(e["rank"], e["size"], e["steps"]) for e in ends] == [(0, 2, 14), (1, 2, 14)]
    assert ends[0]["params"] == ends[1]["params"]  # S-SGD: the parameters are one anyway
    return ends


def test_buffers_end_bit_identical_on_every_rank_by_default(tmp_path):
    ends = _train(tmp_path, [])
    assert ends[0]["buffers"] == ends[1]["buffers"]
    assert all(e["num_batches_tracked"] == [14, 14, 14] for e in ends)
    assert all(e["replicas_identical"] is True for e in ends)


def test_without_the_broadcast_the_buffers_differ_and_the_replicas_are_not_identical(tmp_path):
    """The parameters are identical and only the running statistics differ: the digest
    that --check-replicas and job.replicas_identical() compare sees them."""
    ends = _train(tmp_path, ["--no-broadcast-buffers"])
    assert ends[0]["buffers"] != ends[1]["buffers"]
    assert all(e["replicas_identical"] is False for e in ends)
