"""Issue 45: each of the loop's collaborators works alone, on plain values: the Job's parts
(``loop.parts.JobParts``) as a plain object holding an options value, a one-rank world, a
real ``TrainingState`` and the user's optimizer; a real ``Recorder`` writing a metrics file;
the other collaborators as the callables and protocols each is handed. No Job, no MPI."""

import json
from types import SimpleNamespace

import pytest
import torch

from hpcadapt.adapt.control import StepReport
from hpcadapt.adapt.monitors import GradientNoiseScale
from hpcadapt.base.options import JobOptions
from hpcadapt.base.plan import Plan
from hpcadapt.data.sampler import ElasticSampler
from hpcadapt.loop.adaptation import Adaptation
from hpcadapt.loop.monitoring import Monitoring
from hpcadapt.loop.phase import JobPhase, Phase
from hpcadapt.loop.recording import Recorder
from hpcadapt.loop.stops import Stops
from hpcadapt.state.training import HyperParams, TrainingState, UserState, settings_applied


def _world(rank=0, size=1, version=3):
    """A one-rank world as the collaborators read it (its communicator's size and rank)."""
    comm = SimpleNamespace(Get_size=lambda: size, Get_rank=lambda: rank)
    return SimpleNamespace(rank=rank, size=size, cluster_version=version, comm=comm,
                           peers=[(r, 7, 1000 + r) for r in range(size)])  # (rank, node key, pid)


def _parts(tmp_path, **options):
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hyper = HyperParams(batch_size=16, lr=0.1, momentum=0.9, base_lr=0.1, base_batch_size=16)
    state = TrainingState(model, inner, ElasticSampler(160, seed=0), hyper,
                          GradientNoiseScale(0.1, 0), UserState())
    return SimpleNamespace(options=JobOptions.of(**options), world=_world(), state=state,
                           model=model,
                           optimizer=SimpleNamespace(optimizer=inner, data_plane="mpi",
                                                     param_groups=inner.param_groups),
                           loader=None, extra=state.user)


def _recorder(tmp_path):
    recorder = Recorder()
    recorder.open(str(tmp_path / "m.jsonl"), enabled=True, resuming=False)
    return recorder


def _records(tmp_path, event):
    recorder_file = tmp_path / "m.jsonl"
    return [r for r in map(json.loads, recorder_file.read_text().splitlines())
            if r.get("event") == event]


class _Membership:
    """The stops' view of the membership (``loop.stops.StopsMembership``), as plain values."""

    def __init__(self):
        self.released, self.synced = [], 0

    def owns_the_end(self):
        return True

    def sync_state(self):
        self.synced += 1

    def release_workers(self, *, failed=False):
        self.released.append(failed)


# -- Adaptation ---------------------------------------------------------------------------
def _adaptation(parts, recorder, resized):
    return Adaptation(parts, recorder, snapshot=lambda: None, check_replicas=lambda: None,
                      request_resize=lambda *a, **kw: resized.append((a, kw)))


def test_a_plan_changes_the_hyper_parameters_together_and_asks_for_its_resize(tmp_path):
    parts, resized = _parts(tmp_path), []
    adaptation = _adaptation(parts, _recorder(tmp_path), resized)
    adaptation.apply_plan(Plan(version=3, step=0, batch_size=32, momentum=0.5,
                               ramp=(0, 4, 0.1, 0.2), world_size=3, remove_rank=2,
                               reason="test"))
    h = parts.state.hyper
    assert (h.batch_size, h.momentum, h.ramp) == (32, 0.5, (0, 4, 0.1, 0.2))
    group = parts.optimizer.optimizer.param_groups[0]
    assert group["momentum"] == 0.9          # the user's stays the user's (one home each)
    with settings_applied(parts.optimizer.optimizer, parts.state.rate_factor(), h.momentum):
        assert group["momentum"] == 0.5      # the update's
    assert group["momentum"] == 0.9
    assert resized == [((3, "test"), {"remove": [2]})]
    for step in range(1, 5):      # the ramp moves the reference rate, step by step
        parts.state.step = step
        adaptation.follow_ramp()
    assert parts.state.hyper.lr == pytest.approx(0.2)


def test_a_plan_of_no_resize_leaves_the_world_and_hooks_wait_for_the_boundary(tmp_path):
    parts, resized = _parts(tmp_path), []
    adaptation = _adaptation(parts, _recorder(tmp_path), resized)
    adaptation.apply_plan(Plan(version=3, step=0, world_size=1))   # the size it has
    assert resized == [] and parts.state.hyper.batch_size == 16
    adaptation.queue_hook("on_resize", old_size=2)
    assert adaptation.take_queued_hooks() == [("on_resize", {"old_size": 2})]
    assert adaptation.take_queued_hooks() == []


# -- Stops --------------------------------------------------------------------------------
def test_divergence_stops_without_saving_and_asks_for_no_requeue(tmp_path):
    ckpt = tmp_path / "c.ckpt"
    parts, phase = _parts(tmp_path, checkpoint=str(ckpt)), JobPhase(joining=False)
    stops = Stops(parts, _recorder(tmp_path), phase, _Membership())
    stops.stop_for_divergence(5)
    assert phase.phase is Phase.STOPPED and not phase.saved and not stops.requeue
    assert phase.stopped == "5 steps with a non-finite loss; state NOT saved"
    assert not ckpt.exists()
    (stop,) = _records(tmp_path, "stop")
    assert stop["saved"] is False and stop["requeue"] is False


def test_a_stop_signal_saves_the_state_and_the_saved_file_resumes(tmp_path):
    ckpt = tmp_path / "c.ckpt"
    parts, phase = _parts(tmp_path, checkpoint=str(ckpt)), JobPhase(joining=False)
    parts.state.commit(48, 3, adascale=False)
    stops = Stops(parts, _recorder(tmp_path), phase, _Membership(),
                  signals=SimpleNamespace(received="SIGUSR1"))
    stops.stop_for_signal()
    assert phase.stopped == "SIGUSR1" and phase.saved
    (stop,) = _records(tmp_path, "stop")
    assert stop["signal"] == "SIGUSR1" and stop["saved"] and stop["checkpoint"] == str(ckpt)
    other = _parts(tmp_path)
    other.state.load(str(ckpt), identity={})
    assert (other.state.step, other.state.sampler.cursor) == (3, 48)


def test_a_stop_without_a_checkpoint_is_not_saved_and_the_stop_file_finishes(tmp_path):
    parts, phase = _parts(tmp_path), JobPhase(joining=False)
    stops = Stops(parts, _recorder(tmp_path), phase, _Membership(),
                  signals=SimpleNamespace(received="SIGTERM"))
    stops.stop_for_signal()
    assert phase.stopped == "SIGTERM; state NOT saved"
    finished = JobPhase(joining=False)
    Stops(parts, _recorder(tmp_path), finished, _Membership()).finish_by_stop_file()
    assert finished.phase is Phase.FINISHED and finished.over and finished.stopped is None


# -- Monitoring ---------------------------------------------------------------------------
def test_the_snapshot_is_the_last_steps_report_and_the_state_as_values(tmp_path):
    parts = _parts(tmp_path, max_local_batch=8)
    parts.state.commit(32, 2, adascale=False)
    monitoring = Monitoring(parts, _recorder(tmp_path), _adaptation(
        parts, _recorder(tmp_path), []).engine)
    report = StepReport(loss=1.5, count=16, step_time=0.5, times=None, monitored=False,
                        used_settings={"lr": 0.1, "momentum": 0.9}, rate=0.1)
    snap = monitoring.snapshot(report, max_workers=4, can_resize=True, resizing=False)
    assert (snap.step, snap.world_size, snap.batch_size, snap.loss) == (2, 1, 16, 1.5)
    assert snap.samples_per_s == pytest.approx(32.0) and snap.samples_seen == 32
    assert (snap.max_workers, snap.can_resize, snap.max_local_batch) == (4, True, 8)
    assert snap.cluster_version == 3 and snap.strategy == "ssgd" and snap.nodes == 1
    assert snap.schedule_lr == pytest.approx(0.1)   # the user's optimizer's rate
