"""Uniform layouts the search is compared with, evaluated through the same cost model.

- Megatron-style 3D: one (tp, dp) strategy for every layer, ZeRO 0 or 1 (distributed optimizer),
  recomputation all on or all off, an even layer split over pp stages, 1F1B or interleaved.
- ZeRO-3 + Ulysses (DeepSpeed-Ulysses style): no pipeline, no tp, Ulysses degree cp, dp the rest.

Each function grid-searches its family and returns the fastest plan that fits (or None). On a
mixed cluster the planner's plan is compared with the baselines of :func:`mixed_baselines` (below).
Both families lie inside the search's space (flexmesh.search.driver); this module stands on
flexmesh.search.space only, and flexmesh.search.best ranks both beside each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from flexmesh.cost import CostModel, Evaluation, pipeline_time
from flexmesh.cost.training.experts import ExpertParallel
from flexmesh.cost.training.mixed import MixedCosts, evaluate_groups
from flexmesh.errors import PlanError
from flexmesh.layout.enums import CPKind
from flexmesh.layout.mesh import replica_groups
from flexmesh.layout.overlap import Overlap
from flexmesh.layout.plan import Plan
from flexmesh.layout.shares import split_by_weight
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.search.partition import even_split
from flexmesh.search.space import (
    FASTEST,
    FULL_SPACE,
    Candidate,
    SearchRequest,
    SearchSpace,
    candidate_strategies,
    divisors,
    evaluate_chunks,
    pipeline_degrees,
    pow2_upto,
    to_plan,
)
from flexmesh.spec.cluster import ClusterSpec, MixedCluster
from flexmesh.spec.model import ModelSpec


def uniform_plan(model: ModelSpec, cluster: ClusterSpec, strategy: LayerStrategy, pp: int, schedule: str, m: int,
                 seq_len: int, global_batch: int, cost: CostModel, v: int = 1, overlap: Overlap = FASTEST) -> Candidate:
    """One strategy for every layer, layers split evenly over ``pp * v`` chunks, priced with the
    overlap Megatron-Core (--tp-comm-overlap, --overlap-grad-reduce) and FSDP2 (prefetch) run, or
    ``overlap`` (a search restricted to one, e.g. what flexmesh's runtime runs)."""
    return _priced(model, cluster, strategy, pp, schedule, m, seq_len, global_batch, cost, v, overlap).candidate()


@dataclass(frozen=True)
class _Priced:
    """A uniform layout priced, its Plan built only when it is the one kept (building every
    candidate's plan cost as much as pricing it)."""

    evaluation: Evaluation
    args: tuple

    def candidate(self) -> Candidate:
        model, cluster, cost, chunks, pp, schedule, v, m, seq_len, global_batch, overlap = self.args
        plan = to_plan(model, cluster, cost, chunks, pp, schedule, v, m, seq_len, global_batch, self.evaluation,
                       overlap)
        return Candidate(plan, self.evaluation, "uniform", self.evaluation.step_time)


def _priced(model: ModelSpec, cluster: ClusterSpec, strategy: LayerStrategy, pp: int, schedule: str, m: int,
            seq_len: int, global_batch: int, cost: CostModel, v: int = 1, overlap: Overlap = FASTEST) -> _Priced:
    chunks = [(strategy,) * n for n in even_split(model.num_layers, pp * v)]
    ev = evaluate_chunks(cost, chunks, pp, schedule, v, m, seq_len, global_batch, overlap)
    return _Priced(ev, (model, cluster, cost, chunks, pp, schedule, v, m, seq_len, global_batch, overlap))


def _best(cands: Iterable[_Priced | Candidate]) -> Candidate | None:
    fits = [c for c in cands if c.evaluation.fits]
    if not fits:
        return None
    best = min(fits, key=lambda c: c.evaluation.step_time)
    return best.candidate() if isinstance(best, _Priced) else best


def megatron_3d(model: ModelSpec, cluster: ClusterSpec, seq_len: int, global_batch: int, cost: CostModel,
                space: SearchSpace = FULL_SPACE) -> Candidate | None:
    """Best uniform tp x pp x dp layout (ZeRO 0/1, recompute on/off, 1F1B or interleaved, any m)."""
    world, L = cluster.world_size, model.num_layers
    cands: list[_Priced] = []
    allowed = _allowed(space, model, cluster)
    best = [math.inf]  # the least step of a layout that fits so far: layouts whose floor reaches it are not priced
    for pp in space.pp or pipeline_degrees(world, L, cluster.devices_per_node):
        if world % pp or pp > L:
            continue
        D = world // pp
        for tp in divisors(min(D, cluster.devices_per_node)):
            if D % tp:
                continue
            dp = D // tp
            for m in divisors(global_batch):
                mbs = global_batch // m
                schedules = [("1f1b", 1)]
                if pp > 1 and "interleaved" in space.pipeline_schedules and L >= 2 * pp and m % pp == 0:
                    schedules.append(("interleaved", 2))
                for zero in (0, 1):
                    for schedule, v in schedules:
                        strategies = [LayerStrategy(tp=tp, dp=dp, zero=zero if dp > 1 else 0, recompute=ac)
                                      for ac in (False, True)]
                        cands.extend(_least_recompute([s for s in strategies if allowed(s, D, mbs)], model,
                                                      cluster, pp, schedule, m, seq_len, global_batch, cost, v,
                                                      _overlap(space), best))
    return _best(cands)


def _floor(cost: CostModel, s: LayerStrategy, layers: int, pp: int, schedule: str, m: int, v: int, seq_len: int,
           global_batch: int, overlap: Overlap) -> float:
    """A lower bound of a uniform layout's step: every rank runs at least ``v x floor(layers / (pp v))``
    layers of ``s`` per micro-batch (an even split of ``pp x v`` chunks), priced as
    :meth:`CostModel.evaluate_stages` prices them (compute at the cluster's pace), without its ends,
    sends and tail (none negative); the pipeline time grows with every rank's time."""
    mbs = global_batch // m
    c = cost.layer(s, cost.layer_work(s, mbs, seq_len), cost.effective_overlap(overlap, m))
    per_layer = (c.fwd + c.bwd) / cost.cluster.pace + c.comm_fwd + c.comm_bwd
    return pipeline_time(schedule, [v * (layers // (pp * v)) * per_layer] * pp, m, v)


def _allowed(space: SearchSpace, model: ModelSpec, cluster: ClusterSpec) -> Callable[[LayerStrategy, int, int], bool]:
    """Whether a strategy is among the search's candidates on ``devices`` per stage with ``mbs``
    sequences a micro-batch (the candidates of each (devices, mbs) listed once)."""
    listed: dict[tuple[int, int], set[LayerStrategy]] = {}

    def allowed(strategy: LayerStrategy, devices: int, mbs: int) -> bool:
        if (devices, mbs) not in listed:
            listed[(devices, mbs)] = set(candidate_strategies(model, cluster, devices, space, mbs))
        return strategy in listed[(devices, mbs)]
    return allowed


def _overlap(space: SearchSpace) -> Overlap:
    """The overlap baselines are priced with: the one a restricted search allows, else FASTEST."""
    return space.overlaps[0] if space.overlaps else FASTEST


def _least_recompute(strategies: list[LayerStrategy], model: ModelSpec, cluster: ClusterSpec, pp: int, schedule: str,
                     m: int, seq_len: int, global_batch: int, cost: CostModel, v: int = 1,
                     overlap: Overlap = FASTEST, best: list[float] | None = None) -> list[_Priced]:
    """Uniform layouts of ``strategies`` (least recomputation first) up to the first that fits:
    recomputing more only adds backward time to the same layout, so the rest cannot be faster. With
    ``best`` (a one-item list, the least step that fits so far, kept up to date here) a layout whose
    :func:`_floor` reaches it is not priced, nor are those recomputing more: none of them can win (on a
    tie the one priced first is kept, as before)."""
    out = []
    for s in strategies:
        if best is not None and _floor(cost, s, model.num_layers, pp, schedule, m, v, seq_len, global_batch,
                                       overlap) >= best[0]:
            break
        out.append(_priced(model, cluster, s, pp, schedule, m, seq_len, global_batch, cost, v, overlap))
        if out[-1].evaluation.fits:
            if best is not None:
                best[0] = min(best[0], out[-1].evaluation.step_time)
            break
    return out


def zero3_ulysses(model: ModelSpec, cluster: ClusterSpec, seq_len: int, global_batch: int, cost: CostModel,
                  space: SearchSpace = FULL_SPACE) -> Candidate | None:
    """Best ZeRO-3 + Ulysses layout: pp 1, tp 1, Ulysses degree cp (heads % cp == 0), dp = world / cp."""
    world = cluster.world_size
    cands: list[_Priced] = []
    allowed = _allowed(space, model, cluster)
    for cp in pow2_upto(world):
        if world % cp or model.num_heads % cp:
            continue
        dp = world // cp
        for m in divisors(global_batch):
            strategies = [LayerStrategy(tp=1, cp=cp, cp_kind=CPKind.ULYSSES if cp > 1 else CPKind.NONE, dp=dp,
                                        zero=3 if dp * cp > 1 else 0, recompute=ac) for ac in (False, True)]
            cands.extend(_least_recompute([s for s in strategies if allowed(s, world, global_batch // m)], model,
                                          cluster, 1, "1f1b", m, seq_len, global_batch, cost,
                                          overlap=_overlap(space)))
    return _best(cands)


def baselines(request: SearchRequest) -> dict[str, Candidate | None]:
    """The best plan of each uniform family for the request (None where none of the family fits).

    A mixture of experts runs its experts as those stacks do: Megatron-LM's expert parallelism (whole
    experts over ``ep`` data ranks, its best ``ep`` dividing the experts within a node, never moved)
    and ZeRO-3's with experts fully sharded and placed statically (LAER-MoE's "FSDP+EP" baseline);
    the search prices flexmesh's runtime (its request's cost model: load-following placement)."""
    model, cluster, seq, gb = request.model, request.cluster, request.seq_len, request.global_batch
    cost = request.cost_model()
    if model.moe is None:
        return {"megatron-3d": megatron_3d(model, cluster, seq, gb, cost, request.space),
                "zero3-ulysses": zero3_ulysses(model, cluster, seq, gb, cost, request.space)}
    eps = [e for e in divisors(model.moe.num_experts) if e <= cluster.devices_per_node]
    measured = cost.experts.measured  # a replayed routing trace's static placement, where given
    ep = [megatron_3d(model, cluster, seq, gb, cost.replace(parts=replace(
        cost.parts, experts=ExpertParallel("static", ep=e, measured=measured))), request.space) for e in eps]
    static = cost.replace(parts=replace(cost.parts, experts=replace(cost.experts, placement="static", imbalance=None)))
    return {"megatron-3d": _best([c for c in ep if c is not None]),
            "zero3-ulysses": zero3_ulysses(model, cluster, seq, gb, static, request.space)}


# ---- mixed clusters ------------------------------------------------------------------------------
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
    from flexmesh.search.best import best_plans  # best ranks this module's uniform baselines: imported here

    uc = uniform_cluster(cluster, model.dtype)
    if alone is not None and len(cluster.groups) == 1:
        best = alone(0)
        if best is None:
            return None
    else:
        try:
            best = best_plans(SearchRequest(model, uc, seq_len, global_batch, top=1)).best
        except PlanError:
            return None
    if plans is not None:
        plans["uniform"] = [(best.plan, MixedCluster((uc,)))]
    return _row(best.plan.layout, best.evaluation.step_time, best.evaluation.tokens_per_s, cluster=uc.label)


def proportional_plan(model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int,
                      costs: MixedCosts) -> Plan | None:
    """The uniform layout's replicas with batch shares by peak FLOP/s (None when no such layout fits)."""
    from flexmesh.search.best import best_plans  # best ranks this module's uniform baselines: imported here

    uc = uniform_cluster(cluster, model.dtype)
    try:
        best = best_plans(SearchRequest(model, uc, seq_len, global_batch, REPLICA_SPACE, top=1),
                          with_baselines=False).best
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
    row = _row(f"{len(plan.groups)} replicas of {stages}, batches {shares}",
               ev.step_time, ev.tokens_per_s, fits=ev.fits)
    return row if ev.fits else {**row, "note": "does not fit in memory on some device"}


def sum_of_parts(model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int,
                 alone: Alone | None = None, plans: BaselinePlans | None = None) -> dict:
    """Each group planned alone by the uniform planner (whole global batch, the group's speed factors);
    throughputs added. ``alone`` (:data:`Alone`) gives each group's plan where the caller has it."""
    from flexmesh.search.best import best_plans  # best ranks this module's uniform baselines: imported here

    parts = []
    for kind, group in enumerate(cluster.groups):
        if alone is not None:
            best = alone(kind)
        else:
            try:
                best = best_plans(SearchRequest(model, group, seq_len, global_batch, top=1)).best
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
