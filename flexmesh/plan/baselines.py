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
    FULL_SPACE,
    Candidate,
    SearchRequest,
    SearchSpace,
    candidate_strategies,
    divisors,
    evaluate_chunks,
    pow2_upto,
    to_plan,
)
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import ModelSpec


def uniform_plan(model: ModelSpec, cluster: ClusterSpec, strategy: LayerStrategy, pp: int, schedule: str, m: int,
                 seq_len: int, global_batch: int, cost: CostModel, v: int = 1) -> Candidate:
    """One strategy for every layer, layers split evenly over ``pp * v`` chunks."""
    sizes = even_split(model.num_layers, pp * v)
    chunks = [(strategy,) * n for n in sizes]
    ev = evaluate_chunks(cost, chunks, pp, schedule, v, m, seq_len, global_batch)
    plan = to_plan(model, cluster, cost, chunks, pp, schedule, v, m, seq_len, global_batch, ev)
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
    for pp in pow2_upto(min(world, L)):
        if world % pp:
            continue
        D = world // pp
        for tp in pow2_upto(min(D, cluster.devices_per_node)):
            dp = D // tp
            for m in divisors(global_batch):
                mbs = global_batch // m
                for zero in (0, 1):
                    for ac in (False, True):
                        s = LayerStrategy(tp=tp, dp=dp, zero=zero if dp > 1 else 0, recompute=ac)
                        if not _allowed(s, space, model, cluster, D, mbs):
                            continue
                        cands.append(uniform_plan(model, cluster, s, pp, "1f1b", m, seq_len, global_batch, cost))
                        if (pp > 1 and "interleaved" in space.pipeline_schedules and L >= 2 * pp and m % pp == 0):
                            cands.append(uniform_plan(model, cluster, s, pp, "interleaved", m, seq_len,
                                                      global_batch, cost, v=2))
    return _best(cands)


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
            for ac in (False, True):
                s = LayerStrategy(tp=1, cp=cp, cp_kind=CPKind.ULYSSES if cp > 1 else CPKind.NONE, dp=dp,
                                  zero=3 if dp * cp > 1 else 0, recompute=ac)
                if not _allowed(s, space, model, cluster, world, global_batch // m):
                    continue
                cands.append(uniform_plan(model, cluster, s, 1, "1f1b", m, seq_len, global_batch, cost))
    return _best(cands)


def baselines(request: SearchRequest) -> dict[str, Candidate | None]:
    """The best plan of each uniform family for the request (None where none of the family fits)."""
    model, cluster, seq, gb = request.model, request.cluster, request.seq_len, request.global_batch
    cost = request.cost_model()
    return {"megatron-3d": megatron_3d(model, cluster, seq, gb, cost, request.space),
            "zero3-ulysses": zero3_ulysses(model, cluster, seq, gb, cost, request.space)}
