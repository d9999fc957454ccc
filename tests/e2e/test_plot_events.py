"""hpcadapt.plot on hand-written metrics lines, one case each: a resumed job's clock, an
epoch logged twice, stop and resume lines (present or not), failures recovered or not, the
header's counts, and ``--metric``. No MPI: the lines are what the job writes (see
tests/e2e/test_plot.py for files written by real runs)."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT

matplotlib = pytest.importorskip("matplotlib")

from hpcadapt.plot import EVENT_STYLES, build_figure, prepare, summarize  # noqa: E402

T0 = 1_800_000_000.0  # the first job's clock started at this unix time


def step(n, t, started=T0, size=2, epoch=0, **more):
    return {"event": "step", "step": n, "epoch": epoch, "world_size": size, "batch_size": 32,
            "lr": 0.1, "loss": 1.0 / n, "samples_per_s": 100.0, "time_s": t,
            "unix_time": started + t, **more}


def epoch(n, last_step, t, started=T0, acc=0.5, **more):
    return {"event": "epoch", "epoch": n, "step": last_step, "world_size": 2, "batch_size": 32,
            "lr": 0.1, "loss": 0.5, "test_accuracy": acc, "time_s": t, "unix_time": started + t,
            **more}


def event(kind, n, t, started=T0, **more):
    return {"event": kind, "step": n, "time_s": t, "unix_time": started + t, **more}


# a job stopped during epoch 1 at step 4 (t = 4 s), resumed 100 s after its clock started
STOPPED = [step(1, 1.0), step(2, 2.0), epoch(0, 2, 2.1), step(3, 3.0, epoch=1),
           step(4, 4.0, epoch=1), epoch(1, 4, 4.1, acc=0.6)]
RESUMED = [step(5, 2.0, T0 + 100, epoch=1), step(6, 3.0, T0 + 100, epoch=1),
           epoch(1, 6, 3.1, T0 + 100, acc=0.7)]


def of(rows, kind):
    return [r for r in rows if r["event"] == kind]


def with_gid(ax, gid):
    return [a for a in ax.get_children() if a.get_gid() == gid]


def workers_axes(fig):
    return [ax for ax in fig.axes if ax.get_gid() == "world_size"]


def test_a_resumed_jobs_wall_time_goes_on_from_where_the_stopped_one_ended():
    rows = prepare(STOPPED + RESUMED)
    walls = [r["wall_s"] for r in rows if "wall_s" in r]
    assert walls == sorted(walls)
    assert [r["wall_s"] for r in of(rows, "step")] == [1.0, 2.0, 3.0, 4.0, 6.1, 7.1]
    resume = of(rows, "resume")[0]
    # 4.1 s in (the last line), its clock started 100 s after the first's: 95.9 s away
    assert resume["inferred"] and resume["wall_s"] == 4.1 and resume["step"] == 4
    assert resume["started_wall_s"] == pytest.approx(6.1)
    assert resume["away_s"] == pytest.approx(95.9)


def test_the_later_record_of_an_epoch_logged_twice_wins():
    rows = prepare(STOPPED + RESUMED)
    assert [(r["epoch"], r["step"], r["test_accuracy"]) for r in of(rows, "epoch")] == [
        (0, 2, 0.5), (1, 6, 0.7)]
    assert summarize("r", STOPPED + RESUMED).startswith("r: 2 epoch(s), 6 step(s), "
                                                        "final test accuracy 0.700")


def test_a_stop_and_a_resume_are_inferred_where_the_file_has_none():
    rows = prepare(STOPPED + RESUMED)
    assert [(r["event"], r.get("inferred")) for r in rows if r["event"] in ("stop", "resume")
            ] == [("stop", True), ("resume", True)]
    assert ", 1 stop(s), 1 resume(s), 0 decision(s)" in summarize("r", STOPPED + RESUMED)
    fig = build_figure({"r": STOPPED + RESUMED})
    try:
        by_step, by_time = workers_axes(fig)
        for ax in (by_step, by_time):
            assert len(with_gid(ax, "stop")) == len(with_gid(ax, "resume")) == 1
            assert {"stop", "resume (96 s away)"} <= {t.get_text() for t in ax.texts}
        assert with_gid(by_step, "stop")[0].get_xdata()[0] == 4
        assert with_gid(by_step, "stop")[0].get_linestyle() == ":"
        gap = with_gid(by_time, "gap:resume")
        assert len(gap) == 1 and not with_gid(by_step, "gap:resume")
        band = gap[0].get_bbox()   # in data units along x
        assert (band.x0, band.x1) == (pytest.approx(4.1), pytest.approx(6.1))
        # the loss against wall time never goes back, and is broken where the run was away
        loss_by_step, loss_by_time = [ax.lines[0] for ax in fig.axes if ax.get_gid() == "loss"]
        assert list(loss_by_time.get_xdata()) == [1.0, 2.0, 3.0, 4.0, 4.1, 6.1, 7.1]
        ys = list(loss_by_time.get_ydata())
        assert ys[4] != ys[4] and all(y == y for y in ys[:4] + ys[5:])
        assert list(loss_by_step.get_xdata()) == [1, 2, 3, 4, 5, 6]
    finally:
        matplotlib.pyplot.close(fig)


def test_stop_and_resume_lines_are_drawn_as_they_say_and_nothing_is_inferred():
    stop = event("stop", 4, 4.2, signal="SIGTERM", saved=False)
    resume = event("resume", 4, 0.5, T0 + 100, checkpoint="state.ckpt")
    rows = prepare(STOPPED + [stop, resume] + RESUMED)
    marks = [r for r in rows if r["event"] in ("stop", "resume")]
    assert [(r["event"], r.get("inferred")) for r in marks] == [("stop", None),
                                                               ("resume", None)]
    # marked where the run stopped (4.2), the band up to the line, 0.5 s into the new job
    assert marks[1]["wall_s"] == pytest.approx(4.2)
    assert marks[1]["started_wall_s"] == pytest.approx(4.7)
    fig = build_figure({"r": STOPPED + [stop, resume] + RESUMED})
    try:
        ax = workers_axes(fig)[0]
        labels = {t.get_text() for t in ax.texts}
        assert "stop: SIGTERM, NOT saved" in labels
        assert any(t.startswith("resume (") and t.endswith(" s away)") for t in labels), labels
        assert len(with_gid(ax, "stop")) == len(with_gid(ax, "resume")) == 1
    finally:
        matplotlib.pyplot.close(fig)


def test_a_failure_that_ended_the_job_is_marked_and_no_stop_is_inferred():
    died = event("failure", 4, 4.2, rank=1, cause="dead", world_size=2)
    rows = prepare(STOPPED + [died] + RESUMED)
    assert not of(rows, "stop") and len(of(rows, "resume")) == 1
    text = summarize("r", STOPPED + [died] + RESUMED)
    assert "1 failure(s) (0 recovered), 1 resume(s)" in text and "stop" not in text
    fig = build_figure({"r": STOPPED + [died] + RESUMED})
    try:
        ax = workers_axes(fig)[0]
        line = with_gid(ax, "failure-ended")
        assert len(line) == 1 and line[0].get_color() == EVENT_STYLES["failure-ended"][0]["color"]
        assert "rank 1 died: job ended" in {t.get_text() for t in ax.texts}
        assert "failure, job ended" in {t.get_text() for t in ax.get_legend().get_texts()}
    finally:
        matplotlib.pyplot.close(fig)


def test_a_recovered_failure_is_one_failure_and_its_shrink_no_resize():
    rows = [step(1, 1.0), event("resize", 1, 1.5, old_size=2, new_size=3, ok=True,
                                reason="resize-schedule"), step(2, 2.0, size=3),
            event("failure", 2, 2.5, recovered=True, dead=[2], rank=2, cause="dead",
                  old_size=3, world_size=2),
            event("resize", 2, 2.6, old_size=3, new_size=2, ok=True,
                  reason="failure of rank(s) [2]"),
            event("resize", 2, 2.7, old_size=2, new_size=3, ok=False, reason="timeout"),
            step(3, 3.0), epoch(0, 3, 3.1)]
    assert ", 2 resize(s) (1 NOT done), 1 failure(s) (1 recovered), 0 decision(s)" in \
        summarize("r", rows)
    fig = build_figure({"r": rows})
    try:
        ax = workers_axes(fig)[0]
        assert [len(with_gid(ax, g)) for g in ("resize-ok", "resize-failed",
                                              "failure-recovered")] == [1, 1, 1]
        assert {"2->3", "2->3 failed", "rank 2 died: 3->2"} <= {t.get_text() for t in ax.texts}
    finally:
        matplotlib.pyplot.close(fig)


def test_a_coordinator_that_took_over_keeps_one_job():
    # take_over goes on with the same clock: time and start do not move
    rows = [step(1, 1.0), step(2, 2.0), event("failure", 2, 2.5, recovered=True, dead=[0],
                                              rank=0, cause="dead", old_size=3, world_size=2),
            step(3, 3.0)]
    prepared = prepare(rows)
    assert not of(prepared, "stop") and not of(prepared, "resume")
    assert [r["wall_s"] for r in prepared] == [1.0, 2.0, 2.5, 3.0]


def test_metric_plots_a_user_metric_of_the_epoch_lines(tmp_path):
    rows = [step(1, 1.0), epoch(0, 1, 1.1, ema_accuracy=0.4), step(2, 2.0),
            epoch(1, 2, 2.1, ema_accuracy=None), step(3, 3.0), epoch(2, 3, 3.1, ema_accuracy=0.6)]
    fig = build_figure({"r": rows}, ["ema_accuracy"])
    try:
        by_step, by_time = [ax for ax in fig.axes if ax.get_gid() == "ema_accuracy"]
        assert by_step.get_title() == "ema_accuracy (per epoch)"
        # the null (a NaN the user logged) is no point
        assert list(by_step.lines[0].get_xdata()) == [1, 3]
        assert list(by_step.lines[0].get_ydata()) == [0.4, 0.6]
        assert list(by_time.lines[0].get_xdata()) == [1.1, 3.1]
    finally:
        matplotlib.pyplot.close(fig)
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def plot(*flags):
        return subprocess.run([sys.executable, "-m", "hpcadapt.plot", str(path), "-o",
                               str(tmp_path / "m.png"), *flags], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)

    proc = plot("--metric", "ema_acc")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].endswith(
        "error: --metric ema_acc: no eval, epoch or step line has a number for it (the eval "
        "and epoch lines' own metrics: ema_accuracy)")
    proc = plot("--metric", "ema_accuracy", "--metric", "samples_per_s")
    assert proc.returncode == 0, proc.stderr
