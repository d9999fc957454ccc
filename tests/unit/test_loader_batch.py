"""The loader's batch size is the job's, not a copy: a policy that changes the global batch
changes what ``loader.batch_size`` says (it was the starting value for the whole run)."""

import pytest
import torch

from hpcadapt import ConfigurationError, ElasticDataLoader


def test_batch_size_is_the_given_one_until_bound_then_the_jobs():
    data = torch.utils.data.TensorDataset(torch.zeros(100, 3), torch.zeros(100))
    loader = ElasticDataLoader(data, 16)
    assert loader.batch_size == 16
    job_batch = {"now": 16}
    loader.bind(lambda: iter(()), lambda: job_batch["now"])
    job_batch["now"] = 64  # what a policy's plan does to the training state
    assert loader.batch_size == 64


def test_an_unbound_loader_cannot_be_iterated():
    loader = ElasticDataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 1)), 2)
    with pytest.raises(ConfigurationError, match="job.setup"):
        iter(loader)
