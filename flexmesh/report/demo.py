"""``flexmesh demo``'s report: what was planned, simulated and measured, as markdown with PNGs (what it
trains and the runs' figures: flexmesh.report.runs)."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

import numpy as np

from flexmesh.errors import FlexmeshError
from flexmesh.inputs import load_json
from flexmesh.report.experts import add_demo_section
from flexmesh.report.plots import balance_png, loss_png, predicted_vs_measured_png, timeline_png
from flexmesh.report.report import Report, median_abs_error
from flexmesh.report.runs import run_summary, throughput
from flexmesh.report.stragglers import add_section, has_speed_data, speed_png
from flexmesh.sim.simulation import Simulation, comparison_row


def gain_text(label: str, rows: list[dict], fixed: list[dict], loads: dict[str, float]) -> str:
    """``label``'s tokens/s against ``fixed``'s on the same batches, with what load could do to it: the
    per-step ratios' median and middle half (a gain inside it is noise, said so) and the load average
    as each run started (``loads``: label -> 1-minute load average).

    >>> fixed = [{"step": s, "tokens": 100, "step_time_s": 1.0} for s in range(1, 6)]
    >>> fast = [{"step": s, "tokens": 100, "step_time_s": t} for s, t in enumerate((1, .5, .5, .5, .6), 1)]
    >>> gain_text("hdp", fast, fixed, {})[:62]
    'hdp against fixed: **1.90x** tokens/s on the same batches (fir'
    """
    gain = throughput(rows) / throughput(fixed)
    per_step = [f["step_time_s"] / r["step_time_s"] for r, f in zip(rows[1:], fixed[1:], strict=False)]
    text = f"{label} against fixed: **{gain:.2f}x** tokens/s on the same batches (first step left out as warm-up)"
    if len(per_step) >= 2:
        lo, mid, hi = np.percentile(per_step, [25, 50, 75])
        noisy = lo <= 1.0 <= hi
        text += (f"; step by step {mid:.2f}x (median; middle half {lo:.2f}x to {hi:.2f}x"
                 f"{': the difference is within the run-to-run noise of this machine' if noisy else ''})")
    if loads:
        cores = os.cpu_count() or 1
        text += ("; 1-minute load average as each run started: " + ", ".join(f"{k} {a:.1f}" for k, a in loads.items())
                 + f", on {cores} cores (the demo's own processes count toward it: about their number is the demo "
                 "alone, more is other work sharing the cores, which blurs the comparison)")
    return text + "."


# A median step-time error above this is explained in the report (what the profile and the run met).
EXPLAIN_ERROR = 0.25


def prediction_text(label: str, rows: list[dict], error: float | None, run_load: float | None,
                    profile_load: float | None) -> str | None:
    """Why ``label``'s step times are off their prediction by ``error`` (median), when that is more than
    :data:`EXPLAIN_ERROR`: the pace its fastest rank ran at against the profile (the machine's speed, the
    same on every rank), the simulator's error at that pace (what is left for the schedules and the
    cost model), and the load as the profile was taken and as the run started. None within the bound.

    >>> rows = [{"step": s, "step_time_s": 2.0, "pace": 0.6, "paced_step_time_s": 1.9} for s in range(1, 5)]
    >>> prediction_text("fixed", rows, 0.4, 3.5, 1.2)[:72]
    'fixed: the step times predicted from the profile are off by 40% (median)'
    >>> prediction_text("fixed", rows, 0.1, 3.5, 1.2) is None
    True
    """
    if error is None or error <= EXPLAIN_ERROR:
        return None
    text = f"{label}: the step times predicted from the profile are off by {error:.0%} (median)."
    paces = [r["pace"] for r in rows[1:] if r.get("pace")]
    if paces:
        pace = float(np.median(paces))
        text += (f" Its fastest rank ran at {pace:.2f}x the speed the profile measured (`pace`, median over the steps "
                 f"after the first): every rank's compute is off by about {1 / pace - 1:+.0%} from that alone, "
                 "the machine's speed, not the schedules.")
    paced = [(r["paced_step_time_s"], r["step_time_s"]) for r in rows if r.get("paced_step_time_s")]
    if paced:
        left = median_abs_error([p for p, _ in paced], [m for _, m in paced])
        text += (f" At the speeds measured on the steps before each one, the simulator's step is off by {left:.0%} "
                 "(`paced_step_time_s`): the part the cost model and the schedules answer for.")
    if run_load is not None and profile_load is not None:
        cores = os.cpu_count() or 1
        shared = max(run_load, profile_load) > cores
        text += (f" The 1-minute load average was {profile_load:.1f} as the profile was taken and {run_load:.1f} as "
                 f"the run started, on {cores} cores" + (": above the core count other work shared the cores, so "
                 "the profile, the run or both met a slower machine than the other did." if shared else "."))
    return text


def write_report(out: Path, sim: Simulation, metrics: dict[str, list[dict]], plan_path: Path,
                 elapsed_s: float, stragglers: dict[str, list[dict]] | None = None, devices: str = "",
                 gpu: dict | None = None, mixed: tuple | None = None,
                 loads: dict[str, float] | None = None, experts: dict | None = None,
                 profile_load: float | None = None) -> Path:
    """``sim``: the simulated comparison; ``metrics``: run label -> metrics.jsonl rows; ``stragglers``:
    the static and adaptive runs with a slow rank (flexmesh.report.stragglers.demo_comparison);
    ``devices``: where the parts ran; ``gpu``: the one-GPU run ({"name", "preset", "rows"}), if any;
    ``mixed``: the mixed-cluster plan's figures (flexmesh.report.plan_tables.demo_mixed_plan) and its
    simulated dispatch (flexmesh.commands.simulate.GroupsSimulation); ``loads``: run label -> the 1-minute
    load average as it started; ``experts``: the mixture-of-experts runs (flexmesh.report.experts.demo_experts);
    ``profile_load``: the 1-minute load average as the profile was taken."""
    out = Path(out)
    figs = out / "figures"
    rep = Report("flexmesh demo", out)
    rep.text(f"{datetime.datetime.now().isoformat(timespec='seconds')} on {platform.node()} "
             f"({platform.machine()}, {platform.processor() or 'cpu'}); {elapsed_s:.0f} s up to this report "
             "(the serving part runs after it and gives its own time)."
             + (f" Devices: {devices}." if devices else ""))

    # 1. plan
    plan_file = out / "plan-llama3-8b.json"
    if plan_file.exists():
        plan = load_json(plan_file, FlexmeshError)
        pred = plan.get("predicted", {})
        rep.heading("1. Plan")
        rep.text(f"Best layout for {plan['model']} on {plan['cluster']} (sequences of {plan['seq_len']}, "
                 f"{plan['global_batch']} per step), found by `flexmesh plan`: written to `{plan_file.name}`.")
        rep.table(["predicted step (s)", "tokens/s", "MFU", "peak memory per stage (GiB)"],
                  [[f"{pred.get('step_time_s', float('nan')):.3f}", f"{pred.get('tokens_per_s', 0):,.0f}",
                    f"{pred.get('mfu', 0):.1%}", " ".join(f"{x:.1f}" for x in pred.get("peak_memory_gib", []))]])

    # 2. simulation
    s = sim.setup
    rep.heading("2. Simulated per-step policies")
    rep.text(f"{s['model']} on {s['cluster']}, sequences up to {s['context']} tokens, {s['lengths']} lengths, "
             f"{s['mean_sequences_per_step']:.0f} sequences / {s['mean_tokens_per_step'] / 1e3:.0f}K tokens per step, "
             f"{s['steps']} steps (`flexmesh simulate`).")
    sim_rows = [comparison_row(r)[:-1] for r in sim.runs]  # the simulate command's columns but utilisation
    rep.table(["policy", "kind", "step (s)", "tokens/s", "speedup", "imbalance", "ratio to lower bound",
               "scheduler ms"], sim_rows)
    rep.text(sim.reference() + ".")
    best = max(sim.runs, key=lambda r: r.tokens_per_s)
    for r in (sim.runs[0], best) if best is not sim.runs[0] else (sim.runs[0],):
        for f in sim.plots.get(r.label, []):
            rep.image(f, f"simulated step, {r.label}")

    # 3. measured training
    rep.heading("3. Measured training with per-step schedules")
    summaries = {label: run_summary(rows) for label, rows in metrics.items()}
    table = []
    for label, d in summaries.items():
        table.append([label, ", ".join(d["policies"]), d["steps"], f"{d['step_time_s']:.3f}",
                      f"{d['tokens_per_s']:,.0f}", f"{d['imbalance']:.3f}", d["fallbacks"],
                      "-" if d["predicted_error"] is None else f"{d['predicted_error']:.1%}", f"{d['final_loss']:.4f}"])
    rep.table(["run", "policies used", "steps", "mean step (s)", "tokens/s", "imbalance (busy max/mean)",
               "late schedules (fallback)", "median step-time error", "final loss"], table)
    for label, d in summaries.items():
        if why := prediction_text(label, metrics[label], d["predicted_error"], (loads or {}).get(label), profile_load):
            rep.text(why)
    labels = list(metrics)
    if "fixed" in summaries and len(summaries) > 1:
        other = [x for x in labels if x != "fixed"][0]
        rep.text(gain_text(other, metrics[other], metrics["fixed"], loads or {}))
    rep.image(loss_png({k: ([r["step"] for r in v], [r["loss"] for r in v]) for k, v in metrics.items()},
                       figs / "loss.png"), "loss curves")
    rep.image(balance_png({k: np.array([r["busy_s"] for r in v]) for k, v in metrics.items()}, figs / "balance.png"),
              "per-rank busy time")
    if any(has_speed_data(rows) for rows in metrics.values()):
        rep.image(speed_png(metrics, figs / "speed_runs.png"), "per-rank measured speed and throughput per step")
    for label, rows in metrics.items():
        last = rows[-1]
        rep.image(timeline_png(last["busy_s"], last["step_time_s"], figs / f"timeline_{label}.png",
                               predicted=last.get("predicted_busy_s") or None,
                               title=f"{label}: step {last['step']} as measured"), f"measured step, {label}")
    pred = [(r["predicted_step_time_s"], r["step_time_s"], k) for k, v in metrics.items() for r in v[1:]
            if r.get("predicted_step_time_s")]
    if pred:
        rep.image(predicted_vs_measured_png([p for p, _, _ in pred], [m for _, m, _ in pred], figs / "predicted.png",
                                            labels=[k for _, _, k in pred], title="step time, simulator vs measured"),
                  "predicted vs measured step time")
    if mixed:
        mixed_section(rep, *mixed)
    if stragglers:
        add_section(rep, stragglers, figs, heading="A slow device: static against re-planned schedules")
    if experts:
        add_demo_section(rep, experts, figs)
    if gpu:
        gpu_section(rep, gpu)
    return rep.write()


def mixed_section(rep: Report, plan: dict, dispatch) -> None:  # noqa: ANN001 - a GroupsSimulation
    """The mixed-cluster plan against its baselines, and its fixed shares against per-step dispatch."""
    rep.heading(f"Mixed cluster: {plan['model']} on {plan['cluster']}")
    groups = plan["layout"].splitlines()
    rep.text(f"`flexmesh plan` finds {len(groups)} replica groups ({plan['tokens_per_s']:,.0f} tokens/s predicted, "
             f"searched in {plan['search_seconds']:.1f} s; written to `plan-mixed.json`); against its baselines: "
             + ", ".join(f"{k} {v:.2f}x" for k, v in plan["ratios"].items() if v) + ".")
    rep.table(["replica group"], [[f"`{g}`"] for g in groups])
    s = dispatch.setup
    rep.text(f"`flexmesh simulate --plan plan-mixed.json`: {s['steps']} steps of {s['global_batch']} {s['lengths']} "
             f"documents (truncated to {s['context']} tokens), the plan's fixed shares against each step's documents "
             "dispatched over the groups by predicted time, then packed inside each group.")
    from flexmesh.sim.groups import best_baseline

    base = best_baseline(dispatch.runs)
    rep.table(["schedule", "kind", "tokens/s", "speedup", "ratio to lower bound"],
              [[r.name, r.kind, f"{r.tokens_per_s:,.0f}", f"{r.tokens_per_s / base.tokens_per_s:.2f}x",
                f"{r.ratio_to_bound:.3f}"] for r in dispatch.runs])


def gpu_section(rep: Report, gpu: dict) -> None:
    """The one-GPU run: throughput, the kernels it ran, and the device preset's predicted step against
    the measured one (the first step, which compiles, left out)."""
    rows = gpu["rows"]
    d = run_summary(rows)
    last = rows[-1]
    rep.heading(f"One GPU: {gpu['name']}")
    rep.text(f"The demo's model trained by one process on {gpu['name']} in {last.get('dtype', 'bf16')}, attention "
             f"`{last.get('attention_kernel') or '?'}`, micro-batches of up to {last.get('microbatch_tokens') or '?'} "
             f"tokens; predicted by the {gpu['preset'] or 'A100-80GB (no preset for this GPU)'} device preset. The "
             f"first step ({rows[0]['step_time_s']:.1f} s) compiles and is left out.")
    rep.table(["steps", "mean step (s)", "tokens/s", "median step-time error", "peak memory (GiB)", "final loss"],
              [[d["steps"], f"{d['step_time_s']:.3f}", f"{d['tokens_per_s']:,.0f}",
                "-" if d["predicted_error"] is None else f"{d['predicted_error']:.1%}",
                f"{last.get('peak_memory_gib') or 0:.2f}", f"{d['final_loss']:.4f}"]])
