"""Pictures of simulated serving (PNG, matplotlib's Agg backend): latency and attainment against the request
rate (where the fleet's knee is), and each replica's queue, batch and KV use over time.

>>> import tempfile, pathlib
>>> from flexmesh.serve.metrics import Summary
>>> pct = {"p50": 0.1, "p90": 0.2, "p99": 0.3, "mean": 0.12}
>>> pts = [(r, Summary(10, 5.0, pct, pct, pct, 2.0, 10.0, 20.0, attainment=a)) for r, a in ((1, 1.0), (2, 0.5))]
>>> knee_png(pts, pathlib.Path(tempfile.mkdtemp()) / "knee.png", target=0.9, goodput=1.4).name
'knee.png'
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from flexmesh.errors import FlexmeshError  # noqa: E402
from flexmesh.serve.metrics import Summary  # noqa: E402
from flexmesh.serve.simulator import ReplicaReport  # noqa: E402
from flexmesh.sim.plots import save_figure  # noqa: E402

PCT_STYLE = {"p50": ("#2b7bba", "-"), "p90": ("#f28e2b", "--"), "p99": ("#e15759", ":")}
MAX_TIMELINES = 12


def knee_png(points: Sequence[tuple[float, Summary]], path: str | Path, target: float | None = None,
             goodput: float | None = None, title: str = "") -> Path:
    """TTFT and TPOT percentiles and SLO attainment against the request rate (one point per run)."""
    if not points:
        raise FlexmeshError("no runs to plot against the rate")
    pts = sorted(points, key=lambda p: p[0])
    rates = [r for r, _ in pts]
    has_attainment = any(s.attainment is not None for _, s in pts)
    fig, axes = plt.subplots(1, 3 if has_attainment else 2, figsize=(13 if has_attainment else 9, 3.8))
    for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT (first token excluded)")):
        for q, (color, style) in PCT_STYLE.items():
            ax.plot(rates, [getattr(s, metric)[q] * 1e3 for _, s in pts], marker="o", ms=3, color=color,
                    linestyle=style, label=q)
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if has_attainment:
        ax = axes[2]
        ax.plot(rates, [s.attainment for _, s in pts], marker="o", ms=3, color="#59a14f")
        if target is not None:
            ax.axhline(target, color="#bab0ac", linestyle="--", label=f"target {target:.0%}")
        if goodput:
            ax.axvline(goodput, color="#e15759", linestyle=":", label=f"goodput {goodput:.3g} req/s")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment")
        if pts[0][1].slo:
            ax.set_title(pts[0][1].slo, fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def timeline_png(replicas: Sequence[ReplicaReport], path: str | Path, title: str = "") -> Path:
    """Per replica, over the run: requests waiting and running (left axis) and the KV cache in use (right);
    the first :data:`MAX_TIMELINES` replicas when there are more."""
    shown = [r for r in replicas if r.samples][:MAX_TIMELINES]
    if not shown:
        raise FlexmeshError("no replica timeline to plot (no replica ran an iteration)")
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 1.7 * len(shown) + 0.6), sharex=True, squeeze=False)
    twins = []
    for ax, r in zip(axes[:, 0], shown):
        t = [s[0] for s in r.samples]
        ax.step(t, [s[1] for s in r.samples], where="post", color="#e15759", lw=1, label="waiting")
        ax.step(t, [s[2] for s in r.samples], where="post", color="#2b7bba", lw=1, label="running")
        ax.set_ylabel(f"r{r.index} {r.label}\n{r.device}", fontsize=7)
        kv = ax.twinx()
        kv.step(t, [100 * s[4] for s in r.samples], where="post", color="#59a14f", lw=1, label="KV used %")
        kv.set_ylim(0, 105)
        kv.tick_params(labelsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        twins.append(kv)
    handles = axes[0, 0].get_legend_handles_labels()[0] + twins[0].get_legend_handles_labels()[0]
    axes[0, 0].legend(handles=handles, fontsize=7, loc="upper left", ncol=3)
    axes[-1, 0].set_xlabel("time (s)")
    more = f" (first {len(shown)} of {len(replicas)} replicas)" if len(replicas) > len(shown) else ""
    fig.suptitle((title + more) if title or more else "", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def plan_report_png(entries: Sequence[tuple[str, float, Sequence[tuple[float, Summary]]]], path: str | Path,
                    target: float | None = None, title: str = "") -> Path:
    """A serving plan against its baselines: goodput per dollar (bars), then SLO attainment, TTFT p90 and TPOT
    p90 against the request rate (each plan's simulated runs). ``entries``: (name, goodput per $/h, [(rate,
    summary), ...]), the plan first."""
    if not entries:
        raise FlexmeshError("no plans to compare")
    colors = [plt.get_cmap("tab10")(i) for i in range(10)]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.0))
    names = [n for n, _, _ in entries]
    ax = axes[0]
    ax.barh(range(len(entries)), [g for _, g, _ in entries], color=[colors[i % 10] for i in range(len(entries))])
    ax.set_yticks(range(len(entries)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("goodput per $/h (req/s per dollar-hour)")
    ax.grid(alpha=0.3, axis="x")
    panels = ((axes[1], "SLO attainment", lambda s: s.attainment), (axes[2], "TTFT p90 (ms)",
              lambda s: s.ttft["p90"] * 1e3), (axes[3], "TPOT p90 (ms)", lambda s: s.tpot["p90"] * 1e3))
    for ax, label, value in panels:
        for i, (name, _, pts) in enumerate(entries):
            pts = sorted(pts, key=lambda p: p[0])
            ax.plot([r for r, _ in pts], [value(s) for _, s in pts], marker="o", ms=3, color=colors[i % 10],
                    label=name, lw=1.2 if i == 0 else 0.8)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if label != "SLO attainment":
            ax.set_yscale("log")
        elif target is not None:
            ax.axhline(target, color="#bab0ac", linestyle="--")
    axes[1].legend(fontsize=6)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
