"""Tables of a plan of replica groups against its baselines, and the demo's mixed-cluster planning part.

``flexmesh plan`` on a mixed cluster prints :func:`replica_table` and :func:`baseline_table`
(``--explain`` adds :func:`stage_table`); ``flexmesh demo`` calls :func:`demo_mixed_plan`.
"""

from __future__ import annotations

from rich import box
from rich.console import Console, JustifyMethod
from rich.table import Table

from flexmesh.cost.training.mixed import GroupsEvaluation, MixedCosts
from flexmesh.layout.plan import Plan, ReplicaGroup
from flexmesh.layout.ranks import rank_runs
from flexmesh.search.baselines import mixed_baselines
from flexmesh.search.mixed import MixedResult, plan_mixed
from flexmesh.spec.cluster import MixedCluster, parse_mixed_cluster
from flexmesh.spec.model import parse_model
from flexmesh.units import GIB

DEMO_MODEL, DEMO_CLUSTER, DEMO_SEQ_LEN, DEMO_BATCH = "llama2-13b", "1x8xH100+2x8xA100-40GB", 4096, 256


def device_list(devices: tuple[int, ...] | list[int]) -> str:
    """Ranks as ranges: ``0-1,4-5``.

    >>> device_list((0, 1, 4, 5, 9))
    '0-1,4-5,9'
    """
    return rank_runs(tuple(sorted(devices)))


def group_compact(g: ReplicaGroup) -> str:
    """A group of one pipeline in a line, e.g. ``b96 m12 | [0,20) tp4 | [20,40) tp4-ac``; a middle chunk of no
    layers ``[20,20) relay``."""
    suffix = {"none": "", "selective": "-sac", "full": "-ac"}
    stages = " | ".join(f"[{s.start},{s.end}) relay" if g.relay(i)
                        else f"[{s.start},{s.end}) tp{g.stage_tp(i)}{suffix[str(g.anchor(i).recompute)]}"
                        for i, s in enumerate(g.stages))
    return f"b{g.share} m{g.num_microbatches} | {stages}"


def replica_table(plan: Plan, ev: GroupsEvaluation, cluster: MixedCluster, title: str) -> Table:
    """One row per replica group: devices, layout, pipeline time, tail and peak memory against the budget."""
    t = Table(title=title)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("#", "right"), ("devices", "left"), ("layout", "left"), ("pipeline s", "right"), ("tail s", "right"),
        ("peak GiB / usable", "right"))
    for col, just in columns:
        t.add_column(col, justify=just, overflow="fold")
    for i, (g, e) in enumerate(zip(plan.groups, ev.replicas)):
        worst = max(e.stages, key=lambda s: s.memory["total"] / s.budget)
        names = "+".join(dict.fromkeys(cluster.device_of(d).name for d in g.ranks))
        t.add_row(str(i), f"{device_list(g.ranks)} {names}", group_compact(g), f"{e.pipeline_time:.3f}",
                  f"{e.tail:.3f}", f"{worst.memory['total'] / GIB:.1f} / {worst.budget / GIB:.1f}")
    if plan.unused:
        t.caption = f"unused devices: {device_list(plan.unused)}"
    return t


def stage_table(plan: Plan, ev: GroupsEvaluation) -> Table:
    """``--explain``: every stage's device, time per micro-batch and memory (GiB)."""
    t = Table(title=f"stages: step {ev.step_time:.3f} s = slowest pipeline + largest tail (exposed gradient "
                    "all-reduce + optimizer); memory in GiB, max = usable", box=box.SIMPLE_HEAD, padding=(0, 1),
              pad_edge=False, show_edge=False)
    for col in ("g.s", "device", "layers", "tp", "ac", "s/mb", "states", "act", "other", "total/max"):
        t.add_column(col, justify="left" if col in ("device", "ac") else "right", no_wrap=True)
    short = {"none": "-", "selective": "sel", "full": "full"}
    for i, e in enumerate(ev.replicas):
        for j, s in enumerate(e.stages):
            m = s.memory
            t.add_row(f"{i}.{j}", s.device, f"[{s.layers[0]},{s.layers[1]})", str(s.tp),
                      short.get(s.recompute, s.recompute), f"{s.time:.4f}", f"{m['states'] / GIB:.1f}",
                      f"{m['activations'] / GIB:.1f}", f"{(m['transient'] + m['logits']) / GIB:.1f}",
                      f"{m['total'] / GIB:.1f}/{s.budget / GIB:.1f}")
    return t


def baseline_table(tokens_per_s: float, baselines: dict) -> Table:
    """The plan's tokens/s against ``uniform``, ``proportional`` and the sum of the parts."""
    t = Table(title="against the baselines (one cost model prices all)")
    columns: tuple[tuple[str, JustifyMethod], ...] = (("", "left"), ("tokens/s", "right"), ("plan is", "right"),
                                                      ("layout", "left"))
    for col, just in columns:
        t.add_column(col, justify=just, overflow="fold")
    t.add_row("the plan", f"{tokens_per_s:,.0f}", "", "")
    labels = {"uniform": "uniform (all as the slowest type)", "proportional": "proportional (batch by peak FLOP/s)",
              "sum_of_parts": "sum of the parts planned alone", "against": "--against plan"}
    for name, label in labels.items():
        if name not in baselines:
            continue
        b = baselines[name]
        if not b or not b.get("tokens_per_s"):
            t.add_row(label, "-", "", "nothing fits")
            continue
        layout = b.get("layout") or " + ".join(f"{p['cluster']}: {p['layout']}" for p in b.get("parts", []))
        layout = "; ".join(layout) if isinstance(layout, list) else layout
        t.add_row(label, f"{b['tokens_per_s']:,.0f}", f"{tokens_per_s / b['tokens_per_s']:.2f}x", layout)
    return t


def ratios(tokens_per_s: float, baselines: dict) -> dict[str, float | None]:
    """The plan's tokens/s over each baseline's (None where the baseline has none)."""
    return {k: (tokens_per_s / v["tokens_per_s"] if v and v.get("tokens_per_s") else None)
            for k, v in baselines.items()}


def plan_with_baselines(model: str, cluster: str, seq_len: int, global_batch: int) -> tuple[MixedResult, dict]:
    spec, mixed = parse_model(model), parse_mixed_cluster(cluster)
    costs = MixedCosts(spec, mixed)
    result = plan_mixed(spec, mixed, seq_len, global_batch, costs)
    return result, mixed_baselines(spec, mixed, seq_len, global_batch, costs)


def demo_mixed_search() -> tuple[MixedResult, dict]:
    """The demo's mixed-cluster plan and its baselines (:func:`plan_with_baselines`), unprinted."""
    return plan_with_baselines(DEMO_MODEL, DEMO_CLUSTER, DEMO_SEQ_LEN, DEMO_BATCH)


def demo_mixed_plan(console: Console, found: tuple[MixedResult, dict] | None = None) -> dict:
    """Plan Llama 2 13B on one node of 8 H100 and two of 8 A100-40GB (or take ``found``, what
    :func:`demo_mixed_search` returned), print it beside its baselines, and return the figures
    (tokens/s, ratios, search seconds)."""
    result, baselines = found or demo_mixed_search()
    mixed = parse_mixed_cluster(DEMO_CLUSTER)
    ev = result.evaluation
    console.print(replica_table(result.plan, ev, mixed,
                                f"{DEMO_MODEL} on {DEMO_CLUSTER}, seq {DEMO_SEQ_LEN}, {DEMO_BATCH} per step: "
                                f"{ev.tokens_per_s:,.0f} tokens/s (searched in {result.search_seconds:.1f} s)"))
    console.print(baseline_table(ev.tokens_per_s, baselines))
    return {"tokens_per_s": ev.tokens_per_s, "search_seconds": result.search_seconds,
            "ratios": ratios(ev.tokens_per_s, baselines), "layout": result.plan.layout, "plan": result.plan,
            "cluster": DEMO_CLUSTER, "model": DEMO_MODEL}
