"""The training state: everything a replica needs to continue training exactly where the job
stands (model, optimizer, data cursor, hyper-parameters, policy and monitor state, RNG, the
user's own state). One home for saving it to a checkpoint, loading it back, and syncing it
from rank 0 to other ranks after a resize or a resume."""

from __future__ import annotations

import io
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, Mapping, MutableMapping, Optional

import torch
from torch import nn

from .errors import ConfigurationError

__all__ = ["HyperParams", "UserState", "TrainingState", "CHECKPOINT_FORMAT"]

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 2


@dataclass
class HyperParams:
    """The hyper-parameters decisions change between steps. ``lr`` is the reference rate:
    every param group's rate moves by the same factor when it changes. ``ramp`` is
    ``(start_step, steps, start_lr, end_lr)`` while a learning-rate ramp runs."""

    batch_size: int
    lr: float
    momentum: float
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
                raise ConfigurationError(
                    f"user state {key!r} ({type(value).__name__}) cannot be saved or sent to "
                    f"other ranks: {first}. Use tensors, numbers, strings, lists and dicts of "
                    f"them, or an object with state_dict() and load_state_dict()") from None

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
        self.step = 0
        self.epoch = 0
        self.last_accuracy = float("nan")
        # The reference rate the param groups hold now (they move by lr / applied_lr).
        self.applied_lr = hyper.lr

    # -- plain part ------------------------------------------------------------------------
    def meta(self, cluster_version: int) -> Dict[str, Any]:
        """Everything but the model and optimizer, as tensors and plain values."""
        hyper = asdict(self.hyper)
        hyper["ramp"] = list(self.hyper.ramp) if self.hyper.ramp else None
        return {"step": self.step, "epoch": self.epoch, "hyper": hyper,
                "sampler": self.sampler.state_dict(), "gns": self.gns.state_dict(),
                "rng": torch.get_rng_state(), "version": cluster_version,
                "accuracy": self.last_accuracy, "applied_lr": self.applied_lr,
                # Policies decide on rank 0 only; their state matters for a checkpoint.
                "policies": self.policies.state_dict() if self.policies is not None else {},
                "user": self.user.state_dict()}

    def load_meta(self, meta: Mapping[str, Any]) -> None:
        self.step, self.epoch = int(meta["step"]), int(meta["epoch"])
        h = dict(meta["hyper"])
        h["ramp"] = tuple(h["ramp"]) if h.get("ramp") else None
        self.hyper = HyperParams(**h)
        self.sampler.load_state_dict(meta["sampler"])
        self.gns.load_state_dict(meta["gns"])
        torch.set_rng_state(meta["rng"])
        self.last_accuracy = float(meta["accuracy"])
        self.applied_lr = float(meta["applied_lr"])
        if self.policies is not None and meta.get("policies"):
            self.policies.load_state_dict(meta["policies"])
        self.user.load_state_dict(meta["user"])

    # -- sync ------------------------------------------------------------------------------
    def broadcast(self, view, *, is_root: bool) -> int:
        """Make every rank of ``view`` (a communicator view) hold the root's state;
        returns the root's cluster version."""
        from .parallel import (broadcast_object_state, broadcast_optimizer_state,
                               broadcast_parameters)

        meta = broadcast_object_state(self.meta(view.version) if is_root else None, world=view)
        if not is_root:
            self.load_meta(meta)
        broadcast_parameters(list(self.model.parameters()) + list(self.model.buffers()),
                             world=view)
        broadcast_optimizer_state(self.optimizer, world=view)
        return int(meta["version"])

    # -- checkpoints -----------------------------------------------------------------------
    def save(self, path: str, *, cluster_version: int, identity: Mapping[str, Any]) -> None:
        """Write the whole state to ``path`` atomically: a private temporary file in the
        same folder (never a predictable name that a planted symlink could redirect), then
        a rename."""
        blob = {"format": CHECKPOINT_FORMAT, "identity": dict(identity),
                "meta": self.meta(cluster_version), "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict()}
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".hpcadapt-ckpt-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(blob, f)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def load(self, path: str, *, identity: Mapping[str, Any]) -> None:
        """Read a checkpoint (tensors and plain data only: ``weights_only``); ValueError
        saying what differs when it is not this run's."""
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"it is not a readable hpcadapt checkpoint ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
        if not isinstance(blob, dict) or blob.get("format") != CHECKPOINT_FORMAT:
            raise ValueError("it is not an hpcadapt checkpoint of format "
                             f"{CHECKPOINT_FORMAT}")
        theirs = blob.get("identity", {})
        for key, value in identity.items():
            if key in theirs and theirs[key] != value:
                raise ValueError(f"it was written for {key}={theirs[key]!r}, this run has "
                                 f"{key}={value!r}")
        self._check_model(blob["model"])
        self.model.load_state_dict(blob["model"])
        self.optimizer.load_state_dict(blob["optimizer"])
        self.load_meta(blob["meta"])

    def _check_model(self, saved: Mapping[str, Any]) -> None:
        mine = self.model.state_dict()
        for name in mine:
            if name not in saved:
                raise ValueError(f"its model has no {name!r} (this model's parameters: "
                                 f"{len(mine)}, the checkpoint's: {len(saved)})")
            if tuple(saved[name].shape) != tuple(mine[name].shape):
                raise ValueError(f"{name!r} has shape {tuple(saved[name].shape)} there and "
                                 f"{tuple(mine[name].shape)} in this model")
        extra = [n for n in saved if n not in mine]
        if extra:
            raise ValueError(f"it holds {extra[0]!r}, which this model does not have")
