"""Built-in datasets, held in memory as tensors: real small data and synthetic data."""

from __future__ import annotations

import logging
import os
import re
import stat
import zipfile
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch

from hpcadapt.base.errors import ConfigurationError

__all__ = ["Dataset", "DATASETS", "load_dataset", "default_cache_dir"]

log = logging.getLogger(__name__)


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


def default_cache_dir() -> str:
    """Where generated datasets are cached: ``~/.cache/hpcadapt`` (a private folder)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "hpcadapt")


# Bump when the cached arrays change meaning (split, dtype, post-processing).
_MNIST1D_FORMAT = 1
_MNIST1D_KEYS = ("x_train", "y_train", "x_test", "y_test")


def _mnist1d(seed: int, *, num_samples: int = 5000, cache_dir: Optional[str] = None,
             **_) -> Dataset:
    """MNIST-1D (Greydanus 2020): ten 1-D templates, padded, scaled, translated, sheared and
    made noisy, as sequences of 40 values; ``num_samples`` in all, 80% for training.

    Generated offline with the ``mnist1d`` package's ``make_dataset`` (seed 42 with 5,000
    samples is the published set; its pickle is never downloaded nor read). Generating 5,000
    takes 0.7 s and importing the package (SciPy, matplotlib) 0.9 s on an idle core, but about
    4 s on each of two ranks starting together on 2 cores, and 2.8 s for 20,000 alone, so the
    arrays are cached as ``.npz`` in ``cache_dir`` (default ``default_cache_dir()``), keyed by
    seed, size and package version: a hit loads in milliseconds without importing the package.
    Every rank generates or loads the same arrays for the same seed.

    Raises ConfigurationError for a bad seed or size, or without the package."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) \
            or not 0 <= seed < 2 ** 32:
        raise ConfigurationError(f"the mnist1d seed must be an integer in [0, 2**32), got {seed!r}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) \
            or num_samples < 10:
        raise ConfigurationError(
            f"mnist1d needs num_samples >= 10 (one per class), got {num_samples!r}")
    seed, num_samples = int(seed), int(num_samples)
    key = f"mnist1d-{_mnist1d_version()}-f{_MNIST1D_FORMAT}-seed{seed}-n{num_samples}.npz"
    folder = default_cache_dir() if cache_dir is None else os.fspath(cache_dir)
    arrays = _cache_load(folder, key, num_samples)
    if arrays is None:
        arrays = _mnist1d_generate(seed, num_samples)
        _cache_save(folder, key, arrays)
    t = {k: torch.from_numpy(v) for k, v in arrays.items()}
    return Dataset("mnist1d", t["x_train"], t["y_train"], t["x_test"], t["y_test"],
                   tuple(arrays["x_train"].shape[1:]), 10)


def _mnist1d_version() -> str:
    """The installed package's version (part of the cache key), without importing it."""
    from importlib import metadata

    try:
        version = metadata.version("mnist1d")
    except metadata.PackageNotFoundError:
        raise ConfigurationError(
            "the mnist1d dataset needs the mnist1d package: pip install mnist1d") from None
    return re.sub(r"[^A-Za-z0-9.]", "_", version)


def _mnist1d_generate(seed: int, num_samples: int) -> Dict[str, np.ndarray]:
    import random

    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as exc:
        raise ConfigurationError(
            f"the mnist1d dataset needs the mnist1d package ({exc}): pip install mnist1d") from None
    args = get_dataset_args()
    # make_dataset draws num_samples // 10 per class: ask for enough, then keep num_samples
    args.num_samples = -(-num_samples // 10) * 10
    args.seed = seed
    # make_dataset reseeds the global `random` and `np.random` generators: put them back.
    saved = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(args)
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
    # The package shuffles before it splits, so train + test is one shuffled sequence.
    x = np.concatenate([data["x"], data["x_test"]])[:num_samples]
    y = np.concatenate([data["y"], data["y_test"]])[:num_samples]
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(num_samples, 1, -1)
    y = np.ascontiguousarray(y, dtype=np.int64)
    n_train = int(num_samples * args.train_split)
    return {"x_train": x[:n_train], "y_train": y[:n_train],
            "x_test": x[n_train:], "y_test": y[n_train:]}


def _open_private_dir(folder: str) -> Optional[int]:
    """A descriptor of ``folder``, created with mode 0700 if missing; None (with a warning)
    when it is a symlink, not ours, or cannot be made: the cache is only a shortcut."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(folder)), exist_ok=True)
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        log.warning("dataset cache %s unusable (%s); generating in memory", folder, exc)
        return None
    st = os.fstat(fd)
    if st.st_uid != os.getuid():
        os.close(fd)
        log.warning("dataset cache %s belongs to uid %d, not to us; not using it",
                    folder, st.st_uid)
        return None
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)
    return fd


def _cache_load(folder: str, key: str, num_samples: int) -> Optional[Dict[str, np.ndarray]]:
    dir_fd = _open_private_dir(folder)
    if dir_fd is None:
        return None
    try:
        try:
            fd = os.open(key, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError("not a regular file")
            with np.load(f, allow_pickle=False) as z:
                arrays = {k: z[k] for k in _MNIST1D_KEYS}
        n_train, n_test = len(arrays["y_train"]), len(arrays["y_test"])
        if (n_train + n_test != num_samples or arrays["x_train"].dtype != np.float32
                or arrays["x_test"].dtype != np.float32 or arrays["y_train"].dtype != np.int64
                or arrays["y_test"].dtype != np.int64 or arrays["x_train"].shape[0] != n_train
                or arrays["x_test"].shape[0] != n_test
                or arrays["x_train"].shape[1:] != arrays["x_test"].shape[1:]):
            raise ValueError("unexpected shapes or dtypes")
        return arrays
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        log.warning("ignoring dataset cache %s/%s (%s); generating it again", folder, key, exc)
        return None
    finally:
        os.close(dir_fd)


def _cache_save(folder: str, key: str, arrays: Dict[str, np.ndarray]) -> None:
    """Write to a fresh file beside the target, then rename: readers (other ranks, other
    jobs) see the old file or the whole new one, never a part."""
    dir_fd = _open_private_dir(folder)
    if dir_fd is None:
        return
    tmp = f".{key}.{os.getpid()}.{os.urandom(6).hex()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                     dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, key, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
    except OSError as exc:
        log.warning("could not cache %s in %s (%s)", key, folder, exc)
    finally:
        os.close(dir_fd)


DATASETS: Dict[str, Callable[..., Dataset]] = {"digits": _digits, "synthetic": _synthetic,
                                               "mnist1d": _mnist1d}


def load_dataset(name: str, *, seed: int = 0, **options) -> Dataset:
    """Load a built-in dataset by name; ConfigurationError lists the choices otherwise."""
    try:
        factory = DATASETS[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}") from None
    return factory(seed, **options)
