"""Issue 45, one owner per value: the training state changes only through its own methods
(commit, next_epoch, set_hyper, follow_ramp, switch_strategy, switch_topology,
record_accuracy, start, save's world size). Each on plain values, no Job."""

import math

import pytest

import torch

from hpcadapt.adapt.monitors import GradientNoiseScale
from hpcadapt.base import strategies
from hpcadapt.data.sampler import ElasticSampler
from hpcadapt.state.training import HyperParams, TrainingState, UserState


def _state(samples=100, batch=10, lr=0.1):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    hyper = HyperParams(batch_size=batch, lr=lr, momentum=0.0, base_lr=lr,
                        base_batch_size=batch)
    return TrainingState(model, opt, ElasticSampler(samples, seed=0), hyper,
                         GradientNoiseScale(0.1, 0), UserState())


def test_commit_moves_the_cursor_the_step_and_the_progress_together():
    st = _state()
    st.commit(10, 1, adascale=False)
    st.commit(20, 2, adascale=False)      # a round: 2 steps of 10
    assert (st.step, st.sampler.cursor, st.samples_seen) == (3, 30, 30)
    assert st.gain_steps == st.scale_invariant_steps == 3.0


def test_next_epoch_starts_the_sampler_s_epoch_with_it():
    st = _state()
    st.commit(100, 10, adascale=False)
    assert st.sampler.epoch_done
    st.next_epoch()
    assert st.epoch == st.sampler.epoch == 1 and st.sampler.cursor == 0
    assert st.samples_seen == 100


def test_start_says_whether_the_loop_had_started():
    st = _state()
    assert st.start() is False and st.start() is True and st.started


def test_a_ramp_moves_the_reference_rate_and_ends():
    st = _state(samples=1000, lr=0.1)
    st.set_hyper(HyperParams(batch_size=20, lr=0.1, momentum=0.0, base_lr=0.1,
                             base_batch_size=10, ramp=(0, 4, 0.1, 0.2)))
    seen = []
    for _ in range(6):
        st.follow_ramp()
        seen.append(st.hyper.lr)
        st.commit(20, 1, adascale=False)
    assert seen[0] == 0.1 and math.isclose(seen[2], 0.15) and seen[4] == seen[5] == 0.2
    assert st.hyper.ramp is None and st.rate_factor() == 2.0


def test_switches_and_the_accuracy():
    st = _state()
    st.switch_strategy(strategies.strategy("local-sgd"))
    st.switch_topology("ring")
    st.record_accuracy(0.5)
    assert (st.strategy.name, st.topology, st.last_accuracy) == ("local-sgd", "ring", 0.5)


def test_save_records_the_world_size(tmp_path):
    st = _state()
    st.save(str(tmp_path / "c.pt"), cluster_version=0, identity={}, world_size=3)
    back = _state()
    back.load(str(tmp_path / "c.pt"), identity={})
    assert back.world_size == 3


def test_the_epoch_is_the_samplers_and_a_checkpoint_whose_two_disagree_is_refused(tmp_path):
    st = _state()
    st.sampler.load_state_dict(dict(st.sampler.state_dict(), epoch=4))  # a resume, say
    assert st.epoch == 4 and st.samples_seen == 400
    path = str(tmp_path / "c.ckpt")
    st.save(path, cluster_version=1, identity={})
    other = _state()
    other.load(path, identity={})
    assert other.epoch == other.sampler.epoch == 4
    meta = st.meta(1)
    meta["epoch"] = 3
    with pytest.raises(ValueError, match="epoch 3 is not its sampler's 4"):
        other._check_meta(meta)
