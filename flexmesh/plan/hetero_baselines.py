"""What a heterogeneous plan is compared with, each priced by the same cost model.

- ``uniform``: today's uniform planner (:func:`flexmesh.plan.best_plans`) on the whole world with
  every device treated as the slowest type (lowest peak FLOP/s, then least memory), priced as such.
- ``proportional``: the uniform planner's best layout within what a HeteroPlan expresses (no ZeRO,
  no context parallelism, 1F1B, one TP degree) on the slowest type, its replicas kept, the global
  batch shared out in proportion to each replica's peak FLOP/s (its devices' datasheet peaks times
  their speed factors; largest remainders, at least one micro-batch each), then priced with each
  device's own numbers (:func:`flexmesh.plan.hetero_cost.evaluate_hetero`): step = slowest replica.
- ``sum_of_parts`` (a reference, not a plan): each group planned alone by the uniform planner at
  nominal speed, with the whole global batch; their throughputs added.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from flexmesh.errors import PlanError
from flexmesh.layout.hetero import HeteroPlan, Replica
from flexmesh.plan.best import best_plans
from flexmesh.plan.hetero_cost import MixedCosts, evaluate_hetero
from flexmesh.plan.space import SearchRequest, SearchSpace
from flexmesh.spec.cluster import ClusterSpec, MixedCluster
from flexmesh.spec.model import ModelSpec

# The part of the uniform planner's space a HeteroPlan expresses: replicas hold whole copies (no
# ZeRO), one TP degree per stage and no context parallelism, 1F1B.
HETERO_SPACE = SearchSpace(pipeline_schedules=("1f1b",), cp_kinds=(), zero_stages=(0,), max_cp=1, same_mesh=True)


def slowest_group(cluster: MixedCluster, dtype: str = "bf16") -> int:
    """The group whose device has the lowest peak FLOP/s (then the least memory)."""
    return min(range(len(cluster.groups)), key=lambda g: (cluster.groups[g].device.peak_flops(dtype),
                                                          cluster.groups[g].device.memory_gib))


def uniform_cluster(cluster: MixedCluster, dtype: str = "bf16") -> ClusterSpec:
    """The whole world as nodes of the slowest device (nodes of the groups' common node size).

    >>> from flexmesh.spec.cluster import parse_mixed_cluster
    >>> uniform_cluster(parse_mixed_cluster("1x8xH100+2x8xA100-40GB")).label
    '3x8xA100-40GB'
    """
    per_node = math.gcd(*(g.devices_per_node for g in cluster.groups))
    slow = cluster.groups[slowest_group(cluster, dtype)]
    return ClusterSpec(cluster.world_size // per_node, per_node, slow.device)


def _row(layout: str, step: float, tokens: float, **extra: object) -> dict:
    return {"layout": layout, "step_time_s": step, "tokens_per_s": tokens, **extra}


def uniform_baseline(model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int) -> dict | None:
    """Today's planner on the world of the slowest type (None when nothing fits there)."""
    uc = uniform_cluster(cluster, model.dtype)
    try:
        best = best_plans(SearchRequest(model, uc, seq_len, global_batch, top=1)).best
    except PlanError:
        return None
    return _row(best.plan.layout, best.evaluation.step_time, best.evaluation.tokens_per_s, cluster=uc.label)


def proportional_plan(model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int,
                      costs: MixedCosts) -> HeteroPlan | None:
    """The uniform layout's replicas with batch shares by peak FLOP/s (None when no such layout fits)."""
    uc = uniform_cluster(cluster, model.dtype)
    try:
        best = best_plans(SearchRequest(model, uc, seq_len, global_batch, HETERO_SPACE, top=1),
                          with_baselines=False).best
        uniform = HeteroPlan.from_uniform(best.plan)
    except PlanError:
        return None
    mu = uniform.replicas[0].microbatch_size
    weights = [sum(cluster.device_of(d).peak_flops(model.dtype) * cluster.speed(d) for d in r.devices)
               for r in uniform.replicas]
    units = global_batch // mu
    if units < len(weights):
        return None
    # Largest remainders over what is left after one micro-batch each.
    rest = units - len(weights)
    exact = [rest * w / sum(weights) for w in weights]
    shares = [1 + math.floor(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: exact[i] - math.floor(exact[i]), reverse=True)[
            :units - sum(shares)]:
        shares[i] += 1
    replicas = tuple(Replica(r.stages, mu * m, m) for r, m in zip(uniform.replicas, shares))
    return replace(uniform, cluster=cluster.label, replicas=replicas, predicted={},
                   cost_source="+".join(dict.fromkeys(c.source for c in costs.groups)))


def proportional_baseline(model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int,
                          costs: MixedCosts) -> dict | None:
    plan = proportional_plan(model, cluster, seq_len, global_batch, costs)
    if plan is None:
        return None
    ev = evaluate_hetero(plan, costs)
    shares = "/".join(str(r.batch) for r in plan.replicas)
    row = _row(f"{len(plan.replicas)} replicas of {plan.replicas[0].compact.split(' | ', 1)[1]}, batches {shares}",
               ev.step_time, ev.tokens_per_s, fits=ev.fits)
    return row if ev.fits else {**row, "note": "does not fit in memory on some device"}


def sum_of_parts(model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int) -> dict:
    """Each group planned alone by the uniform planner (whole global batch); throughputs added."""
    parts = []
    for g in cluster.groups:
        alone = replace(g, speed_factors=())
        try:
            best = best_plans(SearchRequest(model, alone, seq_len, global_batch, top=1)).best
            parts.append(_row(best.plan.layout, best.evaluation.step_time, best.evaluation.tokens_per_s,
                              cluster=alone.label))
        except PlanError:
            parts.append(_row("nothing fits", math.inf, 0.0, cluster=alone.label))
    return {"tokens_per_s": sum(p["tokens_per_s"] for p in parts), "parts": parts}


def hetero_baselines(model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int, costs: MixedCosts,
                     progress: Callable[[str], None] | None = None) -> dict:
    """``{"uniform": ..., "proportional": ..., "sum_of_parts": ...}`` (a baseline is None where nothing fits)."""
    out: dict = {}
    for name, fn in (("uniform", lambda: uniform_baseline(model, cluster, seq_len, global_batch)),
                     ("proportional", lambda: proportional_baseline(model, cluster, seq_len, global_batch, costs)),
                     ("sum_of_parts", lambda: sum_of_parts(model, cluster, seq_len, global_batch))):
        if progress:
            progress(name)
        out[name] = fn()
    return out
