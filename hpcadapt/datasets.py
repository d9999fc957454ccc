"""Built-in datasets, held in memory as tensors: real small data and synthetic data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import numpy as np
import torch

from .errors import ConfigurationError

__all__ = ["Dataset", "DATASETS", "load_dataset"]


@dataclass(frozen=True)
class Dataset:
    """Train and test splits as tensors; ``input_shape`` excludes the batch axis."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    input_shape: Tuple[int, ...]
    num_classes: int


def _digits(seed: int, **_) -> Dataset:
    """scikit-learn's handwritten digits (1,797 8x8 images), a stratified 80/20 split.

    Read straight from the CSV that scikit-learn ships, without importing scikit-learn
    (whose import pulls in SciPy and takes seconds): joining workers start faster."""
    import gzip
    import importlib.util
    import os

    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ConfigurationError("the digits dataset needs scikit-learn: pip install scikit-learn")
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    x = (table[:, :-1] / 16.0).reshape(-1, 1, 8, 8)
    y = table[:, -1].astype(np.int64)
    # A fixed split (not the run's seed), so every run evaluates on the same test set.
    rng = np.random.default_rng(0)
    test = np.zeros(len(y), dtype=bool)
    for c in range(10):
        members = rng.permutation(np.flatnonzero(y == c))
        test[members[: int(round(0.2 * len(members)))]] = True
    train_idx, test_idx = np.flatnonzero(~test), np.flatnonzero(test)
    # standardise each pixel with the training set's statistics
    mean = x[train_idx].mean(axis=0, keepdims=True)
    std = x[train_idx].std(axis=0, keepdims=True) + 0.1
    x = ((x - mean) / std).astype(np.float32)
    return Dataset("digits", torch.from_numpy(x[train_idx]), torch.from_numpy(y[train_idx]),
                   torch.from_numpy(x[test_idx]), torch.from_numpy(y[test_idx]), (1, 8, 8), 10)


def _synthetic(seed: int, *, num_samples: int = 4096, image_size: int = 32, **_) -> Dataset:
    """Random images labelled by a fixed random linear teacher: learnable, for throughput."""
    g = torch.Generator().manual_seed(1234)
    shape = (3, image_size, image_size)
    n_test = max(num_samples // 8, 64)
    x = torch.randn((num_samples + n_test,) + shape, generator=g)
    teacher = torch.randn(int(np.prod(shape)), 10, generator=g)
    y = (x.reshape(len(x), -1) @ teacher).argmax(dim=1)
    return Dataset("synthetic", x[:num_samples], y[:num_samples], x[num_samples:],
                   y[num_samples:], shape, 10)


DATASETS: Dict[str, Callable[..., Dataset]] = {"digits": _digits, "synthetic": _synthetic}


def load_dataset(name: str, *, seed: int = 0, **options) -> Dataset:
    """Load a built-in dataset by name; ConfigurationError lists the choices otherwise."""
    try:
        factory = DATASETS[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}") from None
    return factory(seed, **options)
