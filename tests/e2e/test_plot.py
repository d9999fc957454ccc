"""hpcadapt.plot on metrics files written by real runs on MPI ranks: which panels the figure
has, what they are labelled, how resizes (done and not done) and decisions are drawn, and a
run that grows, loses a worker, is preempted and resumes, drawn as one story."""

import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import ROOT, run_mpi
from runs import Run, kill_a_joined_worker

pytestmark = pytest.mark.slow

matplotlib = pytest.importorskip("matplotlib")

from hpcadapt.plot import (RESIZE_FAILED, RESIZE_OK, build_figure,  # noqa: E402
                           load_metrics, prepare, summarize)

COMMON = ["-m", "hpcadapt.train", "--model", "mlp", "--dataset", "digits", "--epochs", "2",
          "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def elastic_rows(tmp_path_factory):
    """2 ranks: a grow to 3 that cannot complete (its joiner gets 10 ms to start), then a
    shrink to 1 that does; no gradient monitor runs."""
    path = tmp_path_factory.mktemp("plot") / "elastic.jsonl"
    run_mpi(2, COMMON + ["--max-workers", "3", "--join-timeout", "0.01",
                         "--policy", "resize-schedule", "--resize-schedule-steps", "2:3,4:1",
                         "--metrics-file", str(path)], timeout=600)
    return path, load_metrics(str(path))


@pytest.fixture(scope="module")
def gns_rows(tmp_path_factory):
    """2 ranks with gns-batch and the sqrt rule: batch and learning-rate decisions, the
    noise scale measured."""
    path = tmp_path_factory.mktemp("plot") / "gns.jsonl"
    run_mpi(2, COMMON + ["--batch-size", "16", "--policy", "gns-batch",
                         "--gns-batch-interval", "5", "--gns-batch-warmup", "5",
                         "--gns-batch-cooldown", "5", "--lr-rule", "sqrt",
                         "--metrics-file", str(path)], timeout=600)
    return path, load_metrics(str(path))


@pytest.fixture(scope="module")
def story_rows(tmp_path_factory):
    """2 ranks grow to 3; the joined worker is SIGKILLed and the job recovers on 2; SIGTERM
    to rank 0 stops it with the state saved (exit 75) in the middle of an epoch; the same
    command resumes it and finishes that epoch. One metrics file, two jobs."""
    tmp = tmp_path_factory.mktemp("story")
    run = Run(tmp, 2, ["--max-workers", "3", "--policy", "resize-schedule",
                       "--resize-schedule-steps", "3:3", "--threads", "1"], name="story")
    kill_a_joined_worker(run, 3)
    failure = run.wait_for("the recovery", lambda: [
        r for r in run.rows() if r.get("event") == "failure" and r.get("recovered")])[0]
    run.wait_for("a step after the recovery", lambda: [
        s for s in run.steps() if s["step"] > failure["step"] + 1])
    rank0 = [r for r in run.rows() if r.get("event") == "resize" and r["ok"]][-1]["pids"][0]
    os.kill(rank0, signal.SIGTERM)
    assert run.finish(timeout=300) == 75, run.stderr()[-4000:]
    stopped = json.loads([l for l in run.stdout.splitlines() if l.startswith("{")][-1])
    assert stopped["stopped"] == "SIGTERM" and run.checkpoint.exists()
    # the job script's requeue: the same command, told to end with the epoch it was in
    run_mpi(2, run.args + ["--epochs", str(stopped["epochs"] + 1)], timeout=600)
    return run.metrics, load_metrics(str(run.metrics)), stopped


def panels(fig):
    """gid -> [axes against steps, axes against wall time]."""
    out = {}
    for ax in fig.axes:
        if ax.get_gid():
            out.setdefault(ax.get_gid(), []).append(ax)
    return out


def texts(ax):
    return [t.get_text() for t in ax.texts]


def legend(ax):
    leg = ax.get_legend()
    return [t.get_text() for t in leg.get_texts()] if leg is not None else []


def with_gid(ax, prefix):
    return [a for a in ax.get_children() if (a.get_gid() or "").startswith(prefix)]


def test_elastic_run_draws_resizes_done_and_failed(elastic_rows):
    _, rows = elastic_rows
    resizes = [r for r in rows if r["event"] == "resize"]
    assert [(r["old_size"], r["new_size"], r["ok"]) for r in resizes] == [(2, 3, False),
                                                                          (2, 1, True)]
    fig = build_figure({"elastic": rows})
    try:
        p = panels(fig)
        # no monitor ran: no noise-scale panel, and no panel without data
        assert set(p) == {"loss", "test_accuracy", "world_size", "batch_size", "lr",
                          "samples_per_s"}
        for key, (by_step, by_time) in p.items():
            assert by_step.get_xlabel() == "step" and by_time.get_xlabel() == "wall time (s)"
            assert by_step.get_title() == by_time.get_title() != ""
            assert any(len(line.get_xdata()) for line in by_step.lines), key
        assert p["world_size"][0].get_title() == "workers (world size)"
        assert p["loss"][0].get_title().startswith("training loss")
        for ax in p["world_size"]:
            # the world-size line goes 2 -> 1 (the failed grow never changed it)
            sizes = {y for line in ax.lines if not (line.get_gid() or "").startswith(
                ("resize", "decision")) for y in line.get_ydata()}
            assert sizes == {1.0, 2.0}
            failed, done = with_gid(ax, "resize-failed"), with_gid(ax, "resize-ok")
            assert len(failed) == 1 and len(done) == 1
            assert failed[0].get_linestyle() == "--" and done[0].get_linestyle() == "-"
            assert failed[0].get_color() == RESIZE_FAILED["color"] != done[0].get_color()
            assert done[0].get_color() == RESIZE_OK["color"]
            assert {"2->3 failed", "2->1"} <= set(texts(ax))
            assert {"resize done", "resize NOT done", "decision: resize-schedule"} <= set(legend(ax))
            # the decisions are labelled with what they asked for, at the step they were made
            assert {"workers 3", "workers 1"} <= set(texts(ax))
            markers = with_gid(ax, "decision:resize-schedule")
            assert len(markers) == 2
        decided = [r["step"] for r in rows if r["event"] == "decision"]
        xs = sorted(m.get_xdata()[0] for m in with_gid(p["world_size"][0], "decision:"))
        assert xs == sorted(decided)
        # resizes are marked on the other panels too
        assert len(with_gid(p["loss"][1], "resize-failed")) == 1
        assert "1 NOT done" in summarize("elastic", rows)
    finally:
        matplotlib.pyplot.close(fig)


def test_adaptive_run_has_noise_scale_and_labelled_batch_decisions(gns_rows):
    _, rows = gns_rows
    fig = build_figure({"gns": rows})
    try:
        p = panels(fig)
        assert "noise_scale" in p and "world_size" in p
        for ax in p["batch_size"]:
            assert "decision: gns-batch" in legend(ax)
            labels = [t for t in texts(ax) if t.startswith("batch ")]
            assert labels and all(int(t.split()[1]) > 16 for t in labels)
            assert ax.get_yscale() == "log"
        for ax in p["lr"]:
            assert "decision: lr-rule:sqrt" in legend(ax)
            assert any(t.startswith("lr ") for t in texts(ax))
        # no resize: no resize lines anywhere
        assert not any(with_gid(ax, "resize") for ax in fig.axes)
        # the accuracy has points on both axes, at the epochs' steps and times
        epochs = [r for r in rows if r["event"] == "epoch"]
        by_step, by_time = p["test_accuracy"]
        assert list(by_step.lines[0].get_xdata()) == [r["step"] for r in epochs]
        assert list(by_time.lines[0].get_xdata()) == [r["time_s"] for r in epochs]
    finally:
        matplotlib.pyplot.close(fig)


def test_command_line_draws_several_files_on_one_figure(elastic_rows, gns_rows, tmp_path):
    (elastic, _), (gns, _) = elastic_rows, gns_rows
    out = tmp_path / "both.png"
    proc = subprocess.run([sys.executable, "-m", "hpcadapt.plot", f"elastic={elastic}",
                           f"gns={gns}", "-o", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("elastic: 2 epoch(s)") and lines[1].startswith("gns: 2 epoch(s)")
    assert lines[-1] == f"plot written to {out}"
    fig = build_figure({"elastic": load_metrics(str(elastic)), "gns": load_metrics(str(gns))})
    try:
        p = panels(fig)
        assert "noise_scale" in p  # one of the two files has it
        assert {"elastic", "gns"} <= set(legend(p["loss"][0]))
        colours = {line.get_color() for line in p["loss"][0].lines if line.get_label() in
                   ("elastic", "gns")}
        assert len(colours) == 2
    finally:
        matplotlib.pyplot.close(fig)


def test_a_file_without_steps_is_refused_with_a_message(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"event": "resize", "step": 3, "ok": False}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "hpcadapt.plot", str(empty), "-o",
                           str(tmp_path / "x.png")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "no step or epoch rows" in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "step"}\nnot json\n')
    proc = subprocess.run([sys.executable, "-m", "hpcadapt.plot", str(bad), "-o",
                           str(tmp_path / "x.png")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "bad.jsonl:2: not JSON" in proc.stderr


def test_grow_failure_preemption_and_resume_are_one_story(story_rows, tmp_path):
    path, rows, stopped = story_rows
    # what the file holds: two jobs' clocks, the stopped epoch logged by both
    times = [r["time_s"] for r in rows]
    assert times != sorted(times)
    cut = stopped["epochs"]
    assert [r["epoch"] for r in rows if r["event"] == "epoch"].count(cut) == 2
    story = prepare(rows)
    epochs = [r for r in story if r["event"] == "epoch"]
    assert [r["epoch"] for r in epochs] == list(range(cut + 1))
    assert epochs[-1]["step"] == max(r["step"] for r in rows if r["event"] == "epoch")
    walls = [r["wall_s"] for r in story if "wall_s" in r]
    assert walls == sorted(walls)
    assert [r["event"] for r in story if r["event"] in ("stop", "resume")] == ["stop", "resume"]
    fig = build_figure({"story": rows})
    try:
        p = panels(fig)
        for ax in p["world_size"]:
            for gid in ("resize-ok", "failure-recovered", "stop", "resume"):
                assert len(with_gid(ax, gid)) == 1, gid
            assert not with_gid(ax, "resize-failed") and not with_gid(ax, "failure-ended")
            labels = set(texts(ax))
            assert {"2->3", "rank 2 died: 3->2", "stop: SIGTERM"} <= labels, labels
            assert any(t.startswith("resume (") and t.endswith(" s away)") for t in labels)
            assert {"resize done", "failure, recovered", "stop (signal, preemption)",
                    "resume (band: time away)", "decision: resize-schedule"} <= set(legend(ax))
        by_step, by_time = p["world_size"]
        # the marks sit where the events happened: the stop at the stopped job's last step
        stop_x = with_gid(by_step, "stop")[0].get_xdata()[0]
        assert stop_x == stopped["steps"] == with_gid(by_step, "resume")[0].get_xdata()[0]
        assert len(with_gid(by_time, "gap:resume")) == 1 and not with_gid(by_step, "gap:resume")
        for ax in p["loss"] + p["test_accuracy"]:
            xs = list(ax.lines[0].get_xdata())
            assert xs == sorted(xs)                      # no zig-zag
        by_time_loss = list(p["loss"][1].lines[0].get_ydata())
        assert sum(1 for y in by_time_loss if y != y) == 1  # broken where the run was away
        assert len(p["test_accuracy"][0].lines[0].get_xdata()) == cut + 1  # one point an epoch
        header = fig._suptitle.get_text()
        assert header.startswith(f"story: {cut + 1} epoch(s), ")
        for part in ("workers 2 -> 3 -> 2", "1 resize(s), 1 failure(s) (1 recovered), "
                     "1 stop(s), 1 resume(s)"):
            assert part in header, header
        fig.savefig(tmp_path / "story.png", dpi=100)
    finally:
        matplotlib.pyplot.close(fig)
