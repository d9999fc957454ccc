"""What a step in flight may change before it commits, kept so that a recovery can undo it.

A peer's death inside a step gives that step up on every survivor: the optimizer has not
stepped and the data cursor has not moved, but the step's forward has moved the model's
buffers (BatchNorm statistics) and the random generator, and the user's own code around
``job.step`` may have moved what the job carries for them (a scheduler, an EMA, counters in
``job.extra``, the param groups' rates). A ``StepCommit`` holds all of that as it stood when
the step began; restoring it makes the redone step see exactly what an uninterrupted run
would (Horovod's ``State.restore``, for one step). Plain local variables of the user's loop
are not the job's to undo."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from torch import nn

__all__ = ["StepCommit"]


def _group_values(optimizer: torch.optim.Optimizer) -> List[Dict[str, Any]]:
    """Each param group's settings (lr, momentum, betas, ...), without the parameters."""
    return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            for g in optimizer.param_groups]


@dataclass
class StepCommit:
    """The state a step may change before it commits, as of the step's start."""

    step: int
    user: Optional[Dict[str, Any]]            # None: not kept (the user's code has not run)
    groups: Optional[List[Dict[str, Any]]]
    buffers: List[torch.Tensor]
    rng: torch.Tensor
    # Kept only where updates are applied before the commit (a bounded-delay round): the
    # parameters (every rank: workers load the aggregator's newer models), and the
    # optimizer's per-parameter state (the aggregator's: it steps many times in one round).
    params: Optional[List[torch.Tensor]] = None
    optimizer_state: Optional[List[Optional[Dict[str, Any]]]] = None

    @classmethod
    def take(cls, step: int, user_state, optimizer: torch.optim.Optimizer,
             model: nn.Module, *, user: bool = True, weights: bool = False,
             optimizer_state: bool = False) -> "StepCommit":
        """Copies, not references: the step goes on changing the originals. ``user=False``
        keeps only what the step itself changes (buffers, RNG), not what the user's code
        between batches may (the user's state, the param groups' settings); ``weights``
        keeps the parameters, ``optimizer_state`` the optimizer's state per parameter."""
        return cls(step=step, user=copy.deepcopy(user_state.state_dict()) if user else None,
                   groups=_group_values(optimizer) if user else None,
                   buffers=[b.detach().clone() for b in model.buffers()],
                   rng=torch.get_rng_state(),
                   params=[p.detach().clone() for p in model.parameters()] if weights
                   else None,
                   optimizer_state=_optimizer_state(optimizer) if optimizer_state else None)

    def restore(self, user_state, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        """Put everything back as it was when the step began (in place, so that references
        the user holds to the objects stay valid)."""
        if self.user is not None:
            user_state.load_state_dict(copy.deepcopy(self.user))
        if self.optimizer_state is not None:
            _restore_optimizer_state(optimizer, self.optimizer_state)
        if self.params is not None:
            with torch.no_grad():
                for param, saved in zip(model.parameters(), self.params):
                    param.copy_(saved)
        for group, values in zip(optimizer.param_groups, self.groups or []):
            group.update(copy.deepcopy(values))
        with torch.no_grad():
            for buf, saved in zip(model.buffers(), self.buffers):
                buf.copy_(saved)
        torch.set_rng_state(self.rng)


def _params(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _optimizer_state(optimizer: torch.optim.Optimizer) -> List[Optional[Dict[str, Any]]]:
    """Each parameter's optimizer state (momentum, Adam's moments, its step), copied."""
    return [{k: v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)
             for k, v in optimizer.state[p].items()} if p in optimizer.state else None
            for p in _params(optimizer)]


def _restore_optimizer_state(optimizer: torch.optim.Optimizer,
                             saved: List[Optional[Dict[str, Any]]]) -> None:
    """Each parameter's state as saved: tensors copied into the ones the optimizer holds
    (a reference to a momentum buffer stays valid), state created since removed."""
    for p, values in zip(_params(optimizer), saved):
        if values is None:
            optimizer.state.pop(p, None)
            continue
        now = optimizer.state[p]
        for key in [k for k in now if k not in values]:
            del now[key]
        for key, value in values.items():
            old = now.get(key)
            if torch.is_tensor(value) and torch.is_tensor(old) and old.shape == value.shape:
                with torch.no_grad():
                    old.copy_(value)
            else:
                now[key] = value.clone() if torch.is_tensor(value) else copy.deepcopy(value)
