"""Plans a mixed cluster's search is compared with, evaluated through the same cost model: the uniform
planner on every device at the slowest one's pace, replicas of one layout with proportional shares, and
one group per device type planned by the uniform search (flexmesh.search.best).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from flexmesh.cost.training.mixed import MixedCosts, evaluate_groups
from flexmesh.errors import PlanError
from flexmesh.layout.mesh import replica_groups
from flexmesh.layout.plan import Plan
from flexmesh.layout.shares import split_by_weight
from flexmesh.search.best import best_plans
from flexmesh.search.space import Candidate, SearchRequest, SearchSpace
from flexmesh.spec.cluster import ClusterSpec, MixedCluster
from flexmesh.spec.model import ModelSpec

# What a plan on a mixed cluster is compared with, each priced by the same cost model on the cluster
# as given, speed factors included (a layout over devices of several speeds runs at its slowest
# device's: ClusterSpec.pace):
# - ``uniform``: the uniform planner (flexmesh.search.best_plans) on the whole world with every device
#   treated as the slowest type (lowest peak FLOP/s, then least memory), each at its own speed
#   factor, priced as such;
# - ``proportional``: the uniform planner's best layout within what splits into replica groups of one
#   pipeline (REPLICA_SPACE) on the slowest type, its replicas kept, the global batch shared out in
#   proportion to each replica's peak FLOP/s (its devices' datasheet peaks times their speed factors;
#   flexmesh.layout.shares, at least one micro-batch each), then priced with each device's own numbers
#   (flexmesh.cost.training.mixed.evaluate_groups): step = slowest replica;
# - ``sum_of_parts`` (a reference, not a plan): each device group planned alone by the uniform
#   planner (at its slowest device's speed), with the whole global batch; their throughputs added.

# Device group ``kind`` of a mixed cluster -> its best plan alone by the uniform planner (search and uniform
# baselines, the whole global batch, at its speed), None when nothing fits: a mixed search's searches
# (flexmesh.search.mixed_types.TypePlans.planned_alone), shared so that no group is searched twice.
Alone = Callable[[int], Candidate | None]
# Each baseline's plan(s) by name, each with the cluster it is priced on (``uniform``: the slowest
# type's world; ``sum_of_parts``: one per group, None where nothing fits), for who prices them again
# (flexmesh plan --lengths).
BaselinePlans = dict[str, list[tuple[Plan, MixedCluster] | None]]

# The part of the uniform planner's space that splits into replica groups of one pipeline
# (flexmesh.layout.mesh.replica_groups): whole copies (no ZeRO), one TP degree per stage, no context
# parallelism, 1F1B.
REPLICA_SPACE = SearchSpace(pipeline_schedules=("1f1b",), cp_kinds=(), zero_stages=(0,), max_cp=1, same_mesh=True)


def slowest_group(cluster: MixedCluster, dtype: str = "bf16") -> int:
    """The group whose device has the lowest peak FLOP/s (then the least memory)."""
    return min(range(len(cluster.groups)), key=lambda g: (cluster.groups[g].device.peak_flops(dtype),
                                                          cluster.groups[g].device.memory_gib))


def uniform_cluster(cluster: MixedCluster, dtype: str = "bf16") -> ClusterSpec:
    """The whole world as nodes of the slowest device (nodes of the groups' common node size), every
    device at its own speed factor, on the cluster's own network: a layout over the whole world crosses
    every link between groups, so its nodes talk at the slowest of the groups' NICs and those links.

    >>> from flexmesh.spec.cluster import parse_mixed_cluster
    >>> u = uniform_cluster(parse_mixed_cluster("1x8xH100+2x8xA100-40GB"))
    >>> u.label, u.device.node_net_gbps
    ('3x8xA100-40GB', 200.0)
    """
    per_node = math.gcd(*(g.devices_per_node for g in cluster.groups))
    slow = cluster.groups[slowest_group(cluster, dtype)]
    speeds = tuple(cluster.speed(r) for r in range(cluster.world_size))
    links = [link for _, _, link in cluster.links]
    device = replace(slow.device,
                     node_net_gbps=min([g.device.node_net_gbps for g in cluster.groups] + [x.gbps for x in links]),
                     inter_latency_us=max([g.device.inter_latency_us for g in cluster.groups]
                                          + [x.latency_us for x in links]))
    return ClusterSpec(cluster.world_size // per_node, per_node, device,
                       speeds if any(f != 1.0 for f in speeds) else ())


def _row(layout: str, step: float, tokens: float, **extra: object) -> dict:
    return {"layout": layout, "step_time_s": step, "tokens_per_s": tokens, **extra}


def uniform_baseline(model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int,
                     alone: Alone | None = None, plans: BaselinePlans | None = None) -> dict | None:
    """Today's planner on the world of the slowest type (None when nothing fits there); on a cluster of
    one device type that world is its one group: ``alone(0)`` where given (:data:`Alone`)."""
    uc = uniform_cluster(cluster, model.dtype)
    if alone is not None and len(cluster.groups) == 1:
        best = alone(0)
        if best is None:
            return None
    else:
        try:
            best = best_plans(SearchRequest(model, uc, seq_len, global_batch, top=1), explain_no_fit=False).best
        except PlanError:  # no row: why is not asked (explaining searches again)
            return None
    if plans is not None:
        plans["uniform"] = [(best.plan, MixedCluster((uc,)))]
    return _row(best.plan.layout, best.evaluation.step_time, best.evaluation.tokens_per_s, cluster=uc.label)


def proportional_plan(model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int,
                      costs: MixedCosts) -> Plan | None:
    """The uniform layout's replicas with batch shares by peak FLOP/s (None when no such layout fits)."""
    uc = uniform_cluster(cluster, model.dtype)
    try:
        best = best_plans(SearchRequest(model, uc, seq_len, global_batch, REPLICA_SPACE, top=1),
                          with_baselines=False, explain_no_fit=False).best
        uniform = replica_groups(best.plan)
    except PlanError:
        return None
    mu = uniform.groups[0].microbatch_size
    weights = [sum(cluster.device_of(d).peak_flops(model.dtype) * cluster.speed(d) for d in g.ranks)
               for g in uniform.groups]
    units = global_batch // mu
    if units < len(weights):
        return None
    groups = tuple(replace(g, share=mu * m, num_microbatches=m)
                   for g, m in zip(uniform.groups, split_by_weight(units, weights)))
    return replace(uniform, cluster=cluster.label, groups=groups, predicted={},
                   cost_source="+".join(dict.fromkeys(c.source for c in costs.groups)))


def proportional_baseline(model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int,
                          costs: MixedCosts, plans: BaselinePlans | None = None) -> dict | None:
    plan = proportional_plan(model, cluster, seq_len, global_batch, costs)
    if plan is None:
        return None
    if plans is not None:
        plans["proportional"] = [(plan, cluster)]
    ev = evaluate_groups(plan, costs)
    shares = "/".join(str(g.share) for g in plan.groups)
    first = plan.groups[0]
    stages = " | ".join(f"[{s.start},{s.end}) tp{first.stage_tp(i)}" for i, s in enumerate(first.stages))
    mixes = [_devices(cluster, g.ranks) for g in plan.groups]
    held = f"each {mixes[0]}" if len(set(mixes)) == 1 else ", ".join(mixes)  # equal batches: equal devices, said
    row = _row(f"{len(plan.groups)} replicas of {stages}, batches {shares} ({held})",
               ev.step_time, ev.tokens_per_s, fits=ev.fits)
    return row if ev.fits else {**row, "note": "does not fit in memory on some device"}


def _devices(cluster: MixedCluster, ranks) -> str:  # noqa: ANN001 - a replica's ranks
    """A replica's devices by type, as a cluster is written: ``4xH100-80GB+8xA100-40GB``."""
    count: dict[str, int] = {}
    for r in ranks:
        name = cluster.device_of(r).name
        count[name] = count.get(name, 0) + 1
    return "+".join(f"{n}x{name}" for name, n in count.items())


def sum_of_parts(model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int,
                 alone: Alone | None = None, plans: BaselinePlans | None = None) -> dict:
    """Each group planned alone by the uniform planner (whole global batch, the group's speed factors);
    throughputs added. ``alone`` (:data:`Alone`) gives each group's plan where the caller has it."""
    parts = []
    for kind, group in enumerate(cluster.groups):
        if alone is not None:
            best = alone(kind)
        else:
            try:
                best = best_plans(SearchRequest(model, group, seq_len, global_batch, top=1),
                                  explain_no_fit=False).best
            except PlanError:
                best = None
        if best is None:
            parts.append(_row("nothing fits", math.inf, 0.0, cluster=group.label))
        else:
            parts.append(_row(best.plan.layout, best.evaluation.step_time, best.evaluation.tokens_per_s,
                              cluster=group.label))
            if plans is not None:
                plans.setdefault("sum_of_parts", [None] * len(cluster.groups))[kind] = (
                    best.plan, MixedCluster((group,)))
    return {"tokens_per_s": sum(p["tokens_per_s"] for p in parts), "parts": parts}


def mixed_baselines(model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int, costs: MixedCosts,
                     progress: Callable[[str], None] | None = None, alone: Alone | None = None,
                     plans: BaselinePlans | None = None) -> dict:
    """``{"uniform": ..., "proportional": ..., "sum_of_parts": ...}`` (a baseline is None where nothing fits).
    ``alone`` (:data:`Alone`): each device group's own plan, shared with the mixed search that ran it;
    ``plans``, when given, receives each baseline's plan(s) (:data:`BaselinePlans`)."""
    out: dict = {}
    for name, fn in (("uniform", lambda: uniform_baseline(model, cluster, seq_len, global_batch, alone, plans)),
                     ("proportional",
                      lambda: proportional_baseline(model, cluster, seq_len, global_batch, costs, plans)),
                     ("sum_of_parts", lambda: sum_of_parts(model, cluster, seq_len, global_batch, alone, plans))):
        if progress:
            progress(name)
        out[name] = fn()
    return out
