"""Pictures of a simulated step: a Gantt chart of lanes over time and a per-rank load chart (PNG).

matplotlib with the Agg backend (no display needed). With many lanes the Gantt chart shows a
readable subset: the slowest and the fastest lane plus evenly spaced ones, named on the y axis.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from flexmesh.errors import FlexmeshError  # noqa: E402
from flexmesh.files import make_folder, write_atomic_with  # noqa: E402
from flexmesh.sim.timeline import KINDS, StepTimeline  # noqa: E402

COLORS = {"compute": "#2b7bba", "comm": "#f28e2b", "bubble": "#bab0ac", "wait": "#e15759"}


def pick_lanes(tl: StepTimeline, max_lanes: int = 32) -> list[int]:
    """Lanes to draw: all when few; else the slowest, the fastest and evenly spaced others, in order."""
    n = tl.num_lanes
    if n <= max_lanes:
        return list(range(n))
    keep = {int(np.argmax(tl.work_end)), int(np.argmin(tl.work_end))}
    keep |= {int(x) for x in np.linspace(0, n - 1, max_lanes - len(keep)).round()}
    return sorted(keep)[:max_lanes] if len(keep) > max_lanes else sorted(keep)


def time_unit(seconds: float) -> tuple[float, str]:
    """Scale and name of the unit to show ``seconds`` in: milliseconds below one second.

    >>> time_unit(0.25), time_unit(3.0)
    ((1000.0, 'ms'), (1.0, 's'))
    """
    return (1e3, "ms") if seconds < 1.0 else (1.0, "s")


def gantt_png(tl: StepTimeline, path: str | Path, title: str = "", max_lanes: int = 32) -> Path:
    """Draw lanes (y) over time (x), coloured by kind; needs a timeline simulated with ``detail=True``."""
    if tl.segments is None:
        raise FlexmeshError("the Gantt chart needs a detailed timeline: simulate the step with detail=True")
    lanes = pick_lanes(tl, max_lanes)
    scale, unit = time_unit(tl.step_time)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.28 * len(lanes)))
    for y, lane in enumerate(lanes):
        for kind in KINDS:
            bars = [(s.start * scale, (s.end - s.start) * scale) for s in tl.segments[lane] if s.kind == kind]
            if bars:
                # Thin white edges keep back-to-back micro-batches distinguishable.
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLORS[kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(lanes)), [tl.lane_label(lane) for lane in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, tl.step_time * scale)
    ax.set_xlabel(f"time in step ({unit})")
    shown = "" if len(lanes) == tl.num_lanes else f", {len(lanes)} of {tl.num_lanes} lanes shown"
    ax.set_ylabel("data rank" + (" / pipeline stage" if tl.pp > 1 else ""))
    ax.set_title(f"{title}{' - ' if title else ''}step {tl.step_time * scale:.3g} {unit}{shown}", fontsize=10,
                 loc="left")
    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in KINDS], loc="lower right",
              bbox_to_anchor=(1.0, 1.0), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    return save_figure(fig, path)


def load_png(tl: StepTimeline, path: str | Path, title: str = "") -> Path:
    """Per data rank, stacked: compute, exposed communication, bubbles and waiting (worst stage)."""
    scale, unit = time_unit(tl.step_time)
    per = {k: getattr(tl, k).reshape(tl.pp, tl.num_ranks) for k in KINDS}
    stage = int(np.argmax(per["wait"].sum(axis=1))) if tl.pp > 1 else 0
    x = np.arange(tl.num_ranks)
    fig, ax = plt.subplots(figsize=(11, 4))
    bottom = np.zeros(tl.num_ranks)
    width = 0.85 if tl.num_ranks <= 128 else 1.0
    for kind in KINDS:
        h = per[kind][stage] * scale
        ax.bar(x, h, bottom=bottom, width=width, color=COLORS[kind], label=kind, linewidth=0)
        bottom += h
    ax.axhline(tl.step_time * scale, color="black", linewidth=0.8, linestyle="--", label="step time")
    ax.set_xlim(-0.5, tl.num_ranks - 0.5)
    ax.set_xlabel("data rank" + (f" (pipeline stage {stage})" if tl.pp > 1 else ""))
    ax.set_ylabel(f"time ({unit})")
    ax.set_title(f"{title}{' - ' if title else ''}per-rank load, imbalance {tl.imbalance:.2f}, "
                 f"mean utilisation {tl.utilisation.mean():.0%}", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=5, fontsize=8, frameon=False)
    fig.tight_layout()
    return save_figure(fig, path)


def save_figure(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (folders created; atomically, and never through a symlink or
    over anything but a regular file: flexmesh.files) and close it, so figures do not pile up."""
    p = Path(path)
    try:
        make_folder(p.parent)
        write_atomic_with(p, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)
    return p
