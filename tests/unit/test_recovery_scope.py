"""The recovery scope (hpcadapt/job.py): with ``Job.step``, the only way into a recovery.
A peer's failure inside it is handed to the recovery once, with whether a step was given
up; anything else passes through; the code after it reads whether it recovered."""

import pytest

from hpcadapt.base.errors import ConfigurationError
from hpcadapt.comm.world import PeerFailure
from hpcadapt.loop.failures import RecoveryScope
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


class _NoSync:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _worker_runner():
    """A step runner on a job with only what a bounded-delay worker's job.step reads."""
    from types import SimpleNamespace

    import torch

    from hpcadapt.base import strategies
    from hpcadapt.base.options import JobOptions
    from hpcadapt.loop.recording import Recorder
    from hpcadapt.loop.steps import StepRunner

    parts = SimpleNamespace(  # the job's parts (loop.parts.JobParts) the step reads
        state=SimpleNamespace(strategy=strategies.strategy("bounded-delay")),
        optimizer=SimpleNamespace(no_sync=_NoSync),
        options=JobOptions())
    runner = StepRunner(parts, Recorder(), engine=None, signals=None, monitor=None,
                        follow_ramp=lambda: None, recoverable=lambda: False,
                        slot_ranks=lambda: 2, restart_pending=lambda: False)
    weight = torch.nn.Parameter(torch.ones(3))
    return runner, weight


def _one_batch(runner, send):
    runner.open_step(send)
    runner.micro_left, runner._micro_n, runner._micro_share = 1, 4, 1.0


def test_a_failed_send_of_a_bounded_delay_worker_gives_the_round_up_and_never_raises():
    """The aggregator dead (or the world revoked by a recovery elsewhere) while a worker
    computed: its job.step, in the user's code, returns the failure for Job.step to recover
    from instead of raising it there."""
    runner, weight = _worker_runner()
    failure = PeerFailure("rank 0 died", rank=0, cause="dead")

    def send(clip, loss_sum):
        raise failure

    _one_batch(runner, send)
    outcome = runner.step((weight * 2).sum())
    assert (outcome.committed, outcome.failure, outcome.given_up) == (False, failure, True)
    assert not runner.open and weight.grad is not None   # the batch was computed, not sent


def test_a_bounded_delay_workers_send_commits_and_other_errors_pass():
    runner, weight = _worker_runner()
    sent = []
    _one_batch(runner, lambda clip, loss_sum: sent.append(loss_sum))
    assert runner.step((weight * 2).sum()).committed and sent == [24.0]
    assert not runner.open

    def broken(clip, loss_sum):
        raise ValueError("a bug is not a peer's failure")

    _one_batch(runner, broken)
    with pytest.raises(ValueError):
        runner.step((weight * 2).sum())
    assert not runner.open
