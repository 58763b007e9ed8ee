"""The serving part of ``flexmesh demo``: plan a deployment on a mixed GPU catalogue, simulate it, run its layout
on this machine (its replicas as CPU engines of the tiny model behind flexmesh's router), and put what was
measured beside what the simulator predicts for the same requests; a page of the report (``serving.md``) with
its plots, linked from the report.

The plan is Llama 3.1 8B on one H100 and four L4s for the Azure conversation trace at 15 requests per second
(``flexmesh serve plan``); its simulation is ``flexmesh serve simulate --plan``. The local run maps each of its
replicas to one engine process here (``serve run --plan --map-to-cpu``: this machine's timings, not the GPUs'),
replays a window of the same trace scaled to the tiny model's context, and predicts the replay with the engines'
twin priced by a fit to their own iterations (flexmesh.profile.iteration.replay_profile).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from flexmesh.files import append_file, make_folder, write_atomic, write_atomic_with

MODEL, CLUSTER, RATE, SLO = "llama3.1-8b", "1x1xH100+1x4xL4", 15, "ttft=1s,tpot=60ms"
LOCAL_MODEL, LOCAL_CONTEXT = "tiny", 4096


def _flexmesh(argv: list[str]) -> str:
    from flexmesh.runtime.launch import run_flexmesh

    return run_flexmesh(argv, f"demo step 'flexmesh {argv[0]} {argv[1]}'", timeout=600).stdout


def demo_serving(out: Path, report: Path, console, quick: bool = False) -> Path:
    """Run the serving part (see the module doc) into ``out/serving``; its page is linked from ``report``."""
    from rich.rule import Rule

    t0 = time.perf_counter()
    folder = out / "serving"
    make_folder(folder, root=out)
    console.print(Rule(f"serving: plan {MODEL} on {CLUSTER} at {RATE} req/s, simulate it, run its layout here"))
    plan_path = folder / "plan.json"
    _flexmesh(["serve", "plan", "--model", MODEL, "--cluster", CLUSTER, "--trace", "azure-conv", "--requests", "300",
               "--rate", str(RATE), "--slo", SLO, "--no-simulate", "--out", str(folder / "planned")])
    write_atomic(plan_path, (folder / "planned" / "plan.json").read_text(), root=folder)
    sim = json.loads(_flexmesh(["serve", "simulate", "--plan", str(plan_path), "--window", "0:300", "--json",
                                "--out", str(folder / "simulated")]))
    measured, predicted, layout = _run_here(plan_path, folder, 30 if quick else 60)
    page = _page(folder, plan_path, sim, measured, predicted, layout, time.perf_counter() - t0)
    with append_file(report) as f:
        f.write(f"\n## Serving\n\n{_summary(measured, predicted, layout)} The page: [serving](serving/{page.name}).\n")
    console.print(f"serving: {page} ({time.perf_counter() - t0:.0f} s)", highlight=False)
    return page


def _run_here(plan_path: Path, folder: Path, requests: int):
    """The plan's replicas as CPU engines here, a window replayed, and the twin's prediction of it."""
    from flexmesh.data.requests import at_rate, load_trace, scale_to_context, window
    from flexmesh.profile.iteration import ProfiledIterationTiming, replay_profile
    from flexmesh.serve.engine.config import EngineConfig
    from flexmesh.serve.engine.local import plan_engines
    from flexmesh.serve.engine.processes import running_fleet
    from flexmesh.serve.engine.replay import replay_rates
    from flexmesh.serve.engine.twin import twin_fleet
    from flexmesh.serve.layout.plan import load_plan

    plan = load_plan(plan_path)
    base = EngineConfig(model=LOCAL_MODEL, num_blocks=1024)
    local = plan_engines(plan, base, LOCAL_MODEL, map_to_cpu=True)
    # The plan's GPU-sized batches, capped to what a CPU engine of the tiny model turns around in time.
    cfgs = [replace(c, max_requests_per_batch=min(c.max_requests_per_batch, 8),
                    max_batch_tokens=min(c.max_batch_tokens, 256)) for c in local.configs]
    caps = [c.max_requests_per_batch for c in cfgs]
    table = local.table
    win = window(scale_to_context(load_trace("azure-conv"), LOCAL_CONTEXT), 0.0, first=requests)
    load = at_rate(win, 3.0 * len(cfgs))

    async def main():
        async with running_fleet(cfgs, len(cfgs), folder / "logs", folder / "requests.jsonl", route="plan",
                                 table=table, max_running=caps, context=LOCAL_CONTEXT) as (url, engines):
            return await replay_rates(url, [(load.rate, load)], [e.url for e in engines])

    run = asyncio.run(main())[0]
    timing = ProfiledIterationTiming(replay_profile(run.iterations))
    twin = twin_fleet(cfgs, len(cfgs), timing, caps)
    sim = twin.run(load, router="plan", routing=table)
    layout = f"{len(cfgs)} CPU engines of {LOCAL_MODEL} for {plan.layout}"
    return run.replay.records, sim.records, layout


def _summary(measured, predicted, layout: str) -> str:
    from flexmesh.serve.metrics import summarize

    m, p = summarize(measured), summarize(predicted)
    return (f"The plan's layout ran here as {layout}: {m.requests} requests, TTFT p50 {m.ttft['p50'] * 1e3:,.0f} ms "
            f"measured / {p.ttft['p50'] * 1e3:,.0f} ms predicted, E2E p50 {m.e2e['p50']:.2f} / {p.e2e['p50']:.2f} s.")


def _page(folder: Path, plan_path: Path, sim: dict, measured, predicted, layout: str, seconds: float) -> Path:
    """``serving.md``: the plan, its simulation, the local run measured beside predicted, two plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flexmesh.serve.metrics import summarize

    plan = json.loads(plan_path.read_text())
    lines = ["# Serving: planned, simulated, run here", "",
             f"`flexmesh serve plan` for {MODEL} on {CLUSTER} (the Azure 2023 conversation trace at {RATE} req/s, "
             f"SLO {SLO}): the plan's replica groups:", "", "| device | replicas | tp | role | max_seqs | "
             "max_batched_tokens |", "|---|---|---|---|---|---|"]
    for g in plan["groups"]:
        lines.append(f"| {g['device']} | {g['replicas']} | {g['tp']} | {g['role']} | {g['engine']['max_seqs']} | "
                     f"{g['engine']['max_batched_tokens']} |")
    runs = sim.get("runs") or []
    if runs:
        s = runs[0]["summary"] if "summary" in runs[0] else runs[0]
        lines += ["", f"Simulated (`flexmesh serve simulate --plan`, the trace's first 300 s): TTFT p50 "
                      f"{s['ttft']['p50'] * 1e3:,.0f} ms, TPOT p50 {s['tpot']['p50'] * 1e3:,.1f} ms, E2E p50 "
                      f"{s['e2e']['p50']:.2f} s."]
    m, p = summarize(measured), summarize(predicted)
    lines += ["", f"Run here: {layout} (its GPUs mapped to CPU engines: this machine's timings), routed by the plan's "
                  "table; predicted by the engines' twin priced by a fit to their own iterations.", "",
              "| | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | E2E p50 s | per-token ms |", "|---|---|---|---|---|---|"]
    for name, x in (("measured", m), ("predicted", p)):
        lines.append(f"| {name} | {x.ttft['p50'] * 1e3:,.0f} | {x.ttft['p90'] * 1e3:,.0f} | "
                     f"{x.tpot['p50'] * 1e3:,.1f} | {x.e2e['p50']:.2f} | {x.per_token['mean'] * 1e3:,.1f} |")
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, recs in (("measured", measured), ("predicted", predicted)):
        e2e = np.sort([r.e2e_s for r in recs])
        a.plot(e2e, np.arange(1, len(e2e) + 1) / len(e2e), label=name)
    a.set_xlabel("E2E latency (s)")
    a.set_ylabel("fraction of requests")
    a.legend()
    a.set_title("latency, measured and predicted")
    by_id = {r.id: r for r in predicted}
    pairs = [(r.ttft_s, by_id[r.id].ttft_s) for r in measured if r.id in by_id]
    if pairs:
        xs, ys = [m for m, _ in pairs], [q for _, q in pairs]
        b.scatter(xs, ys, s=10)
        top = max(max(xs), max(ys)) * 1.05
        b.plot([0, top], [0, top], color="gray", linewidth=0.8)
    b.set_xlabel("measured TTFT (s)")
    b.set_ylabel("predicted TTFT (s)")
    b.set_title("per request")
    fig.tight_layout()
    png = folder / "measured_vs_predicted.png"
    write_atomic_with(png, lambda tmp: fig.savefig(tmp, dpi=100, format="png"), root=folder)
    plt.close(fig)
    lines += ["", f"![measured beside predicted]({png.name})", ""]
    timeline = folder / "simulated" / "timeline.png"
    if timeline.exists():
        lines += [f"![the plan simulated: each replica's queue, batch and KV]({timeline.relative_to(folder)})", ""]
    lines.append(f"({seconds:.0f} s for this part.)")
    page = folder / "serving.md"
    write_atomic(page, "\n".join(lines) + "\n", root=folder)
    return page
