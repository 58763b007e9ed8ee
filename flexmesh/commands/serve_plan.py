"""``flexmesh serve plan``: the cheapest deployment that meets the SLO on the GPUs one can get.

Prices every replica configuration (device type, tp x pp, role, engine knobs) per length bucket of the
workload, solves the deployment MILP (replica counts, routing per bucket, prefill-to-decode hand-offs over
the links, availability, budget), scores the candidates in the simulator, repairs the best by local moves,
and writes the serving plan; optionally against its baselines (best single GPU type, Mélange-style,
DistServe-style, one type per phase, round-robin), each scored by the same simulator. ``--check PLAN``
validates a plan file. See docs/serve-plan.md and docs/cli-serve.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from flexmesh.commands.args import (
    DEFAULT_CLUSTER,
    DefaultsHelpFormatter,
    folder,
    given_flags,
    nonempty,
    positive_float,
    positive_fraction,
)
from flexmesh.commands.args import positive_int as whole_positive
from flexmesh.console import plain_console
from flexmesh.cost.device.hardware import unmeasured_notes
from flexmesh.cost.inference.band import Band, bands_label, part_bands
from flexmesh.cost.inference.memory import kv_capacity
from flexmesh.cost.inference.overhead import parse_overhead
from flexmesh.data.requests import Workload, at_rate, load_trace, scale_to_context, window, with_arrivals
from flexmesh.errors import SpecError
from flexmesh.files import make_folder, write_atomic
from flexmesh.serve.layout.engine import engine_spec
from flexmesh.serve.layout.engine import presets as engine_presets
from flexmesh.serve.layout.plan import ServingPlan, load_plan, save_plan
from flexmesh.serve.layout.quality import QualityCurve, parse_quality
from flexmesh.serve.layout.roles import Role
from flexmesh.serve.layout.slo import doubts, parse_slo
from flexmesh.serve.plan.baselines import Baseline, all_baselines, ratio
from flexmesh.serve.plan.capacity import Pricing, ReplicaConfig
from flexmesh.serve.plan.cascade import plan_cascade, single_models
from flexmesh.serve.plan.check import check_plan
from flexmesh.serve.plan.planner import PlanInputs, PlanResult
from flexmesh.serve.plan.score import Score, band_scores
from flexmesh.serve.plan.search import REPAIR_ROUNDS, plan
from flexmesh.serve.plan.why import why_mix
from flexmesh.serve.plan.workload import bucket_workload, buckets_from_trace, parse_buckets
from flexmesh.spec.cluster import parse_mixed_cluster
from flexmesh.spec.model import parse_model
from flexmesh.spec.prices import gpu_prices, parse_price_overrides

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

SERVE_MODEL = "llama3.1-8b"
# Requests of the trace the plans are scored on (its first ones, their arrival times scaled to each rate).
SCORE_REQUESTS = 3000


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="plan the cheapest deployment that meets an SLO on the GPUs one can get",
                       description=__doc__.split("\n\n")[1], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--check", metavar="PLAN", help="validate a serving plan file (one line per error) and exit")
    p.add_argument("--model", type=nonempty,
                   default=SERVE_MODEL, help="model preset, gpt:L:H:A, or a Hugging Face config.json")
    c = p.add_argument_group("cascade (two models in order; the quality curve is yours)")
    c.add_argument("--cascade", metavar="M1,M2", help="plan a cascade of these two models instead of --model")
    c.add_argument("--quality", metavar="F:Q,...", help="the cascade's quality against the escalated fraction, e.g. "
                   "0:0.66,0.5:0.78,1:0.8")
    c.add_argument("--quality-target", type=float, metavar="Q", help="the quality the cascade must reach")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER, type=nonempty,
                   help="the devices one can get: NODESxPERNODExDEVICE groups joined by '+', or a cluster file")
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default="azure-conv", help="azure-conv, azure-code, mooncake, or a CSV/JSONL file")
    w.add_argument("--buckets", metavar="P:O=SHARE,...", help="length buckets instead of a trace (synthetic Poisson "
                   "arrivals for the simulator), e.g. 512:128=0.75,4096:256=0.25")
    w.add_argument("--block-tokens", type=whole_positive, default=None, metavar="N",
                   help="tokens per prefix block id of a plain trace")
    w.add_argument("--window", metavar="START:END", help="only the trace's requests arriving in [START, END) s")
    w.add_argument("--requests", type=whole_positive, default=SCORE_REQUESTS, metavar="N",
                   help="requests the plans are scored on (the trace's first ones)")
    w.add_argument("--fit-context", action="store_true", help="scale lengths so the longest fits the context")
    w.add_argument("--prompt-edges", metavar="T,...", help="bucket edges in prompt tokens (default: powers of two "
                   "from 256, small buckets merged)")
    w.add_argument("--output-edges", metavar="T,...", help="also split buckets by output tokens (routes by the "
                   "trace's output lengths: an oracle)")
    g = p.add_argument_group("objective (one of)")
    g.add_argument("--budget", type=positive_float, metavar="USD_PER_HOUR", help="the most goodput within this")
    g.add_argument("--rate", type=positive_float, metavar="REQ_PER_S", help="the cheapest plan serving this rate")
    g.add_argument("--per-dollar", action="store_true", help="with --budget: the most goodput per $/h within it "
                   "(whole replicas leave some plans a few dollars unspent) rather than the most goodput")
    s = p.add_argument_group("SLO, prices, engine")
    s.add_argument("--slo", default="ttft=2s,tpot=100ms", help="bounds each request should meet (ttft, tpot, e2e)")
    s.add_argument("--attainment", type=positive_fraction, default=0.9, help="fraction of requests meeting the SLO")
    s.add_argument("--prices", metavar="FILE", help="GPU prices (TOML/JSON, as flexmesh/spec/presets/prices.toml)")
    s.add_argument("--price", metavar="DEVICE=USD,...", help="GPU prices per GPU-hour, overriding the presets")
    s.add_argument("--engine", metavar="NAME|FILE", help="the engine the replicas run: a preset (" +
                   ", ".join(engine_presets()) + ") or a .toml/.json description (docs/engines.md) (default: vllm)")
    s.add_argument("--engine-overhead", metavar="PRESET|MS[,MS]", help="per-iteration engine overhead in place of the "
                   "engine's: a preset or FIXED_MS[,PER_REQUEST_MS]")
    r = p.add_argument_group("search")
    r.add_argument("--repair", type=int, default=REPAIR_ROUNDS, metavar="N",
                   help="rounds of local moves judged by the simulator (0: none)")
    r.add_argument("--no-simulate", action="store_true", help="the MILP's plan only, not scored by the simulator")
    r.add_argument("--baselines", action="store_true", help="also plan and score the baselines")
    o = p.add_argument_group("output")
    o.add_argument("--explain", action="store_true", help="say why: each group's capacity per bucket and its load")
    o.add_argument("--json", action="store_true", help="print JSON instead of tables")
    o.add_argument("--out", type=folder, metavar="DIR", help="write plan.json, report.md and report.png here")
    p.set_defaults(func=run)
    return p


@dataclass(frozen=True)
class PlanJob:
    """The command line resolved."""

    inputs: PlanInputs
    workload: Workload | None  # what the plans are scored on (None: --no-simulate)
    workload_at: Callable[[float], Workload] | None
    quality: QualityCurve | None
    quality_target: float | None
    repair: int
    baselines: bool


def _ints(text: str | None, what: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        vals = ()
    if not vals or any(v < 1 for v in vals) or any(b <= a for a, b in zip(vals, vals[1:])):
        raise SpecError(f"{what} {text!r} is not a rising list of whole token counts (e.g. 512,2048,8192)")
    return vals


def resolve(args: argparse.Namespace) -> PlanJob:
    models = tuple(m.strip() for m in args.cascade.split(",")) if args.cascade else (args.model,)
    if args.cascade and (len(models) != 2 or args.quality is None or args.quality_target is None):
        raise SpecError("--cascade takes two models (M1,M2) and needs --quality and --quality-target")
    if not args.cascade and (args.quality or args.quality_target is not None):
        raise SpecError("--quality and --quality-target describe a cascade; give --cascade M1,M2")
    specs = [parse_model(m) for m in models]
    if (args.budget is None) == (args.rate is None):
        raise SpecError("give one objective: --budget USD_PER_HOUR (the most goodput within it) or --rate REQ_PER_S "
                        "(the cheapest plan serving it)")
    if args.per_dollar and args.budget is None:
        raise SpecError("--per-dollar weighs goodput against a --budget; with --rate the cheapest plan is asked for "
                        "already: drop --per-dollar or give --budget")
    slo = parse_slo(args.slo)
    for doubt in doubts(slo):
        print(f"note: {doubt}", file=sys.stderr)
    cluster = parse_mixed_cluster(args.cluster)
    table = gpu_prices(args.prices, parse_price_overrides(args.price) if args.price else None)
    missing = sorted({g.device.name for g in cluster.groups} - set(table))
    if missing:
        raise SpecError(f"no price for {', '.join(missing)}; give --price DEVICE=USD_PER_GPU_HOUR")
    prices = {g.device.name: table[g.device.name].usd_per_hour for g in cluster.groups}
    workload: Workload | None
    record: dict
    if args.buckets:
        given = {"--trace": args.trace != "azure-conv", "--window": args.window, "--fit-context": args.fit_context,
                 "--prompt-edges": args.prompt_edges, "--output-edges": args.output_edges,
                 "--block-tokens": args.block_tokens}
        beside = given_flags(given)
        if beside:
            raise SpecError(f"--buckets gives the lengths itself; {beside[0]} shapes a trace's: drop one of them")
        buckets = parse_buckets(args.buckets)
        rate = args.rate or 10.0
        workload = bucket_workload(buckets, rate, args.requests)
        record = {"buckets": args.buckets, "requests": args.requests}
    else:
        base = load_trace(args.trace, args.block_tokens or 0)
        if args.window:
            lo, sep, hi = args.window.partition(":")
            try:
                start, end = float(lo or 0), float(hi) if hi else math.inf
            except ValueError:
                sep = ""
            if not sep:
                raise SpecError(f"--window {args.window!r} is not START:END in seconds (e.g. 0:600)")
            base = window(base, start, end)
        named = base.name
        base = window(base, first=args.requests)
        base = replace(base, name=f"{named} (first {len(base):,} requests)")
        if args.fit_context:
            base = scale_to_context(base, min(m.max_position for m in specs))
        for note in base.notes:
            print(f"note: {note}", file=sys.stderr)
        if base.timed and base.rate <= 0:
            raise SpecError(f"the trace {base.name!r} has no arrival rate to scale; give --buckets instead")
        workload = base
        buckets = buckets_from_trace(base, _ints(args.prompt_edges, "--prompt-edges"),
                                     _ints(args.output_edges, "--output-edges") or (), args.attainment)
        record = {"trace": args.trace, "window": args.window, "requests": len(base),
                  "fit_context": bool(args.fit_context)}
    w = workload
    if args.buckets:
        def workload_at(r: float) -> Workload:
            return bucket_workload(buckets, r, args.requests)
    elif w is not None and not w.timed:  # a trace without arrival times: Poisson arrivals at each rate
        def workload_at(r: float) -> Workload:
            return with_arrivals(w, r)
    else:
        def workload_at(r: float) -> Workload:
            return at_rate(w, r)
    quality = parse_quality(args.quality) if args.quality else None
    inputs = PlanInputs(models, args.cluster, buckets, slo, prices, args.attainment, args.budget, args.rate,
                        (1.0,) * len(models) if not args.cascade else (1.0, 0.0),
                        overhead=parse_overhead(args.engine_overhead) if args.engine_overhead else None,
                        workload=record, per_dollar=args.per_dollar, engine=engine_spec(args.engine))
    if args.repair < 0:
        raise SpecError(f"--repair {args.repair} is not a number of rounds >= 0")
    return PlanJob(inputs, None if args.no_simulate else workload, None if args.no_simulate else workload_at,
                   quality, args.quality_target, args.repair, args.baselines)


def run(args: argparse.Namespace) -> int:
    if args.check:
        return _check(args)
    job = resolve(args)
    err = plain_console(stderr=True)
    # progress in a terminal: one status line, replaced as the work goes on and gone at the end (what it said
    # of the repair is in the output once)
    with err.status("planning", spinner="line") if err.is_terminal else contextlib.nullcontext() as status:
        say = status.update if status is not None else (lambda text: None)
        return _planned(args, job, say)


def _planned(args: argparse.Namespace, job: PlanJob, say: Callable[[str], None]) -> int:
    cascade = None
    single: PlanResult | None = None
    if job.quality is not None:
        assert job.quality_target is not None
        cascade = plan_cascade(job.inputs, job.quality, job.quality_target, job.workload_at, repair=job.repair,
                               progress=say)
        result = cascade.result
        alone = single_models(job.quality, job.quality_target, job.inputs.models)
        if alone:
            single = plan(replace(job.inputs, models=(alone[-1],), tiers=(1.0,)), job.workload_at, repair=job.repair,
                          progress=say)
    else:
        result = plan(job.inputs, job.workload_at, repair=job.repair, progress=say)
    baselines: list[Baseline] = []
    if job.baselines:
        if job.workload_at is None or result.score is None or result.planner is None:
            raise SpecError("--baselines are scored by the simulator; drop --no-simulate")
        if cascade is not None:
            raise SpecError("--baselines compare single-model plans; a cascade is compared with its best single "
                            "model already")
        say("planning and scoring the baselines")
        baselines = all_baselines(result.planner, result.plan, result.score, job.workload_at, result.candidates,
                                  progress=say)
    band = None
    if job.workload_at is not None and result.score is not None:
        say("scoring the plan at its parts' price bands")
        band = band_scores(result.plan, job.workload_at, result.score,
                           result.planner.overhead if result.planner is not None else None)
    doc = _document(job, result, baselines, cascade, single, band)
    if args.out:
        _write(Path(args.out), job, result, baselines, single, doc)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    out = plain_console()
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = max(out.width, 132)
    _print(out, job, result, baselines, cascade, single, args.explain, band)
    return 0


# ---- --check ------------------------------------------------------------------------------------------------
def _check(args: argparse.Namespace) -> int:
    given = {"--rate": args.rate, "--budget": args.budget, "--buckets": args.buckets, "--cascade": args.cascade,
             "--per-dollar": args.per_dollar, "--window": args.window}
    named = given_flags(given)
    if named:
        raise SpecError(f"--check validates a plan file as it is; {named[0]} asks for a new plan: drop it (serve "
                        "simulate --plan FILE --rate R scores the plan at another rate)")
    plan_ = load_plan(args.check)
    notes = check_plan(plan_)
    out = plain_console()
    out.print(f"{args.check}: a valid serving plan of {', '.join(plan_.models)} on {plan_.cluster}: {plan_.layout} "
              f"(${plan_.dollars_per_hour:,.2f}/h)")
    for n in notes:
        out.print(f"note: {n}")
    if args.explain:
        _explain(out, plan_)
    return 0


def _explain(console: Console, p: ServingPlan, planned: PlanResult | None = None) -> None:
    """Each replica group's capacity per bucket (one replica, at the SLO) and the share of the bucket it takes."""
    models = p.model_specs()
    pricing = Pricing(models, p.mixed_cluster(), quantile=p.attainment, engine=p.engine)
    t = Table(title="why: each group's capacity per bucket (req/s per replica within the SLO, and what bounds it) "
                    "and the share of the bucket it takes", title_justify="left")
    t.add_column("group")
    for b in p.buckets.buckets:
        t.add_column(f"{b.label} ({b.share:.0%})", justify="right")
    cluster = p.mixed_cluster()
    for g in p.groups:
        k = g.knobs
        cap = kv_capacity(models[g.model], cluster.groups[g.group].device, g.tp, g.pp, k.max_batched_tokens,
                          k.max_seqs, k.block_tokens, k.memory_fraction)
        cfg = ReplicaConfig(g.model, g.group, g.tp, g.pp, g.role, k, (k.kv_blocks or cap.blocks) * k.block_tokens)
        shares = g.decode if g.role == Role.DECODE else g.entry
        cells = []
        for b, share in zip(p.buckets.buckets, shares):
            c = pricing.capacity(cfg, b, p.slo)
            cells.append("-" if b.share <= 0 else f"{c.rate:.3g} {c.bound}, {share:.0%}")
        t.add_row(g.label if len(models) == 1 else f"{p.models[g.model]}: {g.label}", *cells)
    console.print(t)
    if planned is not None:
        for cand in planned.candidates:
            if cand.solution is not None and cand.solution.gap is not None:
                console.print(f"MILP {cand.name}: rate {cand.solution.rate:.4g} req/s, within "
                              f"{cand.solution.gap:.1%} of its linear relaxation's {cand.solution.bound:.4g}")
        for m in planned.moves:
            console.print(f"repair {m}")


# ---- output ---------------------------------------------------------------------------------------------------
def _score_json(s) -> dict | None:  # noqa: ANN001
    if s is None:
        return None
    return {"goodput": s.goodput, "bounded": s.bounded, "dollars_per_hour": s.dollars_per_hour,
            "goodput_per_dollar": s.per_dollar, "rates": [p.rate for p in s.points]}


def _bands(p: ServingPlan) -> dict[str, Band]:
    """Each of the plan's parts' price band on its first model (flexmesh.cost.inference.band)."""
    return part_bands(p.model_specs()[0], (g.device for g in p.mixed_cluster().groups))


def _document(job: PlanJob, result: PlanResult, baselines: list[Baseline], cascade, single,  # noqa: ANN001
              band: dict[str, Score] | None = None) -> dict:
    d = {"plan": result.plan.to_dict(), "score": _score_json(result.score),
         "band": None if band is None else {
             "parts": {n: b.to_dict() for n, b in _bands(result.plan).items()},
             **{end: _score_json(sc) for end, sc in band.items()}},
         "candidates": [{"name": c.name, "layout": c.plan.layout, "milp_rate": c.solution.rate if c.solution else None,
                         "milp_gap": c.solution.gap if c.solution else None, "score": _score_json(c.score)}
                        for c in result.candidates],
         "repair": list(result.moves), "notes": list(result.notes),
         "timing": {"plan_s": result.plan_s, "simulate_s": result.simulate_s, "configurations": result.configs}}
    if baselines:
        d["baselines"] = [{"name": b.name, "layout": b.best.plan.layout if b.best else None,
                           "score": _score_json(b.best.score) if b.best else None, "why": b.why,
                           "plan_over_baseline": ratio(result.score, b.best.score) if b.best else None,
                           "goodput_over_baseline": (result.score.goodput / b.best.score.goodput
                                                     if b.best and b.best.score and result.score
                                                     and b.best.score.goodput > 0 else None),
                           "equals_plan": bool(b.best and b.router == "plan" and _same(b.best.plan, result.plan))}
                          for b in baselines]
    if cascade is not None:
        d["cascade"] = {"escalated": cascade.escalated, "split": cascade.split,
                        "single_model": None if single is None else {"model": single.plan.models[0],
                                                                     "layout": single.plan.layout,
                                                                     "score": _score_json(single.score)},
                        "over_single_model": None if single is None else ratio(result.score, single.score)}
    return d


def _write(out: Path, job: PlanJob, result: PlanResult, baselines: list[Baseline], single, doc: dict) -> None:  # noqa: ANN001
    make_folder(out)
    save_plan(result.plan, out / "plan.json")
    write_atomic(out / "report.json", json.dumps(doc, indent=1) + "\n")
    lines = [f"# Serving plan: {', '.join(result.plan.models)} on {result.plan.cluster}", "",
             f"{result.plan.layout}", "", "| plan | goodput (req/s) | $/h | goodput per $/h | plan's goodput per $/h "
             "over it |",
             "|---|---|---|---|---|"]
    entries = []
    rows = [("planner", result.score, result.plan)]
    rows += [(b.name, b.best.score, b.best.plan) for b in baselines if b.best is not None]
    if single is not None:
        rows.append((f"{single.plan.models[0]} alone", single.score, single.plan))
    for name, s, p in rows:
        if s is None:
            continue
        lines.append(f"| {name}: {p.layout} | {s.goodput:.4g} | {s.dollars_per_hour:.2f} | {s.per_dollar:.4g} | "
                     f"{ratio(result.score, s):.2f}x |")
        entries.append((name, s.per_dollar, [(pt.rate, pt.summary) for pt in s.points]))
    write_atomic(out / "report.md", "\n".join(lines) + "\n")
    if entries:
        from flexmesh.report.serving import plan_report_png  # matplotlib: imported where it plots

        plan_report_png(entries, out / "report.png", job.inputs.attainment,
                        f"{', '.join(result.plan.models)} on {result.plan.cluster}; SLO {job.inputs.slo}")


# The knob a plan's replica names show (ServingGroup.label), said once under the plan.
LEGEND = ("(bN: N batched tokens an iteration, vLLM's --max-num-batched-tokens; sN: N sequences a decode replica runs, "
          "--max-num-seqs)")


def _print_candidates(console: Console, result: PlanResult) -> None:
    """The candidates, one row per layout: the routing policy that served it better, the other's goodput beside."""
    t = Table(title="candidates (MILP rate; simulated goodput, by the better routing inside a bucket)",
              title_justify="left")
    for col in ("candidate", "MILP req/s", "goodput req/s", "other routing", "$/h", "goodput per $/h"):
        t.add_column(col, justify="left" if col == "candidate" else "right")
    rows: dict[tuple[str, str], list] = {}  # (name without its routing, layout) -> candidates, in order
    for c in result.candidates:
        name = c.name.split(", ")[0] if c.name.endswith(" routing") else c.name
        rows.setdefault((name, c.plan.layout), []).append(c)
    for (name, layout), twins in rows.items():
        c, rest = twins[0], twins[1:]  # the planner lists the better routing first
        s = c.score
        other = rest[0].score if rest and rest[0].score is not None else None
        t.add_row(f"{name}: {layout}" + (f" ({c.plan.routing} routing)" if rest else ""),
                  f"{c.solution.rate:.4g}" if c.solution else "-", f"{s.goodput:.4g}" if s else "-",
                  f"{other.goodput:.4g}" if other is not None else "-", f"{c.plan.dollars_per_hour:,.2f}",
                  f"{s.per_dollar:.4g}" if s else "-")
    console.print(t)


def _objective_ratio(job: PlanJob) -> tuple[str, Callable[[Score, Score], float]]:
    """The column that compares the plan with a baseline by what the plan was asked for, and how."""
    i = job.inputs
    if i.rate is not None:
        return "its $/h over the plan's", lambda plan, it: it.dollars_per_hour / plan.dollars_per_hour
    if i.per_dollar:
        return "plan's goodput per $/h over its", ratio
    return "plan's goodput over its", lambda plan, it: plan.goodput / it.goodput if it.goodput > 0 else math.inf


def _same(a: ServingPlan, b: ServingPlan) -> bool:
    """Whether two plans are one deployment: the same groups routed the same way."""
    return a.groups == b.groups and a.routing == b.routing


def _print_baselines(console: Console, job: PlanJob, result: PlanResult, baselines: list[Baseline],
                     single) -> None:  # noqa: ANN001
    name, by = _objective_ratio(job)
    t = Table(title="against the baselines, each scored by the same simulator", title_justify="left")
    for col in ("baseline", "goodput req/s", "$/h", "goodput per $/h", name):
        t.add_column(col, justify="left" if col == "baseline" else "right")
    same = []
    rows = [(b.name, b.best, b.why, b.router) for b in baselines]
    if single is not None:
        rows.append((f"{single.plan.models[0]} alone", single, "", "plan"))
    for label, best, why, router in rows:
        if best is None or best.score is None or result.score is None:
            t.add_row(f"{label}: {why}", "-", "-", "-", "-")
            continue
        s = best.score
        if router == "plan" and _same(best.plan, result.plan):
            same.append(label)
        t.add_row(f"{label}: {best.plan.layout}", f"{s.goodput:.4g}", f"{s.dollars_per_hour:,.2f}",
                  f"{s.per_dollar:.4g}", f"{by(result.score, s):.2f}x")
    console.print(t)
    for label in same:
        console.print(f"the plan equals the {label} baseline")


def _print(console: Console, job: PlanJob, result: PlanResult, baselines: list[Baseline], cascade, single,  # noqa: ANN001
           explain: bool, band: dict[str, Score] | None = None) -> None:
    i, p = job.inputs, result.plan
    objective = f"the most goodput{' per $/h' if i.per_dollar else ''} within ${i.budget:,.2f}/h" \
        if i.budget is not None else \
        f"the cheapest plan serving {i.rate:g} req/s"
    console.print(f"{', '.join(i.models)} on {p.cluster}; {i.buckets.source} in {len(i.buckets)} buckets; SLO {i.slo} "
                  f"for {i.attainment:.0%} of requests; {objective}")
    console.print(f"engine {p.engine.label()}")
    tp = ((r.device, r.spec.tp) for r in p.placement().replicas)
    for note in unmeasured_notes((g.device for g in p.mixed_cluster().groups), tp, p.engine.all_reduce):
        console.print(f"note: {note}")
    if cascade is not None:
        console.print(f"cascade: {cascade.escalated:.1%} of requests escalated (the least reaching quality "
                      f"{job.quality_target:g}), the first stage given {cascade.split:.0%} of the end-to-end bound")
    t = Table(title="plan", title_justify="left")
    for col in ("group", "devices", "$/h", "buckets taken (share of each)"):
        t.add_column(col, justify="right" if col in ("devices", "$/h") else "left")
    for g in p.groups:
        shares = g.decode if g.role == Role.DECODE else g.entry
        taken = ", ".join(f"{b.label} {s:.0%}" for b, s in zip(p.buckets.buckets, shares) if s > 0.005)
        name = g.label if len(p.models) == 1 else f"{p.models[g.model]}: {g.label}"
        t.add_row(name, str(g.devices), f"{g.devices * p.prices.get(g.device, math.nan):,.2f}",
                  ("decodes " if g.role == Role.DECODE else "") + (taken or "none"))
    console.print(t)
    console.print(LEGEND)
    if result.planner is not None and len(p.models) == 1:
        for line in why_mix(result.planner, p):
            console.print(f"why this mix: {line}")
    _print_candidates(console, result)
    if baselines or single is not None:
        _print_baselines(console, job, result, baselines, single)
    for m in result.moves:
        console.print(f"repair {m}")
    for n in result.notes:
        console.print(f"note: {n}")
    if result.score is not None:
        s = result.score
        console.print(f"goodput {'at least ' if not s.bounded else ''}{s.goodput:.4g} req/s at "
                      f"${s.dollars_per_hour:,.2f}/h ({s.per_dollar:.4g} req/s per $/h); planned from {result.configs} "
                      f"configurations, {result.plan_s:.2f} s; scored in {result.simulate_s:.1f} s")
        if band is not None:
            console.print(f"price band ({bands_label(_bands(p))}): goodput {band['high'].goodput:.4g} to "
                          f"{band['low'].goodput:.4g} req/s")
        if not s.bounded:
            console.print("note: every rate tried met the SLO: the workload is served within it even arriving all "
                          "at once, so its goodput is not found; give more requests (--requests) to find the knee")
    else:
        console.print(f"MILP rate {p.predicted.get('rate', 0):.4g} req/s at ${p.dollars_per_hour:,.2f}/h (not "
                      f"simulated); planned from {result.configs} configurations, {result.plan_s:.2f} s")
    if explain:
        _explain(console, p, result)
