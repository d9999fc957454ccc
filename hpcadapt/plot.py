"""``python -m hpcadapt.plot METRICS.jsonl [MORE.jsonl ...] -o OUT.png``: loss, accuracy,
batch size, learning rate, noise scale and throughput against steps and wall time, with
decisions marked as vertical lines. Several files are drawn on the same axes."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

__all__ = ["load_metrics", "plot_runs", "main"]

PANELS = (
    ("loss", "step", "loss"),
    ("test accuracy", "epoch", "test_accuracy"),
    ("global batch size", "step", "batch_size"),
    ("learning rate", "step", "lr"),
    ("gradient noise scale", "step", "noise_scale"),
    ("samples/s", "step", "samples_per_s"),
)


def load_metrics(path: str) -> List[Dict]:
    """Read a JSON Lines metrics file; a malformed line raises ValueError with its number."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{i}: not JSON ({exc.msg})") from None
    return rows


def _series(rows: List[Dict], event: str, key: str, x: str):
    xs, ys = [], []
    for r in rows:
        if r.get("event") != event:
            continue
        v = r.get(key, r.get("monitors", {}).get(key))
        if v is None:
            continue
        xs.append(r["step"] if x == "step" else r["time_s"])
        ys.append(v)
    return xs, ys


def plot_runs(runs: Dict[str, List[Dict]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), 2, figsize=(12, 3 * len(PANELS)), squeeze=False)
    for col, x in enumerate(("step", "time")):
        for row, (title, _, key) in enumerate(PANELS):
            ax = axes[row][col]
            for label, rows in runs.items():
                event = "epoch" if key == "test_accuracy" else "step"
                xs, ys = _series(rows, event, key, x)
                if not xs:
                    continue
                style = "o-" if event == "epoch" else "-"
                line, = ax.plot(xs, ys, style, label=label, linewidth=1, markersize=3)
                for r in rows:
                    if r.get("event") in ("decision", "resize"):
                        ax.axvline(r["step"] if x == "step" else r["time_s"],
                                   color=line.get_color(), alpha=0.25, linestyle="--")
            if key in ("batch_size", "noise_scale", "lr") and ax.lines:
                ax.set_yscale("log")
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step" if x == "step" else "wall time (s)", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcadapt.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", nargs="+", help="JSON Lines metrics files (label=path allowed)")
    ap.add_argument("-o", "--output", required=True, help="PNG file to write")
    args = ap.parse_args(argv)
    runs = {}
    for item in args.metrics:
        label, sep, path = item.partition("=")
        if not sep:
            label, path = os.path.basename(item), item
        try:
            runs[label] = load_metrics(path)
        except (OSError, ValueError) as exc:
            ap.error(str(exc))
    plot_runs(runs, args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
