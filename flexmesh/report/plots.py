"""Plots of measured training runs (matplotlib, Agg backend: no display needed).

Each function takes plain numbers (from metrics.jsonl rows, see docs/metrics.md) and writes one PNG:

- :func:`loss_png`: loss against step, one line per run;
- :func:`balance_png`: each rank's busy time per step, mean over steps, one bar group per run;
- :func:`timeline_png`: one measured step as a bar per rank (busy, then waiting for the slowest),
  beside what the cost model predicted for that rank;
- :func:`predicted_vs_measured_png`: predicted against measured step time, with the y = x line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from flexmesh.report.report import median_abs_error  # noqa: E402
from flexmesh.sim.plots import COLORS, save_figure, time_unit  # noqa: E402


def loss_png(runs: Mapping[str, tuple[Sequence[int], Sequence[float]]], path: str | Path,
             title: str = "training loss") -> Path:
    """``runs``: label -> (steps, losses)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (steps, losses) in runs.items():
        ax.plot(list(steps), list(losses), marker="o", markersize=3, linewidth=1.2, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over the global batch's label tokens)")
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return save_figure(fig, path)


def balance_png(runs: Mapping[str, np.ndarray], path: str | Path, title: str = "per-rank busy time") -> Path:
    """``runs``: label -> array (steps, ranks) of busy seconds; bars show the mean per rank.

    The legend gives each run's mean imbalance (max / mean busy time of a step, averaged over steps).
    """
    labels = list(runs)
    ranks = max(np.asarray(v).shape[1] for v in runs.values())
    top = max(float(np.asarray(v).mean(axis=0).max()) for v in runs.values())
    scale, unit = time_unit(top)
    width = 0.8 / max(1, len(labels))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, label in enumerate(labels):
        busy = np.asarray(runs[label], dtype=float)
        imb = float(np.mean(busy.max(axis=1) / np.maximum(busy.mean(axis=1), 1e-12)))
        x = np.arange(busy.shape[1]) + (i - (len(labels) - 1) / 2) * width
        ax.bar(x, busy.mean(axis=0) * scale, width=width, label=f"{label} (imbalance {imb:.2f})")
    ax.set_xticks(range(ranks))
    ax.set_xlabel("rank")
    ax.set_ylabel(f"mean busy time per step ({unit})")
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return save_figure(fig, path)


def timeline_png(busy: Sequence[float], step_time: float, path: str | Path, predicted: Sequence[float] | None = None,
                 title: str = "one measured step") -> Path:
    """One step: each rank busy (compute + its group's communication), then waiting until the step ends.

    ``predicted`` (per rank, seconds) draws the cost model's busy time as a thin black tick.
    """
    per_rank = np.asarray(busy, dtype=float)
    scale, unit = time_unit(step_time)
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * len(per_rank)))
    for r, b in enumerate(per_rank):
        ax.broken_barh([(0, b * scale)], (r - 0.35, 0.7), facecolors=COLORS["compute"])
        ax.broken_barh([(b * scale, max(0.0, step_time - b) * scale)], (r - 0.35, 0.7), facecolors=COLORS["wait"])
        if predicted is not None:
            ax.plot([predicted[r] * scale] * 2, [r - 0.45, r + 0.45], color="black", linewidth=2)
    ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, step_time * scale * 1.02)
    ax.set_xlabel(f"time in step ({unit}); blue: busy, red: waiting"
                  + ("; black tick: predicted busy" if predicted is not None else ""))
    ax.set_title(title, fontsize=10, loc="left")
    fig.tight_layout()
    return save_figure(fig, path)


def predicted_vs_measured_png(predicted: Sequence[float], measured: Sequence[float], path: str | Path,
                              labels: Sequence[str] | None = None, title: str = "step time") -> Path:
    """Scatter of predicted (x) against measured (y) seconds, coloured by ``labels``, with y = x."""
    p = np.asarray(predicted, dtype=float)
    m = np.asarray(measured, dtype=float)
    labels = list(labels) if labels is not None else [""] * len(p)
    scale, unit = time_unit(float(max(p.max(initial=0), m.max(initial=0))))
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for label in dict.fromkeys(labels):
        sel = np.array([x == label for x in labels])
        ax.scatter(p[sel] * scale, m[sel] * scale, s=18, label=label or None)
    hi = float(max(p.max(initial=0), m.max(initial=0))) * scale * 1.05
    ax.plot([0, hi], [0, hi], color="black", linewidth=0.8, linestyle="--", label="y = x")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel(f"predicted ({unit})")
    ax.set_ylabel(f"measured ({unit})")
    ax.set_title(f"{title}: median |error| {median_abs_error(p, m):.1%}", fontsize=10, loc="left")
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return save_figure(fig, path)
