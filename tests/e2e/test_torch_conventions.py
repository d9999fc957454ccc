"""What a torch user relies on from a DataLoader holds for ElasticDataLoader (on 2 ranks):
see tests/scripts/torch_conventions.py."""

import json

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import hpcadapt
from conftest import ROOT, run_mpi

SCRIPT = str(ROOT / "tests" / "scripts" / "torch_conventions.py")


@pytest.mark.parametrize("n,batch", [(100, 16), (96, 16), (1437, 32), (5, 8)])
def test_len_is_torchs_len_for_the_same_data_and_batch(n, batch):
    data = TensorDataset(torch.zeros(n, 2))
    assert len(hpcadapt.ElasticDataLoader(data, batch)) == len(DataLoader(data, batch))


def test_len_follows_the_jobs_batch_once_bound():
    loader = hpcadapt.ElasticDataLoader(TensorDataset(torch.zeros(100, 2)), 16)
    loader.bind(lambda: iter(()), lambda: 50)
    assert (loader.batch_size, len(loader), loader.num_samples) == (50, 2, 100)


def test_a_standalone_sampler_starts_the_epoch_it_is_given():
    sampler = hpcadapt.ElasticSampler(10, seed=0)
    sampler.advance(4)
    sampler.set_epoch(3)
    assert (sampler.epoch, sampler.cursor) == (3, 0)


@pytest.mark.slow
def test_torchs_conventions_hold_on_two_ranks():
    proc = run_mpi(2, [SCRIPT, "--no-progress"], timeout=300)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')]
    assert len(rows) == 2, proc.stdout + proc.stderr[-3000:]
    for r in rows:
        assert r["len"] == [7, 7]                      # ceil(100 / 16), as torch
        # the OneCycleLR sized epochs * len(loader) ends exactly at the last step, at its
        # floor (max_lr / 25 / 1e4), with one scheduler step per training step
        assert r["steps"] == r["body"] == r["last_epoch"] == r["total"] == 14, r
        assert r["last_lr"] == pytest.approx(0.1 / 25 / 1e4), r
        assert r["samples"] == 200                     # the second iter went on, not over
        assert r["batch_size"] == 16                   # the global batch
        assert "sampler.set_epoch(7) in epoch 2: the job moves the epochs" in r["refusal"]
