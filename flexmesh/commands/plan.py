"""``flexmesh plan``: search the best parallel layout, or ``--check`` a plan file."""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flexmesh.commands.args import new_file, nonempty, positive_int
from flexmesh.console import plain_console, styled
from flexmesh.cost import Evaluation
from flexmesh.cost.mixed import MixedCosts
from flexmesh.errors import PlanError
from flexmesh.files import check_file_target
from flexmesh.layout.plan import PIPELINE_SCHEDULES, Plan, load_plan
from flexmesh.plan import Candidate, SearchRequest, SearchResult, SearchSpace, best_plans
from flexmesh.plan.baselines import mixed_baselines
from flexmesh.plan.check import check_groups, check_plan
from flexmesh.plan.mixed import MixedResult, plan_mixed
from flexmesh.plan.space import FULL_SPACE, SEARCH_MODES
from flexmesh.report.plan_tables import baseline_table, ratios, replica_table, stage_table
from flexmesh.spec.cluster import MixedCluster, parse_mixed_cluster
from flexmesh.spec.model import parse_model
from flexmesh.units import GIB

PROGRESS_AFTER_S = 1.0  # show a progress bar only for searches that take longer than this


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``flexmesh plan`` and its options."""
    p = subparsers.add_parser(
        "plan", help="search the fastest parallel layout that fits, or --check a plan file",
        description="Search per-layer strategies, pipeline split, schedule and micro-batches; print the best plans.")
    p.add_argument("--model", default="llama3-8b",
                   help="preset name, gpt:LAYERS:HIDDEN:HEADS[:VOCAB], or a config.json path (default llama3-8b)")
    p.add_argument("--cluster", default=None, type=nonempty,
                   help="e.g. 8xH100, 8x8xA100-40GB, device groups joined by '+' (1x8xH100+2x8xA100-40GB: a "
                        "mixed cluster, planned as replica groups), or a JSON/TOML cluster file (default: the "
                        "hardware profile's node, else 8xH100)")
    p.add_argument("--hardware-profile", metavar="PATH",
                   help="price compute and communication with this `flexmesh profile hardware` file")
    p.add_argument("--model-profile", metavar="PATH",
                   help="price layers and activations with this `flexmesh profile model` file")
    p.add_argument("--seq-len", type=positive_int, default=8192, help="tokens per sequence (default 8192)")
    p.add_argument("--global-batch", type=positive_int, default=128, help="sequences per step (default 128)")
    p.add_argument("--out", type=new_file, help="write the best plan as JSON here (atomically)")
    p.add_argument("--top", type=positive_int, default=5, help="plans to list (default 5)")
    p.add_argument("--explain", action="store_true", help="break the best plan's time and memory into parts")
    p.add_argument("--against", metavar="PLAN", help="with --explain: compare the best plan term by term with "
                   "this plan file (for instance a published layout), priced by the same cost model; on a mixed "
                   "cluster: any plan of that cluster, beside the baselines")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (no table, no progress)")
    p.add_argument("--check", metavar="PLAN",
                   help="validate this plan file (any version) against --model and --cluster (a plan of several "
                        "replica groups: default cluster the one it names); with --out, write it in this version")
    p.add_argument("--same-mesh", action="store_true",
                   help="every layer on the same (tp, cp, dp) mesh; ZeRO and recompute stay per layer")
    p.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    p.add_argument("--pipeline-schedules", "--schedules", dest="pipeline_schedules",
                   default=",".join(PIPELINE_SCHEDULES),
                   help="comma-separated pipeline schedules to consider (--schedules is the old name)")
    p.add_argument("--mode", choices=SEARCH_MODES, default="auto",
                   help="exact: layer DP + every layer split (small models); fast: closed form per stage")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Check a plan file, or build a SearchRequest from the options, search, and print or write the result."""
    from flexmesh.profile.use import cost_model_for

    if args.out:
        check_file_target(args.out)  # a device, fifo or symlink there: refused before searching
    loaded = load_plan(args.check) if args.check else None
    if loaded is not None and not loaded.in_rank_order:
        return check_groups_command(args, loaded)
    if loaded is None and args.cluster is not None:
        mixed = parse_mixed_cluster(args.cluster)
        if not mixed.uniform:  # several device groups, or devices of different speeds
            return run_mixed(args, mixed)
    cost = cost_model_for(parse_model(args.model), args.cluster, args.hardware_profile, args.model_profile,
                          default_cluster="8xH100")
    model, cluster = cost.model, cost.cluster  # the model in the profiles' dtype when profiles are given
    out = plain_console()
    if loaded is not None:
        plan = loaded
        ev = check_plan(plan, model, cluster, cost)
        if args.out:
            plan.save(args.out)  # in today's version: --check old.json --out new.json upgrades a file
        if args.json:
            print(json.dumps({"valid": True, "layout": plan.layout, **ev.to_dict()}, indent=2))
        else:
            out.print(styled("valid", "green", f": {plan.layout}"))
            _explain(out, ev)
        return 0
    schedules = tuple(s.strip() for s in args.pipeline_schedules.split(",") if s.strip())
    unknown = [s for s in schedules if s not in PIPELINE_SCHEDULES]
    if unknown or not schedules:
        raise PlanError(f"unknown schedule(s) {unknown}; choose from {', '.join(PIPELINE_SCHEDULES)}")
    # --no-recompute: none; else the full space's none / selective / full
    space = SearchSpace(pipeline_schedules=schedules, recompute=(False,) if args.no_recompute else FULL_SPACE.recompute,
                        same_mesh=args.same_mesh)
    request = SearchRequest(model, cluster, args.seq_len, args.global_batch, space, cost, top=args.top, mode=args.mode)
    result = _run_search(request, quiet=args.json)
    best = result.best
    if args.out:
        best.plan.save(args.out)
    if args.json:
        print(json.dumps(_result_json(result), indent=2))
        return 0
    _table(out, result)
    if args.explain:
        _explain(out, best.evaluation)
        if args.against:
            from flexmesh.commands.plan_terms import print_against

            other = load_plan(args.against)
            check_plan(other, model, cluster, cost)  # same model and cluster, a layout that can run
            print_against(out, cost, best.plan, other)
    if args.out:
        out.print(f"wrote best plan to {args.out}", highlight=False)
    return 0


def _run_search(request: SearchRequest, quiet: bool) -> SearchResult:
    if quiet:
        return best_plans(request)
    t0 = time.perf_counter()
    state: dict = {}

    def progress(done: int, total: int) -> None:
        # Start the bar lazily so that fast searches print nothing extra.
        if "bar" not in state and time.perf_counter() - t0 > PROGRESS_AFTER_S and done < total:
            bar = Progress(TextColumn("searching"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                           TimeElapsedColumn(), console=plain_console(stderr=True), transient=True)
            bar.start()
            state["bar"], state["task"] = bar, bar.add_task("search", total=total)
        if "bar" in state:
            state["bar"].update(state["task"], completed=done)

    try:
        return best_plans(request, progress=progress)
    finally:
        if "bar" in state:
            state["bar"].stop()


def _row(c: Candidate) -> dict:
    ev = c.evaluation
    return {"layout": c.plan.layout, "origin": c.origin, "step_time_s": ev.step_time, "tokens_per_s": ev.tokens_per_s,
            "mfu": ev.mfu, "peak_memory_gib": [m["total"] / GIB for m in ev.memory]}


def _result_json(r: SearchResult) -> dict:
    return {
        "search_seconds": r.search_seconds,
        "mode": r.mode,
        "configurations": r.configurations,
        "best": {**_row(r.best), "plan": r.best.plan.to_dict()},
        "plans": [_row(c) for c in r.plans],
        "baselines": {k: (_row(v) if v else None) for k, v in r.baselines.items()},
    }


def _table(out: Console, r: SearchResult) -> None:
    t = Table(title=f"best plans ({r.mode} search, {r.configurations} configurations, {r.search_seconds:.2f} s)")
    for col, just in (("#", "right"), ("layout", "left"), ("step s", "right"), ("tokens/s", "right"),
                      ("MFU", "right"), ("peak GiB per stage", "left"), ("from", "left")):
        t.add_column(col, justify=just, overflow="fold")
    for i, c in enumerate(r.plans, 1):
        ev = c.evaluation
        mem = " ".join(f"{m['total'] / GIB:.1f}" for m in ev.memory)
        t.add_row(str(i), c.plan.layout, f"{ev.step_time:.4g}", f"{ev.tokens_per_s:,.0f}", f"{ev.mfu:.1%}", mem,
                  c.origin)
    out.print(t)
    for name, b in r.baselines.items():
        if b is not None:
            out.print(f"baseline {name}: {b.evaluation.step_time:.4g} s, {b.evaluation.tokens_per_s:,.0f} tokens/s, "
                      f"MFU {b.evaluation.mfu:.1%}  ({b.plan.layout})", highlight=False)
        else:
            out.print(f"baseline {name}: no layout of this family fits", highlight=False)


def _explain(out: Console, ev: Evaluation) -> None:
    t = Table(title="step time (busiest pipeline rank)")
    t.add_column("part")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    parts = [("compute", ev.compute), ("exposed communication", ev.exposed_comm), ("pipeline bubble", ev.bubble),
             ("gradient sync + optimizer", ev.grad_sync)]
    for name, v in parts:
        t.add_row(name, f"{v:.4f}", f"{v / ev.step_time:.1%}")
    t.add_row("step", f"{ev.step_time:.4f}", "")
    out.print(t)
    m = Table(title=f"memory per pipeline rank, GiB (usable {ev.budget / GIB:.1f})")
    keys = ["states", "activations", "transient", "logits", "total"]
    m.add_column("rank", justify="right")
    for k in keys:
        m.add_column(k, justify="right")
    for r, mem in enumerate(ev.memory):
        m.add_row(str(r), *(f"{mem.get(k, 0.0) / GIB:.2f}" for k in keys))
    out.print(m)


# ---- mixed clusters -----------------------------------------------------------------------------------
def _no_profiles(args: argparse.Namespace) -> None:
    if args.hardware_profile or args.model_profile:
        raise PlanError("profiles describe one device type; a mixed cluster is priced from the device presets "
                        "of its groups: drop --hardware-profile / --model-profile")


def check_groups_command(args: argparse.Namespace, plan: Plan) -> int:
    """Validate a plan of replica groups against --model and --cluster (default: the cluster it names)."""
    _no_profiles(args)
    cluster = parse_mixed_cluster(args.cluster if args.cluster is not None else plan.cluster)
    model = parse_model(args.model)
    ev = check_groups(plan, model, cluster)
    if args.out:
        plan.save(args.out)  # in today's version: --check old.json --out new.json upgrades a file
    if args.json:
        print(json.dumps({"valid": True, "layout": plan.layout.split("\n"), **ev.to_dict()}, indent=2))
        return 0
    out = plain_console()
    out.print(styled("valid", "green", f": {len(plan.groups)} replica groups on {cluster.label}, predicted step "
                                       f"{ev.step_time:.3f} s, {ev.tokens_per_s:,.0f} tokens/s"))
    out.print(replica_table(plan, ev, cluster, "replica groups"))
    out.print(stage_table(plan, ev))
    return 0


# Flags of the uniform search that the mixed search has no counterpart for: (flag, attribute, default).
UNIFORM_ONLY = (("--top", "top", 5), ("--same-mesh", "same_mesh", False),
                ("--no-recompute", "no_recompute", False), ("--mode", "mode", "auto"),
                ("--pipeline-schedules", "pipeline_schedules", ",".join(PIPELINE_SCHEDULES)))


def run_mixed(args: argparse.Namespace, cluster: MixedCluster) -> int:
    """Search a plan of replica groups on a mixed cluster, rank it beside its baselines (and --against
    a plan file), print (or --json) and --out it."""
    _no_profiles(args)
    given = [flag for flag, attr, default in UNIFORM_ONLY if getattr(args, attr) != default]
    if given:
        raise PlanError(f"{given[0]} steers the search of one device type; a mixed cluster's search chooses its "
                        "groups' layouts itself (each type's own group is searched in full): drop it")
    model = parse_model(args.model)
    costs = MixedCosts(model, cluster)
    result, baselines = _search_mixed(model, cluster, args, costs)
    plan, ev = result.plan, result.evaluation
    if args.against:  # a plan file of this cluster, priced by the same cost model, beside the baselines
        other = load_plan(args.against)
        theirs = check_groups(other, model, cluster, costs)
        baselines["against"] = {"layout": other.layout.split("\n"), "step_time_s": theirs.step_time,
                                "tokens_per_s": theirs.tokens_per_s, "plan": args.against}
    if args.out:
        plan.save(args.out)
    if args.json:
        print(json.dumps({"search_seconds": result.search_seconds, "configurations": result.configurations,
                          "best": {"layout": plan.layout.split("\n"), "step_time_s": ev.step_time,
                                   "tokens_per_s": ev.tokens_per_s, "plan": plan.to_dict()},
                          "baselines": baselines, "ratios": ratios(ev.tokens_per_s, baselines)}, indent=2))
        return 0
    out = plain_console()
    out.print(replica_table(plan, ev, cluster,
                            f"plan on {cluster.label}: step {ev.step_time:.3f} s, "
                            f"{ev.tokens_per_s:,.0f} tokens/s ({result.configurations} configurations, "
                            f"{result.search_seconds:.2f} s)"))
    out.print(baseline_table(ev.tokens_per_s, baselines))
    if args.explain:
        out.print(stage_table(plan, ev))
    if args.out:
        out.print(f"wrote the plan to {args.out}", highlight=False)
    return 0


def _search_mixed(model, cluster: MixedCluster, args: argparse.Namespace, costs: MixedCosts
                  ) -> tuple[MixedResult, dict]:
    seq, gb = args.seq_len, args.global_batch
    if args.json:
        return plan_mixed(model, cluster, seq, gb, costs), mixed_baselines(model, cluster, seq, gb, costs)
    t0 = time.perf_counter()
    state: dict = {}

    def bar(label: str, done: int, total: int) -> None:
        if "bar" not in state and time.perf_counter() - t0 > PROGRESS_AFTER_S:
            state["bar"] = Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                    console=plain_console(stderr=True), transient=True)
            state["bar"].start()
            state["task"] = state["bar"].add_task(label, total=total)
        if "bar" in state:
            state["bar"].update(state["task"], description=label, completed=done, total=total)

    names = ["uniform", "proportional", "sum_of_parts"]
    try:
        result = plan_mixed(model, cluster, seq, gb, costs, progress=lambda d, t: bar("searching", d, t))
        baselines = mixed_baselines(model, cluster, seq, gb, costs,
                                     progress=lambda name: bar(f"baseline {name}", names.index(name), len(names)))
    finally:
        if "bar" in state:
            state["bar"].stop()
    return result, baselines
