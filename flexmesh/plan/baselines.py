"""Uniform layouts the search is compared with, evaluated through the same cost model.

- Megatron-style 3D: one (tp, dp) strategy for every layer, ZeRO 0 or 1 (distributed optimizer),
  recomputation all on or all off, an even layer split over pp stages, 1F1B or interleaved.
- ZeRO-3 + Ulysses (DeepSpeed-Ulysses style): no pipeline, no tp, Ulysses degree cp, dp the rest.

Each function grid-searches its family and returns the fastest plan that fits (or None).
Both families lie inside the search's space (flexmesh.plan.search); this module stands on
flexmesh.plan.space only, and flexmesh.plan.best ranks both beside each other.
"""

from __future__ import annotations

from collections.abc import Iterable

from flexmesh.cost import CostModel
from flexmesh.layout.enums import CPKind
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.plan.partition import even_split
from flexmesh.plan.space import (
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
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import ModelSpec


def uniform_plan(model: ModelSpec, cluster: ClusterSpec, strategy: LayerStrategy, pp: int, schedule: str, m: int,
                 seq_len: int, global_batch: int, cost: CostModel, v: int = 1) -> Candidate:
    """One strategy for every layer, layers split evenly over ``pp * v`` chunks, priced with the
    overlap Megatron-Core (--tp-comm-overlap, --overlap-grad-reduce) and FSDP2 (prefetch) run."""
    sizes = even_split(model.num_layers, pp * v)
    chunks = [(strategy,) * n for n in sizes]
    ev = evaluate_chunks(cost, chunks, pp, schedule, v, m, seq_len, global_batch, FASTEST)
    plan = to_plan(model, cluster, cost, chunks, pp, schedule, v, m, seq_len, global_batch, ev, FASTEST)
    return Candidate(plan, ev, "uniform", ev.step_time)


def _best(cands: Iterable[Candidate]) -> Candidate | None:
    fits = [c for c in cands if c.evaluation.fits]
    return min(fits, key=lambda c: c.evaluation.step_time) if fits else None


def _allowed(strategy: LayerStrategy, space: SearchSpace, model: ModelSpec, cluster: ClusterSpec, devices: int,
             mbs: int) -> bool:
    return strategy in candidate_strategies(model, cluster, devices, space, mbs)


def megatron_3d(model: ModelSpec, cluster: ClusterSpec, seq_len: int, global_batch: int, cost: CostModel,
                space: SearchSpace = FULL_SPACE) -> Candidate | None:
    """Best uniform tp x pp x dp layout (ZeRO 0/1, recompute on/off, 1F1B or interleaved, any m)."""
    world, L = cluster.world_size, model.num_layers
    cands = []
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
                        allowed = [s for s in strategies if _allowed(s, space, model, cluster, D, mbs)]
                        cands.extend(_least_recompute(allowed, model, cluster, pp, schedule, m, seq_len,
                                                      global_batch, cost, v))
    return _best(cands)


def _least_recompute(strategies: list[LayerStrategy], model: ModelSpec, cluster: ClusterSpec, pp: int, schedule: str,
                     m: int, seq_len: int, global_batch: int, cost: CostModel, v: int = 1) -> list[Candidate]:
    """Uniform plans of ``strategies`` (least recomputation first) up to the first that fits:
    recomputing more only adds backward time to the same layout, so the rest cannot be faster."""
    out = []
    for s in strategies:
        out.append(uniform_plan(model, cluster, s, pp, schedule, m, seq_len, global_batch, cost, v))
        if out[-1].evaluation.fits:
            break
    return out


def zero3_ulysses(model: ModelSpec, cluster: ClusterSpec, seq_len: int, global_batch: int, cost: CostModel,
                  space: SearchSpace = FULL_SPACE) -> Candidate | None:
    """Best ZeRO-3 + Ulysses layout: pp 1, tp 1, Ulysses degree cp (heads % cp == 0), dp = world / cp."""
    world = cluster.world_size
    cands = []
    for cp in pow2_upto(world):
        if world % cp or model.num_heads % cp:
            continue
        dp = world // cp
        for m in divisors(global_batch):
            strategies = [LayerStrategy(tp=1, cp=cp, cp_kind=CPKind.ULYSSES if cp > 1 else CPKind.NONE, dp=dp,
                                        zero=3 if dp * cp > 1 else 0, recompute=ac) for ac in (False, True)]
            allowed = [s for s in strategies if _allowed(s, space, model, cluster, world, global_batch // m)]
            cands.extend(_least_recompute(allowed, model, cluster, 1, "1f1b", m, seq_len, global_batch, cost))
    return _best(cands)


def baselines(request: SearchRequest) -> dict[str, Candidate | None]:
    """The best plan of each uniform family for the request (None where none of the family fits)."""
    model, cluster, seq, gb = request.model, request.cluster, request.seq_len, request.global_batch
    cost = request.cost_model()
    return {"megatron-3d": megatron_3d(model, cluster, seq, gb, cost, request.space),
            "zero3-ulysses": zero3_ulysses(model, cluster, seq, gb, cost, request.space)}
