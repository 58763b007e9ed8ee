"""A slow rank, static against re-planned schedules: the measured comparison, its figures and its plot.

:func:`run_comparison` trains the same plan twice with ``flexmesh train`` on 2 processes, one rank
emulated at a fraction of its speed (``--emulate-speed``, emulation on one machine, not a slow
device): ``static`` keeps the schedules (``--no-replan``: speeds measured, nothing changed),
``adaptive`` re-plans them when the slowdown is sustained (flexmesh.runtime.train.stragglers). Same
plan, corpus, seed (so the same batches and initial weights), policy and flags otherwise.
:func:`comparison_summary` reads the two metrics.jsonl files: tokens/s after recovery (the steps
from the first one run on a re-planned schedule to the end, the same steps of both runs), steps
until recovery, and the simulator's predicted step time against the measured one on those steps
of the adaptive run (the simulator then knows the measured relative speeds): the schedule's own
prediction (the profile as taken) and the trainer's (``paced_step_time_s``, every rank at its speed
against the profile measured on the steps before, flexmesh.runtime.train.stragglers: a profile taken
while the machine ran faster or slower is off by one factor on every rank; relative speeds cancel
it, absolute step times do not). :func:`speed_png` draws each
rank's measured speed and each run's throughput per step, events marked; :func:`add_section`
puts all of it in a report. Used by ``flexmesh demo`` and bench/stragglers_measured.py.

>>> rows = [{"step": s, "tokens": 100, "step_time_s": 2.0 if s < 3 else 1.0, "speed": [1.0, 0.5],
...          "predicted_step_time_s": 1.1, "events": [{"event": "replanned"}] if s == 2 else []}
...         for s in (1, 2, 3, 4)]
>>> static = [dict(r, step_time_s=2.0, events=[]) for r in rows]
>>> d = comparison_summary({"static": static, "adaptive": rows})
>>> d["recovery_step"], d["adaptive_tokens_per_s"], d["static_tokens_per_s"], d["speedup"]
(3, 100.0, 50.0, 2.0)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402

from flexmesh.errors import FlexmeshError  # noqa: E402
from flexmesh.files import make_folder  # noqa: E402
from flexmesh.report.report import Report, median_abs_error  # noqa: E402
from flexmesh.sim.plots import save_figure  # noqa: E402

RUNS = {"static": ["--no-replan"], "adaptive": []}
EVENT_STYLE = {"straggler_detected": ("#e15759", "detected"), "replanned": ("#2b7bba", "re-planned"),
               "speed_changed": ("#f28e2b", "speed changed"),
               "straggler_recovered": ("#59a14f", "recovered"), "replan_declined": ("#bab0ac", "declined"),
               "speed_noise": ("#bab0ac", "load noise, not judged")}


def has_speed_data(rows: Sequence[dict]) -> bool:
    """Whether metrics rows carry measured speeds (runs from before speeds were measured do not)."""
    return any(r.get("speed") for r in rows)


def run_comparison(out: Path, plan: Path, *, corpus: str = "stdlib", steps: int, global_batch: int, seq_len: int,
                   seed: int = 0, slow: Mapping[int, float] | None = None, extra: Sequence[str] = (),
                   timeout_s: float = 1800, say: Callable[[str], None] | None = None) -> dict[str, list[dict]]:
    """Train ``plan`` as ``static`` and as ``adaptive`` (see the module doc) into ``out/<label>``; the
    rows of each run's metrics.jsonl. ``slow``: rank -> emulated speed factor (default {1: 0.5});
    ``extra``: further ``flexmesh train`` flags for both runs (profiles, policy, tokenizer); ``say``: told a
    line as each run ends (:func:`~flexmesh.report.runs.run_line`)."""
    from flexmesh.report.runs import read_metrics, run_line
    from flexmesh.runtime.launch import run_flexmesh

    slow = dict(slow or {1: 0.5})
    emulate = ",".join(f"{r}={f:g}" for r, f in slow.items())
    metrics = {}
    for label, flags in RUNS.items():
        run_dir = Path(out) / label
        argv = ["train", "--plan", str(plan), "--corpus", corpus, "--max-steps", str(steps), "--out", str(run_dir),
                "--nproc", "2", "--overwrite", "--no-progress", "--seed", str(seed), "--global-batch",
                str(global_batch), "--seq-len", str(seq_len), "--slow", emulate, *extra, *flags]
        run_flexmesh(argv, f"the {label} run", timeout=timeout_s)
        metrics[label] = read_metrics(run_dir / "metrics.jsonl")
        if say:
            say(run_line(label, metrics[label]))
    got = {k: [r["tokens"] for r in v] for k, v in metrics.items()}
    if got["static"] != got["adaptive"]:
        raise FlexmeshError(f"the two runs trained different batches (tokens per step {got})")
    return metrics


def comparison_summary(metrics: Mapping[str, Sequence[dict]]) -> dict:
    """Figures of a static / adaptive pair (see the module doc); ``recovery_step`` is None when the
    adaptive run never re-planned, and throughput is then over the steps after the first."""
    static, adaptive = metrics["static"], metrics["adaptive"]
    replans = [r["step"] for r in adaptive if any(e["event"] == "replanned" for e in r.get("events", ()))]
    recovery = replans[0] + 1 if replans and replans[0] < adaptive[-1]["step"] else None
    first = recovery if recovery is not None else min(2, adaptive[-1]["step"])

    def after(rows: Sequence[dict]) -> list[dict]:
        return [r for r in rows if r["step"] >= first]

    def tput(rows: Sequence[dict]) -> float:
        return sum(r["tokens"] for r in rows) / sum(r["step_time_s"] for r in rows)

    a, s = after(adaptive), after(static)
    pred = [(r["predicted_step_time_s"], r["step_time_s"]) for r in a if r.get("predicted_step_time_s")]
    paced = [(r["paced_step_time_s"], r["step_time_s"]) for r in a if r.get("paced_step_time_s")]
    paces = [r["pace"] for r in adaptive[1:] if r.get("pace")]  # the first step pays one-off costs
    return {
        "recovery_step": recovery,
        "steps_until_recovery": None if recovery is None else recovery - 1,  # steps run on the old schedule
        "steps_after": len(a),
        "adaptive_tokens_per_s": tput(a), "static_tokens_per_s": tput(s), "speedup": tput(a) / tput(s),
        "adaptive_step_s": float(np.mean([r["step_time_s"] for r in a])),
        "static_step_s": float(np.mean([r["step_time_s"] for r in s])),
        "predicted_step_s": float(np.mean([p for p, _ in pred])) if pred else None,
        "predicted_error": median_abs_error([p for p, _ in pred], [m for _, m in pred]) if pred else None,
        "pace": float(np.median(paces)) if paces else None,
        "paced_error": median_abs_error([p for p, _ in paced], [m for _, m in paced]) if paced else None,
        "events": [(r["step"], e) for r in adaptive for e in r.get("events", ())],
    }


def speed_png(runs: Mapping[str, Sequence[dict]], path: str | Path,
              title: str = "per-rank speed and throughput") -> Path:
    """One panel per run with speed data: each rank's measured speed (relative to the fastest; solid)
    and the speed its schedule assumed (dashed), per step; a last panel: tokens/s per step of every
    run. Events (straggler detected, re-planned, recovered) are vertical lines at their step."""
    with_speed = {k: v for k, v in runs.items() if has_speed_data(v)}
    fig, axes = plt.subplots(len(with_speed) + 1, 1, figsize=(8, 2.4 * (len(with_speed) + 1)), sharex=True,
                             squeeze=False)
    for ax, (label, rows) in zip(axes[:-1, 0], with_speed.items(), strict=True):
        steps = [r["step"] for r in rows]
        ranks = len(rows[0]["speed"])
        for k in range(ranks):
            line, = ax.plot(steps, [np.nan if r["speed"][k] is None else r["speed"][k] for r in rows], marker="o",
                            markersize=3, linewidth=1.2, label=f"rank {k}")
            if rows[0].get("assumed_speed"):
                ax.plot(steps, [r["assumed_speed"][k] for r in rows], linestyle="--", linewidth=1,
                        color=line.get_color())
        emulated = rows[0].get("emulated_speed") or []
        note = ", ".join(f"rank {k} emulated at {f:g}" for k, f in enumerate(emulated) if f < 1.0)
        _mark_events(ax, rows)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("speed")
        ax.set_title(f"{label}: measured (solid), scheduled for (dashed)" + (f"; {note}" if note else ""),
                     fontsize=9, loc="left")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, frameon=False, loc="lower right")
    ax = axes[-1, 0]
    for label, rows in runs.items():
        ax.plot([r["step"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", markersize=3,
                linewidth=1.2, label=label)
        _mark_events(ax, rows)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return save_figure(fig, path)


def _mark_events(ax, rows: Sequence[dict]) -> None:
    """A vertical line per event, between its step and the next (it was decided after its step)."""
    seen = set(ax.get_legend_handles_labels()[1])
    for r in rows:
        for e in r.get("events", ()):
            color, name = EVENT_STYLE.get(e["event"], ("black", e["event"]))
            ax.axvline(r["step"] + 0.5, color=color, linestyle=":", linewidth=1.2,
                       label=None if name in seen else name)
            seen.add(name)


def add_section(rep: Report, metrics: Mapping[str, Sequence[dict]], figures: Path, heading: str | None = None) -> None:
    """The static / adaptive comparison in ``rep``: a table, the events and the speed plot."""
    d = comparison_summary(metrics)
    factor = min(metrics["adaptive"][0].get("emulated_speed") or [1.0])
    if heading:
        rep.heading(heading)
    rep.text("Two processes of this machine, one rank's compute **emulated** "
             + (f"at {factor:g}x speed " if factor < 1.0 else "slower ")
             + "(`--slow`), the same batches and initial weights: `static` keeps its schedules "
             "(`--no-replan`), `adaptive` measures every rank's speed each step and re-plans the per-step "
             "schedules once the slowdown is sustained (no restart).")
    when = "never re-planned" if d["recovery_step"] is None else (
        f"re-planned schedules from step {d['recovery_step']} ({d['steps_until_recovery']} steps on the old ones)")
    err = "-" if d["predicted_error"] is None else f"{d['predicted_error']:.1%}"
    rep.table(["run", f"tokens/s (steps {d['recovery_step'] or 2}+)", "mean step (s)", "speedup"],
              [["static", f"{d['static_tokens_per_s']:,.0f}", f"{d['static_step_s']:.3f}", "1.00x"],
               ["adaptive", f"{d['adaptive_tokens_per_s']:,.0f}", f"{d['adaptive_step_s']:.3f}",
                f"{d['speedup']:.2f}x"]])
    paced = "-" if d["paced_error"] is None else f"{d['paced_error']:.1%}"
    pace = "" if d["pace"] is None else f"; the machine ran at {d['pace']:.2f} of its profile"
    rep.text(f"adaptive: {when}; on those steps the trainer's predicted step time (each rank at its speed measured "
             f"on the steps before) is {paced} off the measured one (median), the profile as taken {err}{pace}. "
             "Events: " + ("; ".join(f"after step {s}: {e['event']} " + ", ".join(
                 f"{k} {e[k]}" for k in ("ranks", "speeds", "predicted_gain") if k in e)
                 for s, e in d["events"]) or "none") + ".")
    rep.image(speed_png(metrics, Path(figures) / "speed.png"), "per-rank speed and throughput per step")


def demo_comparison(out: Path, hardware: Path, model: Path, *, steps: int, global_batch: int, seq_len: int,
                    seed: int = 0, factor: float = 0.5, device: str = "auto", corpus: str = "stdlib",
                    say: Callable[[str], None] | None = None) -> dict[str, list[dict]]:
    """``flexmesh demo``'s straggler part: the demo's model on 2 processes, rank 1 emulated at
    ``factor``, static against adaptive (:func:`run_comparison`) with the ``balanced`` policy on
    one-rank groups, priced by the demo's profiles, on ``device`` (``flexmesh train --device``) and ``corpus``; runs go
    to ``out/runs/static`` and ``out/runs/adaptive``; ``say`` as :func:`run_comparison`'s."""
    from flexmesh.report.runs import training_plan

    out = make_folder(out)
    plan_path = out / "plan-2.json"
    training_plan(2, seq_len, global_batch).save(plan_path)
    flags = ["--policy", "balanced", "--cp", "1", "--hardware-profile", str(hardware), "--model-profile", str(model),
             "--device", device]
    return run_comparison(out / "runs", plan_path, corpus=corpus, steps=steps, global_batch=global_batch,
                          seq_len=seq_len, seed=seed, slow={1: factor}, extra=flags, say=say)
