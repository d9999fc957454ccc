"""The recovery scope (hpcadapt/job.py): with ``Job.step``, the only way into a recovery.
A peer's failure inside it is handed to the recovery once, with whether a step was given
up; anything else passes through; the code after it reads whether it recovered."""

import pytest

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.comm.world import PeerFailure
from hpcadapt.job import RecoveryScope
from hpcadapt.loop.steps import StepOutcome


def _scope():
    calls = []
    return RecoveryScope(lambda exc, step_given_up: calls.append((exc, step_given_up))), calls


def test_a_failure_inside_is_recovered_once_with_the_step_given_up_or_not():
    for given_up in (False, True):
        scope, calls = _scope()
        failure = PeerFailure("rank 1 died", rank=1, cause="dead")
        with scope:
            scope.step_given_up = given_up
            raise failure
        assert scope.recovered and calls == [(failure, given_up)]


def test_no_failure_no_recovery_and_other_errors_pass_through():
    scope, calls = _scope()
    with scope:
        pass
    assert not scope.recovered and calls == []
    scope, calls = _scope()
    with pytest.raises(ConfigurationError):
        with scope:
            raise ConfigurationError("a user's mistake is not a peer's failure")
    assert not scope.recovered and calls == []


def test_a_step_outcome_is_plain_data():
    done = StepOutcome(committed=True)
    assert (done.committed, done.failure, done.given_up) == (True, None, False)
    with pytest.raises(AttributeError):
        done.committed = False
