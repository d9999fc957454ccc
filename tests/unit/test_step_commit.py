"""A step's commit (hpcadapt/state/rollback.py) with the weights kept, as a bounded-delay
round keeps them: what the round's updates changed goes back in place, for SGD with momentum
and for Adam, and state the optimizer created since is removed."""

import pytest
import torch

from hpcadapt.state.rollback import StepCommit
from hpcadapt.state.training import UserState


def _train(model, optimizer, steps):
    for i in range(steps):
        optimizer.zero_grad()
        model(torch.full((2, 3), float(i + 1))).sum().backward()
        optimizer.step()


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.AdamW(ps, lr=0.01),
], ids=["sgd-momentum", "adamw"])
def test_the_weights_and_the_optimizers_state_go_back_in_place(make):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = make(model.parameters())
    _train(model, optimizer, 2)
    before_params = [p.detach().clone() for p in model.parameters()]
    before_state = {i: {k: v.clone() if torch.is_tensor(v) else v
                        for k, v in optimizer.state[p].items()}
                    for i, p in enumerate(model.parameters())}
    held = next(iter(optimizer.state[model.weight].values()))   # a user's reference
    kept = StepCommit.take(7, UserState(), optimizer, model, user=False, weights=True,
                           optimizer_state=True)
    _train(model, optimizer, 3)
    assert not torch.equal(model.weight, before_params[0])
    kept.restore(UserState(), optimizer, model)
    for p, b in zip(model.parameters(), before_params):
        assert torch.equal(p, b)
    for i, p in enumerate(model.parameters()):
        state = optimizer.state[p]
        assert state.keys() == before_state[i].keys()
        for k, v in before_state[i].items():
            assert torch.equal(torch.as_tensor(state[k]), torch.as_tensor(v)), k
    assert next(iter(optimizer.state[model.weight].values())) is held


def test_state_created_after_the_commit_is_removed_and_a_plain_commit_keeps_no_weights():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kept = StepCommit.take(0, UserState(), optimizer, model, user=False, weights=True,
                           optimizer_state=True)
    _train(model, optimizer, 1)
    assert len(optimizer.state) == 2
    kept.restore(UserState(), optimizer, model)
    assert len(optimizer.state) == 0
    plain = StepCommit.take(0, UserState(), optimizer, model, user=False)
    assert plain.params is None and plain.optimizer_state is None
