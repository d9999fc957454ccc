"""Monitoring and policies on real MPI ranks."""

import hashlib
import json

import numpy as np
import pytest
import torch

import hpcadapt
from hpcadapt.adapt.monitors import GradientNoiseScale, estimate_from_replicas
from hpcadapt.policies import GNSBatchSize, Schedule

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def w():
    return hpcadapt.init()


def test_bucket_statistics_give_the_closed_form_noise_scale(w):
    """Linear regression with known noise, gradients through the real optimizer."""
    d, sigma, b = 10, 1.5, 16
    rng = np.random.default_rng(100 + w.rank)
    delta = np.linspace(0.2, 0.6, d)
    d2 = float(delta @ delta)
    want = ((d + 1) * d2 + sigma ** 2 * d) / d2
    model = torch.nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(delta)[None])
    opt = hpcadapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                        model.named_parameters(), world=w, track_grad_norms=True)
    gns = GradientNoiseScale(ema=0.01)
    for _ in range(1500):
        x = torch.from_numpy(rng.standard_normal((b, d)))
        y = torch.from_numpy(rng.normal(0, sigma, b))  # w* = 0, so residual = delta.x - e
        opt.zero_grad()
        (0.5 * ((model(x).squeeze(1) - y) ** 2).mean()).backward()
        stats = opt.synchronize()
        gns.update(estimate_from_replicas(stats.local_sqnorm_mean, stats.global_sqnorm,
                                          w.size, b * w.size))
    assert gns.noise_scale == pytest.approx(want, rel=0.15)
    opt.remove_hooks()


def test_decisions_identical_on_every_rank(w, tmp_path_factory):
    from torch.utils.data import TensorDataset

    from hpcadapt.datasets import load_dataset
    from hpcadapt.models import build_model

    metrics = None
    if w.rank == 0:
        metrics = str(tmp_path_factory.mktemp("m") / "m.jsonl")
    job = hpcadapt.Job(policies=[GNSBatchSize(min=16, max=256, cooldown=10, interval=5, warmup=10),
                                 Schedule(unit="epoch", lr=[(2, 0.01)])],
                       lr_rule="linear", lr_ramp_steps=4, metrics_file=metrics)
    data = load_dataset("digits")
    model = build_model("mlp", data.input_shape, data.num_classes, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    loader = hpcadapt.ElasticDataLoader(TensorDataset(data.x_train, data.y_train), batch_size=16)
    job.setup(model, opt, loader)
    trace = []
    for _ in job.epochs(3):
        for x, y in loader:
            job.step(torch.nn.functional.cross_entropy(model(x), y))
            trace.append((job.state.step, job.state.hyper.batch_size,
                          round(opt.param_groups[0]["lr"], 12), len(x)))
    digest = int.from_bytes(hashlib.blake2b(repr([t[:3] for t in trace]).encode(),
                                            digest_size=7).digest(), "little")
    all_digests = hpcadapt.allgather(np.array([digest], dtype=np.int64)).reshape(-1)
    assert len(set(all_digests.tolist())) == 1, "ranks applied different configurations"
    assert len({bs for _, bs, _, _ in trace}) > 1, "the policy never changed the batch"
    assert job.replicas_identical()
    if w.rank == 0:
        job.recorder.close()
        rows = [json.loads(line) for line in open(metrics)]
        decisions = [r for r in rows if r["event"] == "decision"]
        assert any(r["policy"] == "gns-batch" and "noise_scale" in r["metrics"] for r in decisions)
        assert any(r["policy"] == "schedule" for r in decisions)
        assert any(r["policy"] == "lr-rule:linear" for r in decisions)
    job.optimizer.remove_hooks()
