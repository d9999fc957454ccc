"""``python -m hpcadapt.plot METRICS.jsonl [MORE.jsonl ...] -o OUT.png [--metric NAME]``:
what an adaptive run did, from its metrics file (``--metrics-file``).

One row per quantity, against steps (left) and wall time (right), or the axes ``--x`` names
(step, samples, time): training loss, test accuracy, each metric of the eval lines (the
validation curves of ``job.log_eval``), each ``--metric`` (a user metric of
``job.log_epoch``, or any field of the epoch or step lines), workers (world size), global batch size, learning rate, gradient noise scale
(with the batch size beside it) and throughput. A panel whose series has no data in any file
(the noise scale without a monitor) is left out. Several files (``label=path`` names them)
are drawn on the same axes, one colour each.

Every event is a vertical line on every panel, labelled on the workers panel: a resize green
when done and red dashed when not (``2->3``); a worker's death orange when the job recovered
(``rank 2 died: 3->2``) and purple dash-dotted when it ended the job; a stop (stop signal,
preemption) black dotted; a resume grey. A file that a resumed job appended to is one run:
its wall time goes on from where the stopped job's ended (each job's clock starts at 0; the
time between the jobs is a grey band as wide as the resumed job's start-up, labelled with
how long the run was away), and an epoch logged twice (cut by the stop, then finished by the
resumed job) is drawn once, from its later record. Stops and resumes come from ``stop`` and
``resume`` lines when the file has them, else from where a job's clock starts over. Policy
decisions are markers on the panel of what they changed (batch size, learning rate,
workers), labelled with the new value, one marker shape and legend entry per policy."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["load_metrics", "prepare", "build_figure", "plot_runs", "summarize", "PANELS",
           "AXES", "EVENT_STYLES", "main"]

# key, title, event the values come from, log scale
PANELS: Tuple[Tuple[str, str, str, bool], ...] = (
    ("loss", "training loss (global mean)", "step", False),
    ("test_accuracy", "test accuracy", "epoch", False),
    ("world_size", "workers (world size)", "step", False),
    ("batch_size", "global batch size", "step", True),
    ("lr", "learning rate", "step", True),
    ("noise_scale", "gradient noise scale (dashed: global batch)", "step", True),
    ("samples_per_s", "throughput (samples/s)", "step", False),
)
# which panel a decision's change is drawn on
_CHANGE_PANEL = {"world_size": "world_size", "batch_size": "batch_size", "lr": "lr",
                 "momentum": "lr", "lr_factor": "lr"}
# run colours: no green or red, which mark resizes
_RUN_COLOURS = ("C0", "C1", "C4", "C5", "C9", "C6", "C8", "C7")
_POLICY_MARKERS = ("v", "^", "s", "D", "P", "X", "o", "*")
RESIZE_OK = {"color": "tab:green", "linestyle": "-"}
RESIZE_FAILED = {"color": "tab:red", "linestyle": "--"}
# gid of an event's line -> its style and legend entry
EVENT_STYLES: Dict[str, Tuple[Dict[str, str], str]] = {
    "resize-ok": (RESIZE_OK, "resize done"),
    "resize-failed": (RESIZE_FAILED, "resize NOT done"),
    "failure-recovered": ({"color": "tab:orange", "linestyle": "-"}, "failure, recovered"),
    "failure-ended": ({"color": "tab:purple", "linestyle": "-."}, "failure, job ended"),
    "stop": ({"color": "black", "linestyle": ":"}, "stop (signal, preemption)"),
    "resume": ({"color": "tab:gray", "linestyle": "-"}, "resume (band: time away)"),
}
_NEW_CLOCK_S = 1.0  # a record whose clock started this much later than the one before's: a new job
_MAX_LABELS = 12  # value labels per policy and panel; more are thinned out


def load_metrics(path: str) -> List[Dict]:
    """Read a JSON Lines metrics file; a malformed line raises ValueError with its number."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{i}: not a JSON object")
            rows.append(row)
    return rows


def _num(v: Any) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _origin(row: Dict) -> Optional[float]:
    """When the clock of the job that wrote ``row`` started (unix time)."""
    t, u = _num(row.get("time_s")), _num(row.get("unix_time"))
    return u - t if t is not None and u is not None else None


def _jobs(rows: List[Dict]) -> List[List[Dict]]:
    """``rows`` cut where a new job's clock starts: ``time_s`` goes back, or the clock's
    start moves on (a resumed job appends to the same file; a coordinator that takes over
    keeps the clock). Rows without times stay with the job before them."""
    jobs: List[List[Dict]] = [[]]
    last_t = last_origin = None
    for r in rows:
        t, origin = _num(r.get("time_s")), _origin(r)
        if t is not None and last_t is not None and jobs[-1] and (
                t < last_t or (origin is not None and last_origin is not None
                               and abs(origin - last_origin) > _NEW_CLOCK_S)):
            jobs.append([])
        jobs[-1].append(r)
        if t is not None:
            last_t, last_origin = t, origin if origin is not None else last_origin
    return [j for j in jobs if j]


def _last_step(rows: List[Dict]) -> Any:
    steps = [r["step"] for r in rows
             if r.get("event") == "step" and _num(r.get("step")) is not None]
    return steps[-1] if steps else None


def _ended_by(job: List[Dict]) -> bool:
    """Whether ``job`` says why it ended: a stop line or a failure it did not survive."""
    return any(r.get("event") == "stop" or (r.get("event") == "failure"
                                            and r.get("recovered") is not True) for r in job)


def _between(before: List[Dict], after: List[Dict], wall_end: float) -> List[Dict]:
    """The stop and resume the file does not say, between two jobs: a stop at the end of
    ``before`` unless it says why it ended, a resume at the start of ``after`` unless it
    has a resume line; both marked ``inferred``."""
    out = []
    timed_before = [r for r in before if _num(r.get("time_s")) is not None]
    last = timed_before[-1] if timed_before else {}
    step = _last_step(before)
    if not _ended_by(before):
        out.append({"event": "stop", "inferred": True, "step": step, "wall_s": wall_end,
                    "unix_time": last.get("unix_time")})
    first = next((r for r in after if _num(r.get("time_s")) is not None), {})
    started, ended = _origin(first), _num(last.get("unix_time"))
    away = started - ended if started is not None and ended is not None else None
    written = [r for r in after if r.get("event") == "resume"]
    for r in written:  # the job's own resume line: how long the run was away, from the clocks
        r.setdefault("away_s", away)
    if not written:
        out.append({"event": "resume", "inferred": True, "step": step, "wall_s": wall_end,
                    "started_wall_s": wall_end + (_num(first.get("time_s")) or 0.0),
                    "away_s": away})
    return out


def _latest_per(rows: List[Dict], event: str) -> List[Dict]:
    """Rows of ``event`` logged again for the same epoch and step (a stopped job's last
    epoch, finished by the resumed job; a step trained again after a rollback) dropped,
    but for the later record."""
    key = "epoch" if event == "epoch" else "step"
    last_index = {}
    for i, r in enumerate(rows):
        if r.get("event") == event:
            last_index[r.get(key)] = i
    return [r for i, r in enumerate(rows) if r.get("event") != event
            or last_index.get(r.get(key)) == i]


def prepare(rows: List[Dict]) -> List[Dict]:
    """The rows of one metrics file (as ``load_metrics`` reads them) as one run, in new
    dicts: each row gets ``wall_s``, its wall time with every resumed job's clock
    offset by where the job before it ended; a stop and a resume are added between two jobs
    where the file has none (``"inferred": true``); an epoch (or step) logged twice keeps
    its later record only."""
    out: List[Dict] = []
    offset = wall_end = 0.0
    jobs = _jobs([r for r in rows if r.get("inferred") is not True])
    for k, job in enumerate(jobs):
        if k:
            out.extend(_between(jobs[k - 1], job, wall_end))
            offset = wall_end
        for r in job:
            row = dict(r)
            t = _num(r.get("time_s"))
            if t is not None:
                row["wall_s"] = t + offset
                wall_end = max(wall_end, row["wall_s"])
            if k and row.get("event") == "resume" and "wall_s" in row:
                # the job's own resume line: marked where the run stopped, the band up to
                # when the resumed job wrote it
                row["started_wall_s"], row["wall_s"] = row["wall_s"], offset
            out.append(row)
    return _with_samples_seen(_latest_per(_latest_per(out, "epoch"), "step"))


def _with_samples_seen(rows: List[Dict]) -> List[Dict]:
    """Each row's ``samples_seen`` (the x of ``--x samples``): an eval line's ``samples``;
    for the others the global batches of the steps up to theirs (a step line's
    ``batch_size`` is its own batch)."""
    at_step: Dict[int, float] = {}
    total = 0.0
    for r in rows:
        if r.get("event") == "step" and _num(r.get("batch_size")) is not None:
            total += float(r["batch_size"])
            step = _num(r.get("step"))
            if step is not None:
                at_step[int(step)] = total
    steps = sorted(at_step)
    import bisect

    for r in rows:
        if r.get("event") == "eval" and _num(r.get("samples")) is not None:
            r["samples_seen"] = float(r["samples"])
            continue
        step = _num(r.get("step"))
        if step is None or not steps:
            continue
        i = bisect.bisect_right(steps, int(step)) - 1
        r["samples_seen"] = at_step[steps[i]] if i >= 0 else 0.0
    return rows


AXES = {"step": "step", "samples": "samples seen", "time": "wall time (s)"}


def _x(row: Dict, axis: str) -> Optional[float]:
    if axis == "step":
        return _num(row.get("step"))
    if axis == "samples":
        return _num(row.get("samples_seen"))
    wall = _num(row.get("wall_s"))
    return wall if wall is not None else _num(row.get("time_s"))


def _value(row: Dict, key: str) -> Optional[float]:
    v = row.get(key)
    if v is None:
        v = (row.get("monitors") or {}).get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _series(rows: List[Dict], event: str, key: str, axis: str) -> Tuple[List[float], List[float]]:
    """``key`` of the ``event`` rows against ``axis``; against wall time a resume breaks the
    line (a NaN value at the resume), so no line crosses the time the run was away."""
    xs, ys = [], []
    for r in rows:
        if r.get("event") == "resume" and axis == "time" and ys and ys[-1] == ys[-1]:
            x = _x(r, axis)
            if x is not None:
                xs.append(x)
                ys.append(math.nan)
        if r.get("event") != event:
            continue
        x, v = _x(r, axis), _value(r, key)
        if x is None or v is None:
            continue
        xs.append(x)
        ys.append(v)
    return xs, ys


def _smooth(ys: List[float], window: int) -> List[float]:
    """Trailing moving average (the first points average what there is); a NaN (a break in
    the line) stays and the average starts over after it."""
    out, total, start = [], 0.0, 0
    for i, y in enumerate(ys):
        if y != y:
            out.append(y)
            total, start = 0.0, i + 1
            continue
        total += y
        if i - window >= start:
            total -= ys[i - window]
        out.append(total / min(i - start + 1, window))
    return out


def _fmt(key: str, value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if key in ("world_size", "batch_size"):
        return f"{int(value)}"
    if key == "lr_factor":
        return f"x{value:.3g}"
    return f"{value:.3g}"


def _decision_panels(row: Dict) -> List[str]:
    """The panels a decision is marked on: those of what it changed (the loss panel when
    none is known)."""
    panels = []
    for k in (row.get("changes") or {}):
        p = _CHANGE_PANEL.get(k)
        if p is not None and p not in panels:
            panels.append(p)
    return panels or ["loss"]


def _decision_label(row: Dict, panel: str) -> str:
    """What a decision changed on ``panel``, e.g. ``batch 24`` or ``lr 0.0245``; changes
    with no panel of their own (``remove_rank``) go with the first."""
    names = {"world_size": "workers", "batch_size": "batch", "lr": "lr", "momentum": "momentum",
             "remove_rank": "remove rank", "lr_factor": "factor"}
    first = _decision_panels(row)[0] == panel
    parts = [f"{names.get(k, k)} {_fmt(k, v)}" for k, v in (row.get("changes") or {}).items()
             if _CHANGE_PANEL.get(k) == panel or (first and k not in _CHANGE_PANEL)]
    return ", ".join(parts) or str(row.get("policy", "decision"))


def _decision_y(row: Dict, panel: str) -> Optional[float]:
    """The new value on ``panel``; momentum on the lr panel: the rate at the decision; None
    when there is no value (the marker then sits at the panel's top)."""
    changes = row.get("changes") or {}
    for k, v in changes.items():
        if k == panel and isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return _value(row, "lr") if panel == "lr" else None


Panel = Tuple[str, str, str, bool]


def metric_panel(runs: Dict[str, List[Dict]], name: str) -> Panel:
    """The panel of ``--metric NAME``: from the eval lines when one has it (a metric of
    ``job.log_eval``: the validation curve), else the epoch lines (``job.log_epoch``), else
    the step lines (their fields and monitors). Raises ValueError naming the metrics the
    eval and epoch lines have when no line has it."""
    for event in ("eval", "epoch", "step"):
        if any(_series(rows, event, name, "step")[0] for rows in runs.values()):
            return (name, f"{name} (per {event})", event, False)
    found = sorted(set(_user_metrics(runs, "eval")) | set(_user_metrics(runs, "epoch")))
    raise ValueError(f"--metric {name}: no eval, epoch or step line has a number for it (the "
                     f"eval and epoch lines' own metrics: {', '.join(found) or 'none'})")


def _user_metrics(runs: Dict[str, List[Dict]], event: str) -> List[str]:
    """The user's own metrics of the ``event`` lines (eval or epoch), in first-seen order."""
    from hpcadapt.base.metrics import RESERVED_EPOCH_KEYS, RESERVED_EVAL_KEYS

    reserved = (RESERVED_EVAL_KEYS if event == "eval" else RESERVED_EPOCH_KEYS) | {
        "wall_s", "samples_seen"}
    names: Dict[str, None] = {}
    for rows in runs.values():
        for r in rows:
            if r.get("event") == event:
                for k, v in r.items():
                    if k not in reserved and _value(r, k) is not None:
                        names.setdefault(k, None)
    return list(names)


def present_panels(runs: Dict[str, List[Dict]],
                   metrics: Sequence[str] = ()) -> List[Panel]:
    """The panels with data in at least one run, in ``PANELS`` order, each ``--metric``
    after the test accuracy, as is each metric of the eval lines (``job.log_eval``: the
    validation curves). Raises ValueError for a metric no run has."""
    extra = [(name, f"{name} (validation, per eval)", "eval", False)
             for name in _user_metrics(runs, "eval")]
    extra += [p for p in (metric_panel(runs, name) for name in metrics)
              if p[0] not in [q[0] for q in extra]]
    out = []
    for panel in PANELS:
        key, _, event, _ = panel
        if any(_series(rows, event, key, "step")[0] for rows in runs.values()):
            out.append(panel)
        if key == "test_accuracy":
            out.extend(p for p in extra if p[0] not in [q[0] for q in out])
    return out


def _is_resize(row: Dict) -> bool:
    """A resize line that is a resize: the shrink a recovery records after a worker's
    death is drawn and counted as that failure."""
    return row.get("event") == "resize" and not str(row.get("reason", "")).startswith(
        "failure of")


def summarize(label: str, rows: List[Dict]) -> str:
    """One line about a run (``load_metrics``' rows): epochs, steps, accuracy, batch and
    worker path, resizes, failures, stops and resumes, decisions."""
    return _summary_line(label, prepare(rows))


def _summary_line(label: str, rows: List[Dict]) -> str:
    """``summarize`` of rows ``prepare`` made."""
    steps = [r for r in rows if r.get("event") == "step"]
    epochs = [r for r in rows if r.get("event") == "epoch"]
    resizes = [r for r in rows if _is_resize(r)]
    decisions = [r for r in rows if r.get("event") == "decision"]
    parts = [f"{label}: {len(epochs)} epoch(s), {len(steps)} step(s)"]
    acc = [_value(r, "test_accuracy") for r in epochs]
    acc = [a for a in acc if a is not None]
    if acc:
        parts.append(f"final test accuracy {acc[-1]:.3f}")

    def path(key: str) -> List[int]:
        seq: List[int] = []
        for r in steps:
            v = _value(r, key)
            if v is not None and (not seq or seq[-1] != int(v)):
                seq.append(int(v))
        return seq

    batches, sizes = path("batch_size"), path("world_size")
    if batches:
        parts.append("batch " + (f"{batches[0]} -> {batches[-1]}" if len(batches) > 1
                                 else f"{batches[0]}"))
    if sizes:
        parts.append("workers " + " -> ".join(str(s) for s in sizes))
    failed = sum(1 for r in resizes if r.get("ok") is False)
    parts.append(f"{len(resizes)} resize(s)" + (f" ({failed} NOT done)" if failed else ""))
    failures = [r for r in rows if r.get("event") == "failure"]
    if failures:
        recovered = sum(1 for r in failures if r.get("recovered") is True)
        parts.append(f"{len(failures)} failure(s) ({recovered} recovered)")
    for event in ("stop", "resume"):
        n = sum(1 for r in rows if r.get("event") == event)
        if n:
            parts.append(f"{n} {event}(s)")
    parts.append(f"{len(decisions)} decision(s)")
    return ", ".join(parts)


def build_figure(runs: Dict[str, List[Dict]], metrics: Sequence[str] = (),
                 axes_x: Sequence[str] = ("step", "time")):
    """The figure for ``runs`` (label -> metrics rows, as ``load_metrics`` reads them),
    with a panel for each of ``metrics`` (``--metric``) and a column for each x axis of
    ``axes_x`` (step, samples, time), not yet saved. Raises ValueError when no run has any
    series to draw, or one of ``metrics``."""
    unknown = [a for a in axes_x if a not in AXES]
    if unknown or not axes_x:
        raise ValueError(f"--x {','.join(axes_x)}: choose from {', '.join(AXES)}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    runs = {label: prepare(rows) for label, rows in runs.items()}
    panels = present_panels(runs, metrics)
    if not panels:
        raise ValueError("no step or epoch rows with values to plot (is this a metrics file "
                         "written by --metrics-file?)")
    fig, axes = plt.subplots(len(panels), len(axes_x),
                             figsize=(6.5 * len(axes_x), 2.7 * len(panels) + 0.8), squeeze=False)
    policies: List[str] = []
    for rows in runs.values():
        for r in rows:
            if r.get("event") == "decision" and r.get("policy") not in policies:
                policies.append(str(r.get("policy")))
    marker_of = {p: _POLICY_MARKERS[i % len(_POLICY_MARKERS)] for i, p in enumerate(policies)}
    colour_of = {label: _RUN_COLOURS[i % len(_RUN_COLOURS)] for i, label in enumerate(runs)}

    for col, axis in enumerate(axes_x):
        for row_i, (key, title, event, log_y) in enumerate(panels):
            ax = axes[row_i][col]
            ax.set_gid(key)
            if log_y:
                ax.set_yscale("log")
            handles: Dict[str, Any] = {}
            for label, rows in runs.items():
                colour = colour_of[label]
                xs, ys = _series(rows, event, key, axis)
                if xs:
                    if key == "world_size":
                        ax.step(xs, ys, where="post", color=colour, label=label, linewidth=1.5)
                    elif event in ("epoch", "eval"):
                        ax.plot(xs, ys, "o-", color=colour, label=label, linewidth=1,
                                markersize=3)
                    elif key in ("loss", "samples_per_s") and len(xs) > 60:
                        ax.plot(xs, ys, "-", color=colour, alpha=0.25, linewidth=0.6)
                        ax.plot(xs, _smooth(ys, max(5, len(xs) // 60)), "-", color=colour,
                                label=label, linewidth=1.3)
                    else:
                        ax.plot(xs, ys, "-", color=colour, label=label, linewidth=1.2)
                if key == "noise_scale" and xs:
                    bx, by = _series(rows, "step", "batch_size", axis)
                    ax.plot(bx, by, "--", color=colour, alpha=0.6, linewidth=1)
                _draw_events(ax, rows, axis, key == "world_size", handles, Line2D)
                _draw_decisions(ax, rows, axis, key, colour, marker_of, handles, Line2D)
            if log_y:
                _plain_log_ticks(ax, base=2 if key == "batch_size" else 10)
            if key == "world_size":
                ax.yaxis.get_major_locator().set_params(integer=True)
                lo, hi = ax.get_ylim()
                ax.set_ylim(max(0.0, lo - 0.3), hi + 0.8)  # room for the labels above
            if key == "test_accuracy":
                ax.set_ylim(top=min(1.02, max(ax.get_ylim()[1], 0.0) + 0.02))
            ax.set_title(title, fontsize=9)
            ax.set_xlabel(AXES[axis], fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.2)
            shown = list(handles.values())
            if row_i == 0 and col == 0:
                shown = ax.get_legend_handles_labels()[0] + shown
            if shown:
                ax.legend(handles=shown, fontsize=6.5, loc="best")
    lines = [_summary_line(label, rows) for label, rows in runs.items()]
    fig.suptitle("\n".join(lines), fontsize=8.5, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.012 * (len(lines) + 1)))
    return fig


def _plain_log_ticks(ax, base: int) -> None:
    """Log axes labelled 16, 32, 64 or 0.02, 0.05 rather than 2x10^1."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    if base == 2:
        ax.yaxis.set_major_locator(LogLocator(base=2))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.yaxis.set_minor_formatter(FuncFormatter(
            lambda v, _: f"{v:g}" if str(f"{v:.0e}")[0] in "25" else ""))
    ax.yaxis.set_major_formatter(plain)


def _event_gid(row: Dict) -> Optional[str]:
    """Which of ``EVENT_STYLES`` a row is drawn as, or None for a row that is no event."""
    event = row.get("event")
    if event == "resize":
        return None if not _is_resize(row) else (
            "resize-ok" if row.get("ok") is not False else "resize-failed")
    if event == "failure":
        return "failure-recovered" if row.get("recovered") is True else "failure-ended"
    return event if event in ("stop", "resume") else None


def _event_label(row: Dict, gid: str) -> str:
    """What the workers panel says about an event, e.g. ``2->3 failed``, ``rank 2 died:
    3->2``, ``stop: SIGTERM``, ``resume (42 s away)``."""
    if gid.startswith("resize"):
        return f"{row.get('old_size', '?')}->{row.get('new_size', '?')}" + (
            "" if gid == "resize-ok" else " failed")
    if gid.startswith("failure"):
        dead = row.get("dead") or [row.get("rank", "?")]
        who = "rank " + ",".join(str(d) for d in dead) if dead != [-1] else "a peer"
        what = "died" if row.get("cause") in ("dead", "notice", None) else str(row["cause"])
        if gid == "failure-recovered":
            return f"{who} {what}: {row.get('old_size', '?')}->{row.get('world_size', '?')}"
        return f"{who} {what}: job ended"
    if gid == "stop":
        why = row.get("signal") or row.get("reason")
        text = "stop" + (f": {why}" if why else "")
        return text + (", NOT saved" if row.get("saved") is False else "")
    away = _num(row.get("away_s"))
    return "resume" + (f" ({away:.0f} s away)" if away is not None else "")


def _draw_events(ax, rows: List[Dict], axis: str, labelled: bool, handles: Dict,
                 Line2D) -> None:
    """Every event of ``rows`` as a vertical line (gid: its ``EVENT_STYLES`` key), the
    time a resumed job took to start as a grey band on the wall-time axis; labels and
    legend entries only where ``labelled`` (the workers panel)."""
    n = 0
    for r in rows:
        gid = _event_gid(r)
        x = _x(r, axis) if gid is not None else None
        if x is None:
            continue
        style, name = EVENT_STYLES[gid]
        ax.axvline(x, linewidth=1.2 if labelled else 0.8, alpha=0.9 if labelled else 0.45,
                   gid=gid, **style)
        started = _num(r.get("started_wall_s"))
        if gid == "resume" and axis == "time" and started is not None and started > x:
            ax.axvspan(x, started, color="0.5", alpha=0.15, linewidth=0, gid="gap:resume")
        if labelled:
            ax.annotate(_event_label(r, gid), xy=(x, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(2, -2 - 8 * (n % 4)), textcoords="offset points",
                        fontsize=6.5, color=style["color"], va="top", gid=f"label:{gid}")
            handles.setdefault(name, Line2D([], [], linewidth=1.2, label=name, **style))
        n += 1


def _draw_decisions(ax, rows: List[Dict], axis: str, panel: str, colour: str,
                    marker_of: Dict[str, str], handles: Dict, Line2D) -> None:
    mine = [r for r in rows if r.get("event") == "decision" and panel in _decision_panels(r)]
    by_policy: Dict[str, List[Dict]] = {}
    for r in mine:
        by_policy.setdefault(str(r.get("policy")), []).append(r)
    for policy, found in by_policy.items():
        every = max(1, math.ceil(len(found) / _MAX_LABELS))
        marker = marker_of.get(policy, "o")
        for i, r in enumerate(found):
            x, y = _x(r, axis), _decision_y(r, panel)
            if x is None or (y is not None and ax.get_yscale() == "log" and y <= 0):
                continue
            # no value: at the top of the panel, where the step or time is
            where = {} if y is not None else {"transform": ax.get_xaxis_transform()}
            y_at = y if y is not None else 0.97
            ax.plot([x], [y_at], marker=marker, linestyle="none", markersize=5,
                    markerfacecolor="white", markeredgecolor=colour, markeredgewidth=1.2,
                    gid=f"decision:{policy}", **where)
            if i % every == 0:
                ax.annotate(_decision_label(r, panel), xy=(x, y_at),
                            xycoords="data" if y is not None else ax.get_xaxis_transform(),
                            xytext=(3, 3 if y is not None else -9), textcoords="offset points",
                            fontsize=6, color="0.25", gid=f"decision-label:{policy}")
        name = f"decision: {policy}"
        handles.setdefault(name, Line2D([], [], marker=marker, linestyle="none",
                                        markerfacecolor="white", markeredgecolor="0.2",
                                        label=name))


def plot_runs(runs: Dict[str, List[Dict]], out: str, metrics: Sequence[str] = (),
              axes_x: Sequence[str] = ("step", "time")) -> None:
    """Draw ``runs`` (label -> metrics rows) and write the figure to ``out`` (PNG, SVG or
    PDF by its extension); ``metrics`` and ``axes_x`` as for ``build_figure``."""
    import matplotlib.pyplot as plt

    fig = build_figure(runs, metrics, axes_x)
    try:
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcadapt.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", nargs="+", help="JSON Lines metrics files (label=path allowed)")
    ap.add_argument("-o", "--output", required=True, help="image file to write (.png, .svg, .pdf)")
    ap.add_argument("--metric", action="append", default=[], metavar="NAME",
                    help="also plot NAME (repeatable): a metric the training passed to "
                         "job.log_epoch or job.log_eval, or any field of the epoch or step "
                         "lines (the eval lines' metrics are drawn without asking)")
    ap.add_argument("--x", default="step,time", metavar="AXES",
                    help="the x axes, one column each, comma-separated from step, samples "
                         "and time (default: step,time)")
    args = ap.parse_args(argv)
    axes_x = [a.strip() for a in args.x.split(",") if a.strip()]
    runs = {}
    for item in args.metrics:
        label, sep, path = item.partition("=")
        if not sep or not label:
            label, path = os.path.basename(item), item
        try:
            runs[label] = load_metrics(path)
        except (OSError, ValueError) as exc:
            ap.error(str(exc))
    try:
        plot_runs(runs, args.output, args.metric, axes_x)
    except ValueError as exc:
        ap.error(str(exc))
    for label, rows in runs.items():
        print(summarize(label, rows))
    print(f"plot written to {os.path.abspath(args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
