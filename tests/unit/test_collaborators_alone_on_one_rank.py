"""Issue 45: the step runner, the resizing and the failures, each alone, on plain values: the
Job's parts (``loop.parts.JobParts``) as a plain object holding a real one-rank world (a
``World`` of ``MPI.COMM_SELF``: no launcher), a real ``DistributedOptimizer`` around the
user's SGD, a real loader and ``TrainingState``, a real ``Recorder``; the other collaborators
as the callables and protocols each is handed. No Job.

What needs several ranks (a real death, a grow's join) is tested by the multi-rank and fault
suites; here each collaborator's own decisions and what it returns."""

import logging
import time
from types import SimpleNamespace

import pytest
import torch

from collaborator_parts import BATCH, Assembly, loss_of as _loss
from hpcadapt.base.errors import ConfigurationError
from hpcadapt.comm.world import PeerFailure
from hpcadapt.elastic.membership import ResizeOutcome
from hpcadapt.loop.failures import Failures, Recovered
from hpcadapt.loop.phase import JobPhase
from hpcadapt.loop.resizing import ResizeDone, Resizing


def _run_step(runner, model, scale=1.0):
    """One synchronous step as the loop drives it: the runner's (micro-)batches, ``step``
    after each; returns (the outcomes, the batches, the step's global count)."""
    walk, outcomes, batches = runner.sync_step(), [], []
    try:
        batch = next(walk)
        while True:
            batches.append(batch)
            outcomes.append(runner.step(_loss(model, batch) * scale))
            batch = walk.send(None)
    except StopIteration as end:
        return outcomes, batches, end.value


def _reference_step(job, batches):
    """The same step by torch alone: SGD with momentum on the whole batch's mean loss."""
    model = job.start
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    sgd.zero_grad()
    _loss(model, (x, y)).backward()
    sgd.step()
    return model


# -- StepRunner ---------------------------------------------------------------------------
@pytest.mark.parametrize("micro", [None, 4], ids=["one-batch", "four-micro-batches"])
def test_a_step_trains_the_whole_batch_as_torch_would_and_commits_it(tmp_path, micro):
    job = Assembly(tmp_path, max_local_batch=micro)
    runner = job.runner()
    outcomes, batches, count = _run_step(runner, job.model)
    assert count == BATCH and sum(len(b[0]) for b in batches) == BATCH
    assert len(batches) == (1 if micro is None else BATCH // micro)
    assert [o.committed for o in outcomes] == [False] * (len(batches) - 1) + [True]
    assert all(o.failure is None for o in outcomes)
    st = job.parts.state
    assert (st.step, st.sampler.cursor) == (1, BATCH)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    with torch.no_grad():
        expected_loss = float(_loss(job.start, (x, y)))   # before the reference's step
    reference = _reference_step(job, batches)
    for mine, torchs in zip(job.model.parameters(), reference.parameters()):
        assert torch.allclose(mine, torchs, atol=1e-6)
    report = runner.report()
    assert report.count == BATCH and report.rate == pytest.approx(0.1)
    assert report.loss == pytest.approx(expected_loss, rel=1e-5)
    assert runner.nonfinite_run == 0 and not runner.open


def test_a_non_finite_loss_skips_the_update_and_counts_the_run(tmp_path):
    job = Assembly(tmp_path)
    runner = job.runner()
    before = [p.detach().clone() for p in job.model.parameters()]
    (outcome,), _, _ = _run_step(runner, job.model, scale=float("nan"))
    assert outcome.committed and runner.nonfinite_run == 1
    assert job.parts.state.step == 1   # the batch is passed over, not trained again
    for p, b in zip(job.model.parameters(), before):
        assert torch.equal(p, b)
    _run_step(runner, job.model)
    assert runner.nonfinite_run == 0


def test_a_policys_momentum_is_the_updates_and_the_users_optimizer_keeps_its_own(tmp_path):
    from hpcadapt.base.plan import Plan

    job = Assembly(tmp_path)
    runner = job.runner()
    _, first, _ = _run_step(runner, job.model)
    job.adaptation.apply_plan(Plan(version=0, step=1, momentum=0.5, reason="test"))
    _, second, _ = _run_step(runner, job.model)
    assert runner.report().used_settings["momentum"] == 0.5      # the metrics line's
    assert job.sgd.param_groups[0]["momentum"] == 0.9            # the user's, untouched
    model = job.start                 # torch alone: 0.9 for the first step, 0.5 after
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for batches, momentum in ((first, 0.9), (second, 0.5)):
        sgd.param_groups[0]["momentum"] = momentum
        sgd.zero_grad()
        _loss(model, (torch.cat([b[0] for b in batches]),
                      torch.cat([b[1] for b in batches]))).backward()
        sgd.step()
    for mine, torchs in zip(job.model.parameters(), model.parameters()):
        assert torch.allclose(mine, torchs, atol=1e-6)
    snap = job.monitoring.snapshot(runner.report(), max_workers=1, can_resize=False,
                                   resizing=False)
    assert snap.momentum == 0.5                                  # what the policies see


def test_roll_back_undoes_what_the_loop_body_changed_in_the_step_in_flight(tmp_path):
    job = Assembly(tmp_path, max_local_batch=8)
    runner = job.runner()
    walk = runner.sync_step()
    runner.step(_loss(job.model, next(walk)))     # the first of two micro-batches
    job.sgd.param_groups[0]["lr"] = 0.5           # the user's loop body, mid-step
    assert runner.roll_back() == 0                # the step it was at: nothing committed
    assert job.sgd.param_groups[0]["lr"] == 0.1
    runner.recovered(given_up=True)
    assert not runner.open
    job.sgd.param_groups[0]["lr"] = 0.7           # the body after the failed job.step
    runner.undo_user_code_of_given_up_step()
    assert job.sgd.param_groups[0]["lr"] == 0.1


def test_nothing_is_kept_to_undo_where_a_death_is_not_survived(tmp_path):
    job = Assembly(tmp_path, max_local_batch=8)
    runner = job.runner(recoverable=False)
    walk = runner.sync_step()
    runner.step(_loss(job.model, next(walk)))
    assert runner.in_flight is None


def test_the_stop_file_and_a_stop_signal_are_voted_on_with_the_steps_values(tmp_path):
    stop = tmp_path / "stop"
    job = Assembly(tmp_path, stop_file=str(stop))
    runner = job.runner(signals=SimpleNamespace(received=None))
    _run_step(runner, job.model)
    assert not runner.finish_requested and not runner.stop_requested
    stop.write_text("")
    runner.signals.received = "SIGTERM"
    _run_step(runner, job.model)
    assert runner.finish_requested and runner.stop_requested


def test_job_step_outside_a_batch_is_refused_in_one_line(tmp_path):
    job = Assembly(tmp_path)
    with pytest.raises(ConfigurationError, match="once per batch the loader yields"):
        job.runner().step(_loss(job.model, (torch.zeros(2, 4), torch.zeros(2).long())))


# -- Resizing -----------------------------------------------------------------------------
def _resizing(job, failures=None):
    def fail(exc):
        (failures if failures is not None else []).append(exc)
        raise SystemExit(75)

    return Resizing(job.parts, job.recorder, JobPhase(joining=False), fail=fail,
                    recovery_scope=lambda: pytest.fail("no recovery expected"),
                    join_dir=None, spawned_to_join=False, spare_of=None)


@pytest.mark.parametrize("options, line", [
    ({"max_workers": 2, "min_workers": 3}, "--min-workers 3 is above --max-workers 2"),
    ({"max_workers": 2, "warm_spares": -1}, "--warm-spares -1: give 0 or more"),
    ({"max_workers": 2, "initial_workers": 3}, "--initial-workers 3 is above --max-workers 2"),
    ({"max_workers": 4, "min_workers": 2}, "--min-workers 2 is above the 1 workers running"),
])
def test_the_worker_count_flags_are_refused_in_one_line(tmp_path, options, line):
    job = Assembly(tmp_path, allocator="local", **options)
    with pytest.raises(ConfigurationError, match=line):
        _resizing(job).setup_elastic()


def test_the_start_size_follows_the_checkpoint_the_flags_allow(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hpcadapt")
    plain = Assembly(tmp_path)
    plain.parts.state.world_size = 4        # as a checkpoint of 4 workers loads it
    assert _resizing(plain).start_size(resumed=True) == (0, "initial workers")
    assert "without --max-workers the job cannot grow back" in caplog.text
    assert _resizing(plain).start_size(resumed=False) == (0, "initial workers")
    launch = Assembly(tmp_path, max_workers=3, resume_size="launch", allocator="local")
    launch.parts.state.world_size = 4
    assert _resizing(launch).start_size(resumed=True) == (0, "initial workers")
    grows = Assembly(tmp_path, max_workers=3, allocator="local")
    grows.parts.state.world_size = 4
    resizing = _resizing(grows)
    resizing.setup_elastic()
    assert resizing.start_size(resumed=True) == (3, "resuming at the checkpoint's 4 workers")
    assert "growing back to 3 before the first step (--max-workers 3)" in caplog.text


def test_a_resize_without_an_allocator_is_refused_and_training_goes_on(tmp_path, caplog):
    job = Assembly(tmp_path)
    resizing = _resizing(job)
    assert resizing.request_resize(2, "test") is None
    assert "resize to 2 workers refused (test): no allocator" in caplog.text
    assert job.parts.world.size == 1 and resizing.resizes == []
    assert resizing.poll() is None and not resizing.may_grow()


@pytest.mark.parametrize("strategy, ok, compare", [
    ("ssgd", True, True), ("bounded-delay", True, True), ("local-sgd", True, False),
    ("ssgd", False, False)])
def test_a_completed_resize_comes_back_with_its_follow_ups(tmp_path, strategy, ok, compare):
    job = Assembly(tmp_path, strategy=strategy)
    resizing = _resizing(job)
    t0 = time.perf_counter()
    done = resizing.completed(ResizeOutcome(2, 1, "test", 0.0, ok), t0, t0)
    assert isinstance(done, ResizeDone) and done.compare_replicas is compare
    assert done.outcome.old_size == 2 and resizing.resizes == []   # recorded only once told
    resizing.record_done(done, identical=True if compare else None)
    (row,) = resizing.resizes
    assert (row["old_size"], row["new_size"], row["ok"]) == (2, 1, ok)
    assert row["pause_s"] >= 0 and row["decision_to_first_step_s"] >= 0
    (line,) = job.records("resize")
    assert line["world_size"] == 1 and line["batch_size"] == BATCH
    assert line["replicas_identical"] is (True if compare else None)
    assert line["lr"] == pytest.approx(0.1)


def test_a_joiners_view_of_its_join_is_not_recorded_in_the_metrics(tmp_path):
    job = Assembly(tmp_path)
    resizing = _resizing(job)
    resizing.record_done(resizing.completed(ResizeOutcome(-1, 1, "joined", 0.0, True)))
    assert resizing.resizes[0]["reason"] == "joined" and job.records("resize") == []


# -- Failures -----------------------------------------------------------------------------
class _Membership:
    """A recovery's view of the membership (``loop.failures.RecoveryMembership``)."""

    def __init__(self, may_grow=False):
        self.grows, self.calls = may_grow, []

    def may_grow(self):
        return self.grows

    def abandon_grow(self, why):
        self.calls.append(("abandon_grow", why))

    def released(self, dead):
        self.calls.append(("released", dead))

    def coordinator_may_move(self):
        return False

    def own_the_end(self):
        self.calls.append(("own_the_end",))


def _failures(job, membership, roll_back=lambda: 0):
    ended = []

    def fail(exc):
        ended.append(exc)
        raise SystemExit(75)

    return Failures(job.parts, job.recorder, job.adaptation.engine, fail, membership,
                    roll_back), ended


def test_a_death_is_survivable_with_peers_or_room_to_grow_and_on_failure_recover(tmp_path):
    alone = Assembly(tmp_path)
    assert not _failures(alone, _Membership(may_grow=False))[0].recoverable
    assert _failures(alone, _Membership(may_grow=True))[0].recoverable
    stop = Assembly(tmp_path, on_failure="stop")
    assert not _failures(stop, _Membership(may_grow=True))[0].recoverable


@pytest.mark.parametrize("options, exc", [
    ({"on_failure": "stop"}, PeerFailure("rank 1 died", rank=1, cause="dead")),
    ({}, PeerFailure("no word from rank 1 in 30 s", rank=1, cause="timeout")),
])
def test_a_failure_that_is_not_recovered_from_ends_the_job_through_fail(tmp_path, options,
                                                                           exc):
    job = Assembly(tmp_path, **options)
    membership = _Membership(may_grow=True)
    failures, ended = _failures(job, membership)
    with pytest.raises(SystemExit):
        failures.recover(exc, holds_state=True)
    assert ended == [exc] and membership.calls == [] and not failures.take_restart()


def test_a_recovery_rolls_back_reforms_the_world_records_and_asks_for_a_restart(tmp_path):
    job = Assembly(tmp_path)
    runner = job.runner()
    _run_step(runner, job.model)
    membership = _Membership(may_grow=True)
    failures, ended = _failures(job, membership, roll_back=runner.roll_back)
    before = job.parts.world.comm
    done = failures.recover(PeerFailure("a peer's notice", cause="notice"), holds_state=True)
    assert isinstance(done, Recovered) and ended == []
    assert (done.dead, done.old_size, done.new_size) == ((), 1, 1)
    assert job.parts.world.comm is not before            # the survivors' new world
    assert membership.calls == [("abandon_grow", "a worker died"), ("released", 0)]
    (line,) = job.records("failure")
    assert line["recovered"] and line["cause"] == "notice" and line["dead"] == []
    assert (line["step"], line["step_in_flight"], line["world_size"]) == (1, 1, 1)
    assert line["cluster_version"] == 1 and line["previous_cluster_version"] == 0
    assert failures.take_restart() and not failures.take_restart()   # read once
    _run_step(runner, job.model)        # training goes on in the new world
    assert job.parts.state.step == 2
