"""Checkpoints are trusted only when they check out: written atomically without following a
symlink, versioned, checksummed, and on reading refused with one line saying what is wrong
(damage, another format, pickle, impossible progress, non-finite weights, other settings)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from hpcadapt.adapt.monitors import GradientNoiseScale
from hpcadapt.data.sampler import ElasticSampler
from hpcadapt.state.training import HyperParams, TrainingState, UserState, read_checkpoint


def make_state(lr: float = 0.1, batch: int = 16, width: int = 4) -> TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    hyper = HyperParams(batch_size=batch, lr=lr, momentum=0.9, base_lr=lr, base_batch_size=batch)
    return TrainingState(model, opt, ElasticSampler(100), hyper, GradientNoiseScale(),
                         UserState({"count": 3}))


def saved(tmp_path, state=None, name="c.ckpt"):
    state = state or make_state()
    state.step = 7
    state.sampler.set_epoch(1)  # the state's epoch is its sampler's
    state.sampler.advance(48)
    path = tmp_path / name
    state.save(str(path), cluster_version=2, identity={"model": "lin"})
    return path


def load(path, state=None):
    (state or make_state()).load(str(path), identity={"model": "lin"})


def test_a_saved_state_loads_back_whole(tmp_path):
    path = saved(tmp_path)
    other = make_state()
    with torch.no_grad():
        other.model.weight.zero_()
    load(path, other)
    assert other.step == 7 and other.epoch == 1 and other.sampler.cursor == 48
    assert torch.equal(other.model.weight, make_state().model.weight)
    assert other.user["count"] == 3
    assert os.stat(path).st_mode & 0o077 == 0  # private, as mkstemp makes it
    assert [p for p in os.listdir(tmp_path) if p.startswith(".hpcadapt-ckpt-")] == []


def test_a_symlink_at_the_path_is_replaced_not_followed(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me")
    (tmp_path / "c.ckpt").symlink_to(target)
    path = saved(tmp_path)
    assert target.read_text() == "keep me" and not path.is_symlink()
    load(path)


@pytest.mark.parametrize("damage,message", [
    ("flip", "it is damaged: its content does not match its checksum"),
    ("truncate", "it is truncated or padded"),
    ("random", "it is not an hpcadapt checkpoint (no header)"),
    ("pickle", "it is not an hpcadapt checkpoint (no header)"),
    ("old-format", "it is not an hpcadapt checkpoint (no header)"),
])
def test_damaged_or_foreign_files_are_refused_by_name(tmp_path, damage, message):
    path = saved(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x01  # one bit inside a tensor
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-10]))
    elif damage == "random":
        path.write_bytes(os.urandom(4096))
    elif damage == "pickle":
        path.write_bytes(pickle.dumps([1, 2, 3]))
    else:
        torch.save({"format": 2, "meta": {}, "model": {}, "optimizer": {}}, str(path))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(path)


def _rewrite(tmp_path, edit):
    """A checkpoint whose content was changed and then checksummed again (a checksum
    proves integrity, not sense: these must be refused on their content)."""
    state = make_state()
    edit(state)
    return saved(tmp_path, state)


def test_impossible_progress_is_refused(tmp_path):
    path = saved(tmp_path)
    blob = read_checkpoint(str(path))
    blob["meta"]["sampler"]["cursor"] = 10 ** 9
    state = make_state()
    with pytest.raises(ValueError, match="its progress is impossible .*cursor 1000000000 of 100"):
        state._check_meta(blob["meta"])


def test_non_finite_weights_are_refused(tmp_path):
    def poison(state):
        with torch.no_grad():
            state.model.weight[0, 0] = float("nan")
    path = _rewrite(tmp_path, poison)
    with pytest.raises(ValueError, match="its 'weight' holds NaN or infinite values"):
        load(path)


def test_an_absurd_weight_with_a_valid_checksum_is_refused(tmp_path):
    """A weight of 3.7e37 is finite, yet no trained model's: resuming it diverges on every
    retry, so it is refused by name like an impossible step."""
    def poison(state):
        with torch.no_grad():
            state.model.weight[1, 2] = 3.7e37
    path = _rewrite(tmp_path, poison)
    with pytest.raises(ValueError, match="its 'weight' holds a weight of 3.7e\\+37, beyond"):
        load(path)


def test_a_resume_with_other_starting_settings_is_refused(tmp_path):
    path = saved(tmp_path, make_state(lr=0.1))
    with pytest.raises(ValueError, match="started with lr 0.1 there and with 0.2 here"):
        load(path, make_state(lr=0.2))
    with pytest.raises(ValueError, match="started with batch_size 16 there and with 32 here"):
        load(path, make_state(batch=32))


def test_another_model_is_refused_with_what_differs(tmp_path):
    path = saved(tmp_path)
    with pytest.raises(ValueError, match=r"'weight' has shape \(2, 4\) there and \(2, 6\)"):
        load(path, make_state(width=6))



def _forged(tmp_path, edit):
    """A saved checkpoint whose content ``edit(blob)`` changed, written again with a valid
    header and digest (what a buggy writer or a hand-edited file looks like)."""
    import hashlib
    import io
    import json

    path = saved(tmp_path)
    blob = read_checkpoint(str(path))
    edit(blob)
    buf = io.BytesIO()
    torch.save(blob, buf)
    payload = buf.getvalue()
    header = {"magic": "hpcadapt-checkpoint", "format": 3, "length": len(payload),
              "blake2b": hashlib.blake2b(payload).hexdigest()}
    path.write_bytes(json.dumps(header).encode() + b"\n" + payload)
    return path


def _set(*keys, value):
    def edit(blob):
        here = blob
        for key in keys[:-1]:
            here = here[key]
        here[keys[-1]] = value
    return edit


def _nan_momentum_buffer(blob):
    state = blob["optimizer"]["state"]
    state[0] = {"momentum_buffer": torch.full((2, 4), float("nan"))}


@pytest.mark.parametrize("edit,message", [
    (_set("meta", "step", value=float("inf")), "its step is inf"),
    (_set("meta", "epoch", value=-1), "its epoch is -1"),
    (_set("meta", "sampler", "cursor", value=float("inf")), "its data cursor is inf"),
    (_set("meta", "sampler", "cursor", value=2.5), "its data cursor is 2.5"),
    (_set("meta", "hyper", "batch_size", value=10 ** 12), "its batch size is 1000000000000"),
    (_set("meta", "hyper", "lr", value=float("nan")), "its lr is nan"),
    (_set("meta", "hyper", "momentum", value=float("-inf")), "its momentum is -inf"),
    (_set("meta", "origin", "lr", value=0.0), "its starting lr is 0.0"),
    (_set("meta", "accuracy", value=7.0), "its accuracy is 7.0"),
    (_set("meta", "gns", "g", value=float("inf")), "its noise scale statistic g is inf"),
    (_set("meta", "version", value="two"), "its cluster version is 'two', not a number"),
    (_nan_momentum_buffer, "its optimizer state 'momentum_buffer' of parameter 0 holds NaN"),
    (_set("optimizer", "param_groups", 0, "lr", value=float("nan")),
     "its optimizer group 0's 'lr' is nan"),
])
def test_every_field_out_of_range_is_refused_in_one_line_naming_it(tmp_path, edit, message):
    """Behind a valid digest: an infinite step used to end in an OverflowError traceback,
    NaN optimizer state and a batch of 10**12 to resume silently."""
    path = _forged(tmp_path, edit)
    with pytest.raises(ValueError) as exc:
        load(path)
    assert message in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_a_forged_but_sane_checkpoint_still_loads(tmp_path):
    """The forging helper itself changes nothing that matters: the checks are the refusal."""
    load(_forged(tmp_path, lambda blob: None))
