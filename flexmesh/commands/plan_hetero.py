"""``flexmesh plan`` on a mixed cluster (groups joined by ``+``, or speed factors that differ), and
``flexmesh plan --check`` of a heterogeneous plan file (format version 3)."""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from flexmesh.errors import PlanError
from flexmesh.layout.hetero import HeteroPlan
from flexmesh.plan.hetero import HeteroResult, plan_hetero
from flexmesh.plan.hetero_baselines import hetero_baselines
from flexmesh.plan.hetero_check import check_hetero_plan
from flexmesh.plan.hetero_cost import MixedCosts
from flexmesh.report.hetero_demo import baseline_table, ratios, replica_table, stage_table
from flexmesh.spec.cluster import MixedCluster, parse_mixed_cluster
from flexmesh.spec.model import parse_model

PROGRESS_AFTER_S = 1.0  # as the uniform search: a bar only for searches longer than this


def _no_profiles(args: argparse.Namespace) -> None:
    if args.hardware_profile or args.model_profile:
        raise PlanError("profiles describe one device type; a mixed cluster is priced from the device presets "
                        "of its groups: drop --hardware-profile / --model-profile")


def check_hetero(args: argparse.Namespace, plan: HeteroPlan) -> int:
    """Validate a version-3 plan against --model and --cluster (default: the cluster the plan names)."""
    _no_profiles(args)
    cluster = parse_mixed_cluster(args.cluster if args.cluster is not None else plan.cluster)
    model = parse_model(args.model)
    ev = check_hetero_plan(plan, model, cluster)
    if args.json:
        print(json.dumps({"valid": True, "layout": plan.layout.split("\n"), **ev.to_dict()}, indent=2))
        return 0
    out = Console()
    out.print(f"[green]valid[/]: {len(plan.replicas)} replicas on {cluster.label}, predicted step "
              f"{ev.step_time:.3f} s, {ev.tokens_per_s:,.0f} tokens/s", highlight=False)
    out.print(replica_table(plan, ev, cluster, "replicas"))
    out.print(stage_table(plan, ev))
    return 0


def run_hetero(args: argparse.Namespace, cluster: MixedCluster) -> int:
    """Search a HeteroPlan, rank it beside its baselines, print (or --json) and --out it."""
    _no_profiles(args)
    model = parse_model(args.model)
    costs = MixedCosts(model, cluster)
    result, baselines = _search(model, cluster, args, costs)
    plan, ev = result.plan, result.evaluation
    if args.out:
        plan.save(args.out)
    if args.json:
        print(json.dumps({"search_seconds": result.search_seconds, "configurations": result.configurations,
                          "best": {"layout": plan.layout.split("\n"), "step_time_s": ev.step_time,
                                   "tokens_per_s": ev.tokens_per_s, "plan": plan.to_dict()},
                          "baselines": baselines, "ratios": ratios(ev.tokens_per_s, baselines)}, indent=2))
        return 0
    out = Console()
    out.print(replica_table(plan, ev, cluster,
                            f"heterogeneous plan on {cluster.label}: step {ev.step_time:.3f} s, "
                            f"{ev.tokens_per_s:,.0f} tokens/s ({result.configurations} configurations, "
                            f"{result.search_seconds:.2f} s)"))
    out.print(baseline_table(ev.tokens_per_s, baselines))
    if args.explain:
        out.print(stage_table(plan, ev))
    if args.out:
        out.print(f"wrote the plan to {args.out}", highlight=False)
    return 0


def _search(model, cluster: MixedCluster, args: argparse.Namespace, costs: MixedCosts) -> tuple[HeteroResult, dict]:
    seq, gb = args.seq_len, args.global_batch
    if args.json:
        return plan_hetero(model, cluster, seq, gb, costs), hetero_baselines(model, cluster, seq, gb, costs)
    t0 = time.perf_counter()
    state: dict = {}

    def bar(label: str, done: int, total: int) -> None:
        if "bar" not in state and time.perf_counter() - t0 > PROGRESS_AFTER_S:
            state["bar"] = Progress(TextColumn("{task.description}"), BarColumn(),
                                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                    console=Console(stderr=True), transient=True)
            state["bar"].start()
            state["task"] = state["bar"].add_task(label, total=total)
        if "bar" in state:
            state["bar"].update(state["task"], description=label, completed=done, total=total)

    names = ["uniform", "proportional", "sum_of_parts"]
    try:
        result = plan_hetero(model, cluster, seq, gb, costs, progress=lambda d, t: bar("searching", d, t))
        baselines = hetero_baselines(model, cluster, seq, gb, costs,
                                     progress=lambda name: bar(f"baseline {name}", names.index(name), len(names)))
    finally:
        if "bar" in state:
            state["bar"].stop()
    return result, baselines
