"""The deployment planner (``flexmesh serve plan``) against its baselines, its speed, re-planning and a cascade.

Every plan is scored by the one simulator (flexmesh.serve.simulator) on the same requests: the first
:data:`REQUESTS` of each trace (tens of seconds of traffic at the rates planned), their arrival times scaled to
each rate; goodput is the highest rate at which 90% of them meet the SLO. Goodput per dollar is goodput over
the plan's $/h (AWS on-demand prices,
flexmesh/spec/presets/prices.toml).

- **Plans against baselines** (Llama-3-8B and Llama-3-70B shapes, as ``llama3.1-*``: the same layers with a
  context that holds Mooncake's prompts; Azure 2023 conversation and code traces, Mooncake's conversation
  trace; six device types H100, A100-80GB, A100-40GB, L40S, A10G, L4, each as many as :data:`CLUSTERS` lists;
  a budget in $/h, each type available in more than the budget buys, so that every plan can spend it): the
  planner and every baseline plan the most goodput per $/h within the budget (``PlanInputs.per_dollar``: of the
  plans each scores, all near the budget, the one whose goodput costs least; whole replicas leave some plans a few
  dollars unspent, and the most goodput alone would prefer filling them with slower devices); goodput per dollar
  is compared, and the planner's plan is never below a baseline of its own search space (:data:`OWN_SPACE`). Where
  the plan is one device type, whether a mix should win there is tried (:func:`mixes_rejected`: the calibrated
  capacities per $/h of each type per bucket, and the best mixes the MILP rejects, simulated). The
  planner's plan over the best single device type (target >= 1.25x),
  Mélange-style and one-type-per-phase plans (>= 1.1x each), DistServe-style and round-robin (reported). Each
  baseline is planned by the same MILP restricted to its method (its own knobs swept: tp, batched-token
  budget, routing policy) and the best of its variants taken (a baseline whose plan the planner has simulated
  already, say a device type's own plan, keeps that score: the same plan, the same simulator). SLOs from
  DistServe's artifact (LLMServe/DistServe, evaluation/ae-scripts/e2e/_plot.py, 90% attainment): its chatbot
  SLO for the model size
  (OPT-13B: TTFT 0.25 s, TPOT 0.1 s; OPT-66B: 0.4 s, 0.1 s) on the conversation and code traces (the Azure
  code trace's prompts are ten times HumanEval's, for which its 0.125 s code SLO was set), its
  summarization SLO (LongBench, OPT-66B: 15 s, 0.15 s) on Mooncake's long prompts. Whether a plan splits
  prefill and decode is reported: the planner scores aggregated and split candidates in the simulator and
  keeps the better (target: at least one case of each).
- **Planner time** (configurations, capacities and the MILPs; not the simulator): <= 1 s for 32 GPUs of the
  six types, <= 10 s for 512, fastest of ``bench._results.REPEATS`` on each trace and model, the slowest
  reported. The target is held to the process's CPU seconds (it runs on one thread, so they are its time on a
  core of its own); the wall time beside them is what a shared machine's load stretched.
- **Re-planning** (Llama-3-8B, conversation trace): each replica group of the plan lost in turn; and the rate
  doubled for the MILP's cheapest plan of half its goodput: the fast path (roles, knobs and routing of the
  replicas left, partial buckets or a bucket conceded, judged by the simulator on the trace's first requests; no
  weights move) in <= 1 s of CPU, its simulated goodput >= 90% of a fresh plan's on the same devices (a full
  re-plan may change every replica's type and tp there); the full re-plan's transition (what it loads and moves,
  in seconds and dollars).
- **Cascade** (Llama-3-8B then Llama-3-70B, conversation trace, end-to-end SLO): at the quality target, >= 1.5x
  the goodput per dollar of the best single model reaching it alone. The quality curve is a stated input,
  not a claim: its ends are Meta's model cards (MMLU 5-shot, instruct: 68.4 and 82.0), its shape between
  assumed (a judge escalating the hardest requests first).

Usage: ``OMP_NUM_THREADS=1 python -m bench.serve_plan [--no-record] [--quick] [--only SECTION,...] [--case
SIZE:TRACE,...]`` (``--quick``: Llama-3-8B on the conversation trace only, for a look; ``--only``: some of the
sections ``plans``, ``time``, ``replan``, ``cascade``, printed and never recorded: each takes minutes; ``--case``:
the plans section's cases to run, e.g. ``--only plans --case 8B:mooncake``).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

import numpy as np
from rich.console import Console
from rich.table import Table

from bench._results import REPEATS, markdown_table, record
from flexmesh.data.requests import at_rate, load_trace, window
from flexmesh.errors import PlanError
from flexmesh.serve.layout.quality import parse_quality
from flexmesh.serve.layout.routing import RoutingPolicy
from flexmesh.serve.layout.slo import SLO
from flexmesh.serve.plan import replan
from flexmesh.serve.plan.baselines import all_baselines, known_scores, ratio
from flexmesh.serve.plan.cascade import plan_cascade
from flexmesh.serve.plan.milp import solve_fast
from flexmesh.serve.plan.planner import PlanCandidate, PlanInputs, Planner
from flexmesh.serve.plan.replan import fast_replan, held_devices, transition
from flexmesh.serve.plan.score import REL_TOL, score
from flexmesh.serve.plan.search import candidates, plan, routed
from flexmesh.serve.plan.workload import buckets_from_trace
from flexmesh.serve.simulator import Fleet
from flexmesh.spec.prices import gpu_prices

# The code these figures depend on: a change there makes the record out of date.
DEPENDS_ON = ("flexmesh/serve", "flexmesh/layout/enums.py", "flexmesh/cost/inference", "flexmesh/cost/device",
              "flexmesh/data/requests.py", "flexmesh/data/traces", "flexmesh/schedule/dispatch.py", "flexmesh/spec",
              "flexmesh/errors.py", "flexmesh/files.py", "flexmesh/inputs.py", "flexmesh/units.py",
              "flexmesh/console.py")
REQUESTS = 2000
REPAIR = 1
# Mixes the MILP rejects simulated where the plan is one device type (mixes_rejected).
MIXES_SIMULATED = 3
MODELS = {"8B": "llama3.1-8b", "70B": "llama3.1-70b"}
TRACES = ("azure-conv", "azure-code", "mooncake")
# Devices one can get and the budget, per model size: of each type at least what the budget buys (nodes of 8).
CLUSTERS = {"8B": ("2x8xH100+3x8xA100-80GB+3x8xA100-40GB+4x8xL40S+8x8xA10G+10x8xL4", 60.0),
            "70B": ("4x8xH100+8x8xA100-80GB+10x8xA100-40GB+16x8xL40S+26x8xA10G+32x8xL4", 200.0)}
# DistServe's SLOs (see the module doc): (TTFT s, TPOT s) by trace and model size.
SLOS = {("azure-conv", "8B"): (0.25, 0.1), ("azure-code", "8B"): (0.25, 0.1), ("mooncake", "8B"): (15.0, 0.15),
        ("azure-conv", "70B"): (0.4, 0.1), ("azure-code", "70B"): (0.4, 0.1), ("mooncake", "70B"): (15.0, 0.15)}
# Two cases where the seeds say mixing pays (Llama-3-8B, conversation trace, its SLO): availability-limited, no more
# than two of the best type however many the budget buys (ThunderServe's clouds), planned for the most goodput within
# the budget, goodput compared (a plan's goodput per $/h does not see what it could not buy); and a fleet of cheap
# older GPUs beside a few fast ones for the short requests (Mélange's), goodput per $/h compared. Variant ->
# (cluster, budget, per_dollar)
VARIANTS = {"H100 scarce": ("2xH100+3x8xA100-80GB+3x8xA100-40GB+4x8xL40S+8x8xA10G+10x8xL4", 60.0, False),
            "cheap older GPUs": ("1x8xH100+1x8xA100-80GB+8x8xT4", 60.0, True)}
VARIANT_CASES = [("8B", "azure-conv", v) for v in VARIANTS]
TIME_CASES = {32: ("8xH100+4xA100-80GB+4xA100-40GB+8xL40S+4xA10G+4xL4", 60.0, 1.0),
              512: ("11x8xH100+11x8xA100-80GB+11x8xA100-40GB+11x8xL40S+10x8xA10G+10x8xL4", 1000.0, 10.0)}
TARGETS = {"best single GPU type": 1.25, "Mélange-style": 1.1, "one type per phase": 1.1}
# Baselines whose plans are points of the planner's own search space: its plan is never below them per $/h. The first
# two are among its candidates (the same plan, the same score); the others it does not simulate (within REL_TOL).
OWN_SPACE = ("best single GPU type", "Mélange-style", "DistServe-style", "one type per phase")
CASCADE = ("llama3.1-8b", "llama3.1-70b")
CASCADE_QUALITY = "0:0.684,0.2:0.75,0.4:0.79,0.6:0.81,1:0.82"
CASCADE_TARGET = 0.79
CASCADE_SLO = SLO(tpot_s=0.1, e2e_s=30.0)
CASCADE_BUDGET = 200.0


def _prices() -> dict[str, float]:
    return {k: v.usd_per_hour for k, v in gpu_prices().items()}


def _workload(trace: str):  # noqa: ANN202
    base = window(load_trace(trace), first=REQUESTS)
    return base, (lambda r: at_rate(base, r))


def _inputs(model: str, size: str, trace: str, variant: str = "") -> tuple[PlanInputs, object]:
    base, workload_at = _workload(trace)
    cluster, budget, per_dollar = VARIANTS[variant] if variant else (*CLUSTERS[size], True)
    ttft, tpot = SLOS[trace, size]
    return PlanInputs((model,), cluster, buckets_from_trace(base), SLO(ttft, tpot), _prices(), budget=budget,
                      workload={"trace": trace, "requests": len(base)}, per_dollar=per_dollar), workload_at


def _split(p) -> str:  # noqa: ANN001
    return "split" if any(g.role != "aggregated" for g in p.groups) else "aggregated"


def plan_rows(cases: list[tuple[str, ...]]) -> tuple[list[list[str]], list[str], dict]:
    """One row per case; the details (each baseline's plan, the repair); the planner's results by case, and
    under ``"written"`` [baselines of the planner's own search space, those its plan is not below per $/h]."""
    rows, details = [], []
    kept: dict = {}
    written = kept["written"] = [0, 0]
    for case in cases:
        size, trace, variant = (*case, "")[:3]
        model = MODELS[size]
        # per $/h (or, availability-limited, goodput within the budget): what the table compares, for the planner and
        # the baselines alike
        inputs, workload_at = _inputs(model, size, trace, variant)
        label = f"{size} {trace}" + (f", {variant}" if variant else "")
        print(f"{label}: planning")
        res = plan(inputs, workload_at, repair=REPAIR)
        assert res.score is not None and res.planner is not None
        print(f"{label}: {res.plan.layout}: {res.score.goodput:.4g} req/s at ${res.score.dollars_per_hour:.2f}/h; "
              "baselines")
        base = {b.name: b for b in all_baselines(res.planner, res.plan, res.score, workload_at, res.candidates)}
        scored_c = [c for c in res.candidates if c.score is not None and c.plan.cascade is None]
        split_c = max((c.score for c in scored_c if _split(c.plan) == "split"), key=lambda x: x.per_dollar,
                      default=None)
        agg_c = max((c.score for c in scored_c if _split(c.plan) == "aggregated"), key=lambda x: x.per_dollar,
                    default=None)
        for name in OWN_SPACE:  # a plan the planner could have produced
            b = base[name]
            if b.best is not None and b.best.score is not None:
                written[0] += 1
                tol = REL_TOL if name in OWN_SPACE[2:] else 0.0  # not among its candidates: the bisection's error
                of = (lambda x: x.per_dollar) if inputs.per_dollar else (lambda x: x.goodput)  # what is compared
                below = of(res.score) < of(b.best.score) * (1 - tol) * (1 - 1e-9)
                written[1] += not below
                if below:
                    details.append(f"- {label}: the plan is below the {name} baseline "
                                   + ("per $/h" if inputs.per_dollar else "in goodput"))
        cells = [label, f"{res.plan.layout}", _split(res.plan), f"{res.score.goodput:.4g}",
                 f"{res.score.dollars_per_hour:.2f}", f"{res.score.per_dollar:.4g}"]
        for name in ("best single GPU type", "Mélange-style", "DistServe-style", "one type per phase",
                     "round-robin routing"):
            b = base[name]
            if b.best is None or b.best.score is None:
                cells.append(f"- ({b.why})")
                continue
            r = ratio(res.score, b.best.score) if inputs.per_dollar else res.score.goodput / b.best.score.goodput
            verdict = (" PASS" if r >= TARGETS[name] else " FAIL") if name in TARGETS else ""
            cells.append(f"{r:.2f}x{verdict}")
            details.append(f"- {label}, {name}: {b.best.plan.layout}: {b.best.score.goodput:.4g} req/s at "
                           f"${b.best.score.dollars_per_hour:.2f}/h ({b.best.score.per_dollar:.4g} per $/h)")
        cells.append(f"{split_c.goodput:.4g} / {agg_c.goodput:.4g}" if split_c and agg_c else "-")
        cells.append(f"{res.plan_s:.2f}")
        rows.append(cells)
        kept[case] = res
        for m in res.moves:
            details.append(f"- {label}, repair {m}")
        details += mixes_rejected(res, workload_at, label, known_scores(res.candidates))
    return rows, details, kept


def _cheapest(planner, g: int):  # noqa: ANN001, ANN202
    """Per bucket, the most requests/s per $/h an aggregated replica of device group ``g`` serves (the planner's
    calibrated capacities)."""
    out = np.zeros(len(planner.inputs.buckets))
    for k in planner.columns(("aggregated",), groups=[g]):
        out = np.maximum(out, planner.capacity[k] / (planner.configs[k].devices * planner.price[g]))
    return out


def mixes_rejected(res, workload_at, label: str, known) -> list[str]:  # noqa: ANN001
    """Where the plan is one device type, whether a mix should win there (Mélange's argument: small requests on
    cheap devices, large ones on big devices). Per bucket, the calibrated capacities per $/h of each type; then the
    best mixes the MILP rejects, simulated: the MILP over the plan's type and one other, the other made to take the
    shortest or the longest bucket (the plan's type given no capacity there), the :data:`MIXES_SIMULATED` of the
    highest MILP rate. A mix the simulator finds better per $/h would mean the MILP's capacities are wrong."""
    planner = res.planner
    types = {g.group for g in res.plan.groups}
    if len(types) != 1 or any(g.role != "aggregated" for g in res.plan.groups):
        return []
    (main,) = types
    names = [g.device.name for g in planner.cluster.groups]
    mine = _cheapest(planner, main)
    wins = {names[g]: [b.label for b, x, y in zip(planner.inputs.buckets.buckets, _cheapest(planner, g), mine)
                       if x > y * (1 + 1e-9)] for g in range(len(names)) if g != main}
    lines = [f"- {label}: one device type ({names[main]}); per the calibrated capacities it serves "
             + ("every bucket for fewer $/h than any other type" if not any(wins.values()) else
                "every bucket for the fewest $/h except where another type is cheaper: "
                + "; ".join(f"{t} {', '.join(b)}" for t, b in wins.items() if b))]
    tried = []
    nb = len(planner.inputs.buckets)
    for g in range(len(names)):
        if g == main:
            continue
        cols = planner.columns(("aggregated",), groups=[main, g])
        problem = planner.problem(cols, budget=planner.inputs.budget)
        for where, sl in (("shortest", slice(0, 1)), ("longest", slice(nb - 1, nb))):
            cap = problem.capacity.copy()
            cap[[j for j, k in enumerate(cols) if planner.configs[k].group == main], sl] = 0.0
            try:
                s = solve_fast(replace(problem, capacity=cap))
            except PlanError:
                continue
            if s.rate > 0:
                tried.append((s.rate, f"{names[g]} taking the {where} bucket", planner.to_plan(cols, s), s))
    tried.sort(key=lambda t: -t[0])
    beats = 0
    for rate, why, p, s in tried[:MIXES_SIMULATED]:
        c = routed(PlanCandidate(why, p, s), workload_at, planner, None, known)[0]  # its better routing
        r = ratio(res.score, c.score)
        beats += r < 1
        lines.append(f"- {label}, a mix the MILP rejects ({why}): {p.layout}: MILP {rate:.4g} req/s, simulated "
                     f"{c.score.goodput:.4g} req/s at ${c.score.dollars_per_hour:.2f}/h ({c.score.per_dollar:.4g} per "
                     f"$/h; the plan {r:.2f}x)")
    if tried:
        n = min(len(tried), MIXES_SIMULATED)
        lines.append(f"- {label}: " + ("a mix the MILP rejects beats the plan in the simulator: the MILP's capacities "
                                       "are wrong here" if beats else
                                       f"none of the {n} best mixes the MILP rejects beats the one type in the "
                                       "simulator: a mix does not win here, and the plan, the best single type's own, "
                                       "cannot be 1.25x it"))
    return lines


def time_rows() -> list[list[str]]:
    rows = []
    prices = _prices()
    for gpus, (cluster, budget, target) in TIME_CASES.items():
        worst, where, cpu = 0.0, "", 0.0
        for size, model in MODELS.items():
            for trace in TRACES:
                base, _ = _workload(trace)
                ttft, tpot = SLOS[trace, size]
                inputs = PlanInputs((model,), cluster, buckets_from_trace(base), SLO(ttft, tpot), prices,
                                    budget=budget)
                best, best_cpu = math.inf, math.inf
                for _ in range(REPEATS):  # the fastest of the repeats, by CPU and by wall time
                    t0, c0 = time.perf_counter(), time.process_time()
                    try:
                        candidates(Planner(inputs))
                    except Exception as e:  # noqa: BLE001  (a case no device serves is reported, not fatal)
                        print(f"{gpus} GPUs {size} {trace}: {e}")
                    best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.process_time() - c0)
                print(f"planner time, {gpus} GPUs, {size} {trace}: {best:.2f} s ({best_cpu:.2f} s of CPU)")
                if best_cpu > cpu:
                    worst, where, cpu = best, f"{size} {trace}", best_cpu
        rows.append([f"{gpus} GPUs of 6 types ({cluster})", where, f"{worst:.2f}", f"{cpu:.2f}",
                     f"<= {target:g} s of CPU {'PASS' if cpu <= target else 'FAIL'}"])
    return rows


def replan_rows(res) -> list[list[str]]:  # noqa: ANN001
    """The 8B conversation plan with one replica of each of its replica groups lost in turn (a group of one replica
    lost whole); the cheapest plan for half its goodput when the rate doubles. The fast path against a fresh plan
    on the same devices."""
    inputs, workload_at = _inputs(MODELS["8B"], "8B", "azure-conv")
    planner = res.planner
    prices = _prices()
    half = plan(replace(inputs, budget=None, rate=res.score.goodput / 2), None, planner=planner)
    cases = [(f"lost one of {g.label}" if g.replicas > 1 else f"lost {g.label}", res.plan, {i: 1})
             for i, g in enumerate(res.plan.groups)]
    cases.append((f"rate doubled from {res.score.goodput / 2:.4g} req/s", half.plan, {}))
    rows = []
    held_kv: dict[str, list[float]] = {}
    for label, before, lost in cases:
        fast = fast_replan(planner, before, lost, workload_at=workload_at)
        held = held_devices(before, lost)
        cost = sum(n * prices[d] for n, d in zip(held, [g.device.name for g in planner.cluster.groups]))
        cols = planner.columns()
        fresh = planner.to_plan(cols, planner.solve(cols, budget=cost + 1e-6, available=held))
        a = score(fast.plan, workload_at, fast.plan.predicted.get("rate") or 1.0)
        b = max((score(replace(fresh, routing=policy), workload_at, fresh.predicted.get("rate") or 1.0)
                 for policy in RoutingPolicy), key=lambda x: x.goodput)  # the fresh plan's better routing
        got = a.goodput / b.goodput if b.goodput > 0 else math.nan
        print(f"re-plan, {label}: fast path {a.goodput:.4g} req/s ({fast.candidate}), fresh plan {b.goodput:.4g}")
        rows.append([label, before.layout, f"{fast.cpu_s:.2f} {'PASS' if fast.cpu_s <= 1.0 else 'FAIL'} "
                     f"({fast.seconds:.2f} wall)", f"{fast.plan.layout} ({fast.candidate})", f"{a.goodput:.4g}",
                     f"{b.goodput:.4g}", f"{got:.0%} {'PASS' if got >= 0.9 else 'FAIL'}",
                     transition(before, fresh, held_kv.setdefault(before.layout, _kv_held(
                         before, workload_at, res.score.goodput / 2))).summary()])
    return rows


def _kv_held(p, workload_at, rate: float) -> list[float]:  # noqa: ANN001
    """KV tokens each replica of ``p`` holds on average at ``rate`` (a simulation): what moves when it stops."""
    fleet, table = Fleet.from_plan(p)
    out = fleet.run(workload_at(rate), router="plan", routing=table)
    return [sum(x[4] for x in r.samples) / max(len(r.samples), 1) * r.kv_tokens for r in out.replicas]


def cascade_rows() -> list[list[str]]:
    base, workload_at = _workload("azure-conv")
    cluster, _ = CLUSTERS["70B"]
    q = parse_quality(CASCADE_QUALITY)
    inputs = PlanInputs(CASCADE, cluster, buckets_from_trace(base), CASCADE_SLO, _prices(), budget=CASCADE_BUDGET,
                        tiers=(1.0, 0.0))
    cr = plan_cascade(inputs, q, CASCADE_TARGET, workload_at)
    single = plan(replace(inputs, models=(CASCADE[1],), tiers=(1.0,)), workload_at, repair=0)
    assert cr.result.score is not None and single.score is not None
    r = ratio(cr.result.score, single.score)
    return [[f"cascade 8B -> 70B ({cr.escalated:.0%} escalated, first stage {cr.split:.0%} of the bound)",
             cr.result.plan.layout, f"{cr.result.score.goodput:.4g}", f"{cr.result.score.dollars_per_hour:.2f}",
             f"{cr.result.score.per_dollar:.4g}", f"{r:.2f}x {'PASS' if r >= 1.5 else 'FAIL'}"],
            [f"{CASCADE[1]} alone", single.plan.layout, f"{single.score.goodput:.4g}",
             f"{single.score.dollars_per_hour:.2f}", f"{single.score.per_dollar:.4g}", "-"]]


SECTIONS = ("plans", "time", "replan", "cascade")


def _replan_only() -> list[list[str]]:
    """The re-plan rows without the plans section: the 8B conversation case planned (and repaired) alone."""
    inputs, workload_at = _inputs(MODELS["8B"], "8B", "azure-conv")
    res = plan(inputs, workload_at, repair=REPAIR)
    assert res.score is not None
    print(f"8B azure-conv: {res.plan.layout}: {res.score.goodput:.4g} req/s at ${res.score.dollars_per_hour:.2f}/h")
    return replan_rows(res)


def only(sections: list[str], cases: list[tuple[str, str]] | None = None) -> int:
    """Some sections alone, printed (a partial run is never recorded); ``cases``: the plans section's, else all."""
    console = Console(width=200)
    tables = []
    for name in sections:
        if name == "plans":
            head = ["case", "plan", "prefill/decode", "goodput req/s", "$/h", "goodput per $/h", "over best single "
                    "type", "over Mélange-style", "over DistServe-style", "over one type per phase",
                    "over round-robin", "split / aggregated candidates' goodput", "planner s"]
            rows, details, _ = plan_rows(cases or [(s, t) for s in MODELS for t in TRACES])
            tables.append((head, rows))
            print("\n".join(details))
        elif name == "time":
            tables.append((["planner time", "slowest case", "s (fastest of repeats)", "CPU s", "target"], time_rows()))
        elif name == "replan":
            tables.append((["re-plan", "plan before", "fast path CPU s", "fast path plan", "fast goodput",
                            "fresh plan goodput", "fast / fresh", "full re-plan's transition"], _replan_only()))
        else:
            tables.append((["cascade", "plan", "goodput req/s", "$/h", "goodput per $/h",
                            "over the best single model"], cascade_rows()))
    for head, rows in tables:
        t = Table(*head)
        for r in rows:
            t.add_row(*r)
        console.print(t)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end")
    return 0


def _case(case: tuple[str, ...]) -> tuple[list[str], list[str], object, list[int]]:
    rows, details, kept = plan_rows([case])
    return rows[0], details, kept[case], kept["written"]


def _side_by_side(cases: list[tuple[str, ...]], cascade: bool) -> tuple[list, list, list, list]:
    """The plans of every case, the re-plans (once the 8B conversation plan is there) and the cascade, each in a
    process of its own, as many at once as the machine has cores (each is one thread): their rows in order."""
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        cascade_job = pool.submit(cascade_rows) if cascade else None
        jobs = {c: pool.submit(_case, c) for c in cases}
        done = {c: jobs[c].result() for c in cases[:1]}  # the 8B conversation case: the re-plans start from it
        replans = pool.submit(replan_rows, done[cases[0]][2])
        done.update({c: jobs[c].result() for c in cases[1:]})
        rows = [done[c][0] for c in cases]
        details = [line for c in cases for line in done[c][1]]
        written = [sum(done[c][3][k] for c in cases) for k in (0, 1)]
        return rows, details, replans.result(), cascade_job.result() if cascade_job else [], written


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", type=lambda v: v.split(","), default=None,
                    help=f"comma-separated sections to run alone, unrecorded: {', '.join(SECTIONS)}")
    ap.add_argument("--case", type=lambda v: [tuple(c.split(":", 1)) for c in v.split(",")], default=None,
                    help="with --only plans: these cases only, SIZE:TRACE,... (e.g. 8B:mooncake)")
    args = ap.parse_args()
    if args.case is not None:
        bad = [":".join(c) for c in args.case if len(c) != 2 or c[0] not in MODELS or c[1] not in TRACES]
        if bad or args.only is None or "plans" not in args.only:
            ap.error(f"--case takes SIZE:TRACE cases of {', '.join(MODELS)} and {', '.join(TRACES)} with --only plans"
                     + (f" (not {', '.join(bad)})" if bad else ""))
    if args.only is not None:
        bad = sorted(set(args.only) - set(SECTIONS))
        if bad:
            ap.error(f"unknown section {', '.join(bad)}; give some of {', '.join(SECTIONS)}")
        return only(args.only, args.case)
    load, began = os.getloadavg()[0], time.perf_counter()
    cases = [("8B", "azure-conv")] if args.quick else [(s, t) for s in MODELS for t in TRACES] + VARIANT_CASES
    trows = time_rows()  # alone, before the other sections start
    rows, details, rrows, crows, written = _side_by_side(cases, cascade=not args.quick)
    head = ["case", "plan", "prefill/decode", "goodput req/s", "$/h", "goodput per $/h", "over best single type",
            "over Mélange-style", "over DistServe-style", "over one type per phase", "over round-robin",
            "split / aggregated candidates' goodput", "planner s"]
    console = Console(width=200)
    t = Table(*head, title="the planner's plan and its goodput per dollar over each baseline's")
    for r in rows:
        t.add_row(*r)
    console.print(t)
    kinds = {r[2] for r in rows}
    splits = f"plans split in {sum(r[2] == 'split' for r in rows)} of {len(rows)} cases " + \
        ("PASS" if kinds == {"split", "aggregated"} else "FAIL")
    own = f"the planner's plan never below a baseline of its own search space per $/h (best single type and " \
        f"Mélange-style: among its candidates; DistServe-style and one type per phase: within the bisection's " \
        f"{REL_TOL:.0%}) in {written[1]} of {written[0]} {'PASS' if written[1] == written[0] else 'FAIL'}"
    thead = ["planner time", "slowest case", "s (fastest of repeats)", "CPU s", "target"]
    rhead = ["re-plan", "plan before", "fast path CPU s", "fast path plan", "fast goodput", "fresh plan goodput",
             "fast / fresh", "full re-plan's transition"]
    chead = ["cascade", "plan", "goodput req/s", "$/h", "goodput per $/h", "over the best single model"]
    for h, rs in ((thead, trows), (rhead, rrows), (chead, crows)):
        tt = Table(*h)
        for r in rs:
            tt.add_row(*r)
        console.print(tt)
    console.print(splits)
    console.print(own)
    if not args.no_record:
        md = "\n".join(markdown_table(head, rows))
        md += (f"\n\nEach case plans the most goodput per $/h within the budget (each plan near it: whole replicas "
               f"leave some a few dollars unspent), the planner and every baseline alike (each "
               f"device type available in more than the budget buys: every plan can spend it); goodput per dollar "
               f"of the planner's plan over each baseline's; every plan scored by the one simulator on the first "
               f"{REQUESTS} requests of the trace at each rate (90% of requests within the SLO), the planner's "
               f"repaired by {REPAIR} rounds of local moves. Budgets and devices: 8B {CLUSTERS['8B'][0]} at "
               f"${CLUSTERS['8B'][1]:g}/h, 70B {CLUSTERS['70B'][0]} at ${CLUSTERS['70B'][1]:g}/h. Where mixing "
               f"should pay: " + "; ".join(f"{v}: {c} at ${b:g}/h" + ("" if pd else ", the most goodput within the "
                                                                      "budget, goodput compared (not per $/h)")
                                          for v, (c, b, pd) in VARIANTS.items()) + f". {splits}; {own}. "
               f"Every candidate is scored with both routing policies inside its buckets' shares (in proportion, "
               f"by least work); the split / aggregated column gives the best candidate of each kind.\n\n")
        md += "\n".join(details) + "\n\n"
        md += "\n".join(markdown_table(thead, trows))
        md += (f"\n\nPlanner time: configurations, capacities and the MILPs (aggregated, split and mixed variants), "
               f"fastest of {REPEATS}, load average {load:.1f} on {os.cpu_count()} cores when the run began; the "
               f"target held to the process's CPU seconds (one thread: its time on a core of its own), the wall time "
               f"beside them.\n\n")
        md += (f"The whole run: {(time.perf_counter() - began) / 60:.1f} min on {os.cpu_count()} cores, load average "
               f"{load:.1f} when it began and {os.getloadavg()[0]:.1f} at its end (other work on the machine "
               f"included); the planner time alone, then the cases, the re-plans and the cascade side by side, one "
               f"process per core.\n\n")
        md += (f"Re-planning: the fast path's CPU seconds (wall time in brackets) include the simulator's judgement "
               f"of its candidates on the first {replan.JUDGE_REQUESTS} requests; which candidate it took is in "
               f"brackets after its plan.\n\n")
        md += "\n".join(markdown_table(rhead, rrows)) + "\n\n"
        if crows:
            md += "\n".join(markdown_table(chead, crows))
            md += (f"\n\nQuality curve (an input: {CASCADE_QUALITY}; target {CASCADE_TARGET}), SLO {CASCADE_SLO}, "
                   f"budget ${CASCADE_BUDGET:g}/h on {CLUSTERS['70B'][0]}.\n")
        per = [float(r[6].split("x")[0]) for r in rows if r[6][0].isdigit()]
        record("serve_plan", md, headline=f"goodput per dollar {min(per):.2f}-{max(per):.2f}x the best single GPU "
               f"type over {len(rows)} cases; planner {trows[0][2]} s at 32 GPUs, {trows[1][2]} s at 512")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
