"""The training state: everything a replica needs to continue training exactly where the job
stands (model, optimizer, data cursor, hyper-parameters, policy and monitor state, RNG, the
user's own state). One home for saving it to a checkpoint, loading it back, and syncing it
from rank 0 to other ranks after a resize or a resume."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import numbers
import os
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, Mapping, MutableMapping, Optional

import torch
from torch import nn

from hpcadapt.base.errors import ConfigurationError, on_every_rank
from hpcadapt.base.strategies import SSGD, Strategy

__all__ = ["HyperParams", "UserState", "TrainingState", "CHECKPOINT_FORMAT", "read_checkpoint"]

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 3
# A checkpoint file: one line of JSON (format, payload length and BLAKE2b digest), then the
# payload that torch.save wrote. The digest covers every tensor and value in it.
_MAGIC = "hpcadapt-checkpoint"
_HEADER_MAX = 4096


@dataclass
class HyperParams:
    """The hyper-parameters decisions change between steps. ``lr`` is the reference rate:
    every param group's rate moves by the same factor when it changes. ``momentum``: the
    momentum a policy decided, which the update uses in every param group that has one
    (SGD's); None until one does: the optimizer's own (yours, your scheduler's). ``ramp``
    is ``(start_step, steps, start_lr, end_lr)`` while a learning-rate ramp runs. Both are
    applied during the update only (``settings_applied``): the user's optimizer keeps its
    own values, the policies' are held here alone."""

    batch_size: int
    lr: float
    momentum: Optional[float]
    base_lr: float
    base_batch_size: int
    ramp: Optional[tuple] = None

    def lr_at(self, step: int) -> float:
        """The rate at ``step``, following the ramp (Lin et al.'s gamma_t) while it runs."""
        if self.ramp is None:
            return self.lr
        start, steps, start_lr, end_lr = self.ramp
        if steps <= 0 or step - start >= steps:
            return end_lr
        k = end_lr / start_lr
        return start_lr * (1.0 + max(0, step - start) / steps * (k - 1.0))


def _plain(value: Any) -> Any:
    if hasattr(value, "state_dict") and callable(value.state_dict):
        return value.state_dict()
    return value


class UserState(MutableMapping):
    """The user's own state that travels with the job: objects with ``state_dict`` and
    ``load_state_dict`` (modules, schedulers, EMA weights) are loaded in place; plain values
    (numbers, strings, tensors, lists and dicts of them) are replaced. Read and write it like
    a dict: ``job.state["seen"] += 1``."""

    def __init__(self, values: Optional[Mapping[str, Any]] = None):
        self._values: Dict[str, Any] = {}
        for key, value in (values or {}).items():
            self[key] = value

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise ConfigurationError(f"user state keys must be strings, got {key!r}")
        self._values[key] = value

    def __delitem__(self, key: str) -> None:
        del self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def check_serialisable(self) -> None:
        """ConfigurationError naming the first key that cannot travel (tensors and plain
        containers only: states are loaded with ``weights_only=True``, never as pickle)."""
        for key, value in self._values.items():
            buf = io.BytesIO()
            try:
                torch.save(_plain(value), buf)
                buf.seek(0)
                torch.load(buf, weights_only=True)
            except Exception as exc:  # torch raises several types for unsafe objects
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise on_every_rank(ConfigurationError(
                    f"user state {key!r} ({type(value).__name__}) cannot be saved or sent to "
                    f"other ranks: {first}. Use tensors, numbers, strings, lists and dicts of "
                    f"them, or an object with state_dict() and load_state_dict()")) from None

    def state_dict(self) -> Dict[str, Any]:
        return {key: _plain(value) for key, value in self._values.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = sorted(set(self._values) - set(state))
        extra = sorted(set(state) - set(self._values))
        if missing or extra:
            raise ConfigurationError(
                f"user state keys differ: this run has {sorted(self._values)}, the saved state "
                f"has {sorted(state)}")
        for key, value in state.items():
            mine = self._values[key]
            if hasattr(mine, "load_state_dict") and callable(mine.load_state_dict):
                mine.load_state_dict(value)
            else:
                self._values[key] = value


class TrainingState:
    """Where training stands, held by every rank and identical on all of them after each
    step boundary. ``optimizer`` is the wrapped (data-parallel) optimizer's inner one."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sampler,
                 hyper: HyperParams, gns, user: UserState, policies=None):
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.hyper = hyper
        self.gns = gns
        self.user = user
        self.policies = policies  # the engine (rank 0 decides with it), or None
        self.strategy: Strategy = SSGD()  # the synchronisation strategy
        self.topology = "flat"      # the gradients' allreduce topology (hpcadapt.comm.topology)
        self.step = 0
        # Whether the job has entered its epoch loop (its before_train hooks ran): a worker
        # that joins before that (--initial-workers) runs the hooks with everyone else.
        self.started = False
        # The number of workers training when this state was written (a resume grows back).
        self.world_size = 1
        self.last_accuracy = float("nan")
        # The settings training started with: a resume must start from the same ones.
        self.origin = {"lr": hyper.lr, "batch_size": hyper.batch_size,
                       "momentum": momentum_of(optimizer.param_groups[0])}
        # AdaScale's scale-invariant iterations: the sum of each committed step's gain.
        self.gain_steps = 0.0

    def global_batch_size(self) -> int:
        """The global batch now (the hyper-parameters' one value; what the loader reads)."""
        return self.hyper.batch_size

    def rate_factor(self, reference: Optional[float] = None) -> float:
        """How far the policies moved the rate: the reference rate now (or ``reference``)
        over the one training started with. It multiplies whatever rate the user's optimizer
        and scheduler hold, during the update only (see ``settings_applied``)."""
        return (self.hyper.lr if reference is None else reference) / self.origin["lr"]

    def applied_rate(self, user_rate: float, reference: Optional[float] = None) -> float:
        """The rate an update uses: the user's (``param_groups``, as their scheduler set it)
        times the policies' factor; what logs and plots call "lr"."""
        return user_rate * self.rate_factor(reference)

    def applied_momentum(self, user_momentum: float) -> float:
        """The momentum an update uses: a policy's decision, else the user's."""
        return user_momentum if self.hyper.momentum is None else self.hyper.momentum

    @property
    def epoch(self) -> int:
        """The epoch training is in: the sampler's (whose permutation it is), its one owner."""
        return self.sampler.epoch

    @property
    def samples_seen(self) -> int:
        """Samples trained on in committed steps, over all epochs (the global cursor)."""
        return self.epoch * self.sampler.num_samples + self.sampler.cursor

    @property
    def epoch_progress(self) -> float:
        """Training progress in epochs, as a float (2.5: half-way through the third)."""
        return self.samples_seen / self.sampler.num_samples

    @property
    def scale_invariant_steps(self) -> float:
        """The steps a run at the starting global batch would have taken for the samples
        seen so far (AdaptDL's progress)."""
        return self.samples_seen / self.origin["batch_size"]

    # -- its changes: every write of the training state goes through one of these ----------
    def start(self) -> bool:
        """The job enters its epoch loop; whether it had already (a resume, a join)."""
        started, self.started = self.started, True
        return started

    def next_epoch(self) -> None:
        """The epoch is done: the sampler starts the next one (the epoch is its)."""
        self.sampler.start_epoch(self.sampler.epoch + 1)

    def commit(self, samples: int, steps: int, adascale: bool) -> None:
        """``samples`` trained in ``steps`` committed steps (a round's hold equal shares):
        the cursor, the step counter and the scale-invariant progress move."""
        self.sampler.advance(samples)
        self.step += steps
        for _ in range(steps):
            self.count_gain(samples / steps, adascale)

    def set_hyper(self, hyper: HyperParams) -> None:
        """A plan's hyper-parameters (batch, rate, momentum, ramp), from the next step."""
        self.hyper = hyper

    def follow_ramp(self) -> None:
        """The reference rate of this step: a batch change's ramp moves it, and ends."""
        h = self.hyper
        if h.ramp is not None:
            h.lr = h.lr_at(self.step)
            if self.step - h.ramp[0] >= h.ramp[1]:
                h.ramp = None

    def switch_strategy(self, strategy: Strategy) -> None:
        self.strategy = strategy

    def switch_topology(self, topology: str) -> None:
        self.topology = topology

    def record_accuracy(self, accuracy: float) -> None:
        """The test accuracy the user logged: the policies see it, the summary shows it."""
        self.last_accuracy = float(accuracy)

    def count_gain(self, samples: int, adascale: bool) -> None:
        """Add a committed step's progress to ``gain_steps``: under the AdaScale rule its gain
        r (the rule's rate over its base rate: AdaScale's iterations advance by r), else
        the step's samples over the starting batch (the scale-invariant steps)."""
        h = self.hyper
        self.gain_steps += h.lr / h.base_lr if adascale else samples / self.origin["batch_size"]

    # -- plain part ------------------------------------------------------------------------
    def meta(self, cluster_version: int) -> Dict[str, Any]:
        """Everything but the model and optimizer, as tensors and plain values."""
        hyper = asdict(self.hyper)
        hyper["ramp"] = list(self.hyper.ramp) if self.hyper.ramp else None
        return {"step": self.step, "epoch": self.epoch, "hyper": hyper,
                "sampler": self.sampler.state_dict(), "gns": self.gns.state_dict(),
                "rng": torch.get_rng_state(), "version": cluster_version,
                "accuracy": self.last_accuracy,
                # Policies decide on rank 0 only; their state matters for a checkpoint.
                "policies": self.policies.state_dict() if self.policies is not None else {},
                "user": self.user.state_dict(), "origin": dict(self.origin),
                "strategy": self.strategy.to_dict(), "topology": self.topology,
                "started": self.started, "world_size": self.world_size,
                "gain_steps": self.gain_steps}

    def load_meta(self, meta: Mapping[str, Any]) -> None:
        self.step = int(meta["step"])  # the epoch comes with the sampler's state
        h = dict(meta["hyper"])
        h["ramp"] = tuple(h["ramp"]) if h.get("ramp") else None
        self.hyper = HyperParams(**h)
        self.sampler.load_state_dict(meta["sampler"])
        self.gns.load_state_dict(meta["gns"])
        torch.set_rng_state(meta["rng"])
        self.last_accuracy = float(meta["accuracy"])
        if self.policies is not None and meta.get("policies"):
            self.policies.load_state_dict(meta["policies"])
        self.user.load_state_dict(meta["user"])
        if meta.get("origin"):
            self.origin = dict(meta["origin"])
        self.gain_steps = float(meta.get("gain_steps", 0.0))
        if meta.get("strategy"):
            self.strategy = Strategy.from_dict(meta["strategy"])
        if meta.get("topology"):
            self.topology = str(meta["topology"])
        self.started = bool(meta.get("started", True))  # older checkpoints: a started job
        self.world_size = int(meta.get("world_size", 1))

    # -- sync ------------------------------------------------------------------------------
    def broadcast(self, view, *, is_root: bool, root: int = 0) -> int:
        """Make every rank of ``view`` (a communicator view) hold the state of rank
        ``root`` (``is_root`` on that one); returns the root's cluster version."""
        from hpcadapt.comm.tell import root_tells
        from hpcadapt.parallel.broadcasts import broadcast_optimizer_state, broadcast_parameters

        meta = root_tells(self.meta(view.version) if is_root else None, view, root=root,
                          what="the training state's broadcast")
        if not is_root:
            self.load_meta(meta)
        broadcast_parameters(list(self.model.parameters()) + list(self.model.buffers()),
                             root=root, world=view)
        broadcast_optimizer_state(self.optimizer, root=root, world=view)
        return int(meta["version"])

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, path: str, *, cluster_version: int, identity: Mapping[str, Any],
             world_size: Optional[int] = None) -> None:
        """Write the whole state to ``path`` atomically and durably: a private temporary file
        created exclusively in the same folder (never a predictable name that a planted
        symlink could redirect), fsync, a rename over ``path`` (a symlink there is replaced,
        not followed), then fsync of the folder. The header's digest covers the payload.
        ``world_size``: the workers training now (a resume grows back to them)."""
        if world_size is not None:
            self.world_size = world_size
        blob = {"format": CHECKPOINT_FORMAT, "identity": dict(identity),
                "meta": self.meta(cluster_version), "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict()}
        buf = io.BytesIO()
        torch.save(blob, buf)
        payload = buf.getvalue()
        header = json.dumps({"magic": _MAGIC, "format": CHECKPOINT_FORMAT,
                             "length": len(payload),
                             "blake2b": hashlib.blake2b(payload).hexdigest()}).encode() + b"\n"
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".hpcadapt-ckpt-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def load(self, path: str, *, identity: Mapping[str, Any]) -> None:
        """Read and check a checkpoint, then load it. ValueError saying what is wrong when
        it is damaged (digest), not an hpcadapt checkpoint, not this run's (identity, model,
        the settings training started with) or not plausible (cursor, step, non-finite
        weights); nothing is loaded then. Tensors and plain data only (``weights_only``)."""
        blob = read_checkpoint(path)
        theirs = blob.get("identity", {})
        for key, value in identity.items():
            if key in theirs and theirs[key] != value:
                raise ValueError(f"it was written for {key}={theirs[key]!r}, this run has "
                                 f"{key}={value!r}")
        self._check_model(blob["model"])
        self._check_meta(blob["meta"])
        self._check_optimizer(blob["optimizer"])
        self.model.load_state_dict(blob["model"])
        self.optimizer.load_state_dict(blob["optimizer"])
        self.load_meta(blob["meta"])

    def _check_meta(self, meta: Mapping[str, Any]) -> None:
        """Every field in range, else ValueError naming it and its value (a checksum proves
        integrity, not sense): counts whole and non-negative, bounded by the dataset where
        it bounds them, rates and statistics finite."""
        try:
            sampler, hyper = meta["sampler"], meta["hyper"]
            total = _whole("dataset size", sampler["num_samples"])
            origin = meta.get("origin") or {}
            gns = meta.get("gns") or {}
            if total != self.sampler.num_samples:
                raise ValueError(f"it was written for a dataset of {total} samples, this one "
                                 f"has {self.sampler.num_samples}")
            step, epoch = _whole("step", meta["step"]), _whole("epoch", meta["epoch"])
            cursor = _whole("data cursor", sampler["cursor"])
            if _whole("sampler epoch", sampler["epoch"]) != epoch:
                raise ValueError(f"its epoch {epoch} is not its sampler's {sampler['epoch']}")
            _whole("sampler seed", sampler["seed"], high=2 ** 64 - 1)
            _whole("sampler shuffle", sampler["shuffle"], high=1)
            _whole("cluster version", meta["version"])
            for key in ("batch_size", "base_batch_size"):
                _whole(key.replace("_", " "), hyper[key], low=1, high=total)
            for key in ("lr", "base_lr"):
                _finite(key, hyper[key], positive=True)
            if hyper["momentum"] is not None:   # None: the optimizer's own
                _finite("momentum", hyper["momentum"], low=0.0, high=1.0)
            if hyper.get("ramp") is not None:
                start, steps, start_lr, end_lr = hyper["ramp"]
                _whole("ramp start", start)
                _whole("ramp steps", steps)
                _finite("ramp start lr", start_lr, positive=True)
                _finite("ramp end lr", end_lr, positive=True)
            if not math.isnan(_number("accuracy", meta["accuracy"])):
                _finite("accuracy", meta["accuracy"], low=0.0, high=1.0)
            for key in ("g", "s", "weight", "gg", "ss", "gs", "weight_sq", "window"):
                if key in gns:
                    _finite(f"noise scale statistic {key}", gns[key])
            if "ema" in gns:
                _finite("noise scale ema", gns["ema"], positive=True, high=1.0)
            if "base_batch" in gns:
                _whole("noise scale base batch", gns["base_batch"])
            if "gain_steps" in meta:
                _finite("gain steps", meta["gain_steps"], low=0.0)
            if "lr" in origin:   # the policies' rate factor divides by it
                _finite("starting lr", origin["lr"], positive=True)
            if "momentum" in origin:
                _finite("starting momentum", origin["momentum"], low=0.0)
            if "batch_size" in origin:
                _whole("starting batch size", origin["batch_size"], low=1, high=total)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"its training state is incomplete ({exc!r})") from None
        if cursor > total:
            raise ValueError(f"its progress is impossible (epoch {epoch}, step {step}, cursor "
                             f"{cursor} of {total} samples)")
        for key, mine in self.origin.items():
            if key in origin and not math.isclose(float(origin[key]), float(mine),
                                                  rel_tol=1e-12):
                raise ValueError(f"training was started with {key} {origin[key]:g} there and "
                                 f"with {mine:g} here: resume with the settings it started "
                                 f"with, or remove the checkpoint to start afresh")

    @staticmethod
    def _check_optimizer(saved: Mapping[str, Any]) -> None:
        """The optimizer's state (momentum buffers, Adam's moments, step counts) and its
        groups' settings finite: NaN there resumed silently and trained NaN."""
        try:
            states, groups = saved["state"], saved["param_groups"]
            for index, entry in states.items():
                for key, value in entry.items():
                    _finite_values(f"optimizer state {key!r} of parameter {index}", value)
            for number, group in enumerate(groups):
                for key, value in group.items():
                    if key != "params":
                        _finite_values(f"optimizer group {number}'s {key!r}", value)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"its optimizer state is incomplete ({exc!r})") from None

    def _check_model(self, saved: Mapping[str, Any]) -> None:
        mine = self.model.state_dict()
        params = {n for n, _ in self.model.named_parameters()}
        for name in mine:
            if name not in saved:
                raise ValueError(f"its model has no {name!r} (this model's parameters: "
                                 f"{len(mine)}, the checkpoint's: {len(saved)})")
            if tuple(saved[name].shape) != tuple(mine[name].shape):
                raise ValueError(f"{name!r} has shape {tuple(saved[name].shape)} there and "
                                 f"{tuple(mine[name].shape)} in this model")
            if saved[name].is_floating_point() and not bool(torch.isfinite(saved[name]).all()):
                raise ValueError(f"its {name!r} holds NaN or infinite values")
            if name in params and saved[name].numel() and saved[name].is_floating_point():
                largest = float(saved[name].detach().abs().max())
                if largest > _WEIGHT_BOUND:
                    raise ValueError(f"its {name!r} holds a weight of {largest:.3g}, beyond "
                                     f"any trained model's ({_WEIGHT_BOUND:.0e}): the file is "
                                     f"damaged")
        extra = [n for n in saved if n not in mine]
        if extra:
            raise ValueError(f"it holds {extra[0]!r}, which this model does not have")


# A parameter this large is no trained model's (a damaged file that kept its checksum,
# written by a run that diverged): refused like an impossible step or cursor. Buffers are
# not bounded (a running variance of raw inputs can be large).
_WEIGHT_BOUND = 1e8
_MOST = 2 ** 62  # larger counts are not a real run's (and overflow where they are used)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"its {name} is {value!r}, not a number")
    return float(value)


def _whole(name: str, value: Any, *, low: int = 0, high: int = _MOST) -> int:
    """``value`` as a whole number in [low, high]; ValueError naming ``name`` otherwise."""
    v = _number(name, value)
    if not (math.isfinite(v) and v == int(v) and low <= int(v) <= high):
        raise ValueError(f"its {name} is {value!r} (a whole number in [{low}, {high}] "
                         f"expected)")
    return int(v)


def _finite(name: str, value: Any, *, low: Optional[float] = None,
            high: Optional[float] = None, positive: bool = False) -> float:
    """``value`` as a finite number (above 0 when ``positive``, within low/high)."""
    v = _number(name, value)
    if not (math.isfinite(v) and (not positive or v > 0) and (low is None or v >= low)
            and (high is None or v <= high)):
        raise ValueError(f"its {name} is {value!r}")
    return v


def _finite_values(name: str, value: Any) -> None:
    """Tensors and numbers (in tuples and lists) finite; other values are not checked."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex():
            if not bool(torch.isfinite(value).all()):
                raise ValueError(f"its {name} holds NaN or infinite values")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _finite_values(name, item)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not math.isfinite(float(value)):
            raise ValueError(f"its {name} is {value!r}")


def read_checkpoint(path: str) -> Dict[str, Any]:
    """The checked content of a checkpoint file; ValueError naming what is wrong (not one,
    truncated, damaged, another format)."""
    with open(path, "rb") as f:
        head = f.readline(_HEADER_MAX)
        try:
            header = json.loads(head)
            ok = isinstance(header, dict) and header.get("magic") == _MAGIC
        except ValueError:
            ok = False
        if not ok:
            raise ValueError("it is not an hpcadapt checkpoint (no header)")
        if header.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"it has format {header.get('format')!r}; this hpcadapt reads "
                             f"format {CHECKPOINT_FORMAT}")
        payload = f.read()
    if len(payload) != header.get("length"):
        raise ValueError(f"it is truncated or padded ({len(payload)} bytes of payload, the "
                         f"header says {header.get('length')})")
    if hashlib.blake2b(payload).hexdigest() != header.get("blake2b"):
        raise ValueError("it is damaged: its content does not match its checksum")
    try:
        blob = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"its payload cannot be read ({type(exc).__name__})") from None
    if not isinstance(blob, dict) or not {"meta", "model", "optimizer"} <= set(blob):
        raise ValueError("its payload is not a training state")
    return blob


def checkpoint_step(path: str) -> Optional[int]:
    """The step a readable checkpoint at ``path`` holds, or None."""
    if not os.path.exists(path):
        return None
    try:
        return int(read_checkpoint(path)["meta"]["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def reference_lr(group: Mapping[str, Any]) -> float:
    """A param group's reference rate: the ``initial_lr`` a torch scheduler records (a
    scheduler made before ``job.setup`` may have set the rate to its warm-up's 0 already),
    else its rate."""
    return float(group.get("initial_lr", group["lr"]))


@contextmanager
def settings_applied(optimizer: torch.optim.Optimizer, factor: float,
                     momentum: Optional[float] = None) -> Iterator[None]:
    """The policies' settings on the user's optimizer inside the block, then exactly what it
    held: every param group's rate times ``factor``, and ``momentum`` (a policy's; None:
    the groups' own) in every group that has one (SGD's; Adam's betas are left alone).

    AdaptDL's convention for scaling rules: the policies' factor applies on top of whatever
    the user's scheduler set, and the scheduler never sees it. A scheduler that writes the
    rate (LambdaLR, OneCycleLR) and one that reads it back to chain (CosineAnnealingLR,
    ExponentialLR) both keep their own arithmetic, so ``--lr-rule`` and a schedule compose;
    the policies' values live in the training state alone (one home each)."""
    groups = optimizer.param_groups
    saved = [g["lr"] for g in groups]
    # the groups whose momentum a policy's replaces, with the user's (restored after)
    own = [(g, g["momentum"]) for g in groups if "momentum" in g] if momentum is not None \
        else []
    if factor != 1.0:
        for g, lr in zip(groups, saved):
            g["lr"] = lr * factor
    for g, _ in own:
        g["momentum"] = momentum
    try:
        yield
    finally:
        for g, lr in zip(groups, saved):
            g["lr"] = lr
        for g, users in own:
            g["momentum"] = users


def optimizer_settings(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """What the optimizer itself holds (not hpcadapt's reference values): the first param
    group's ``lr``, ``momentum`` and ``betas`` (None where it has no such setting), and
    every group's rate under ``lr_groups`` when they differ (else None)."""
    groups = optimizer.param_groups
    first = groups[0]
    rates = [float(g["lr"]) for g in groups]
    return {"lr": rates[0],
            "momentum": float(first["momentum"]) if "momentum" in first else None,
            "betas": [float(b) for b in first["betas"]] if "betas" in first else None,
            "lr_groups": rates if len(set(rates)) > 1 else None}


def momentum_of(group: Mapping[str, Any]) -> float:
    if "momentum" in group:
        return float(group["momentum"])
    betas = group.get("betas")
    return float(betas[0]) if betas else 0.0
