"""The static search: the fastest plan (per-layer strategies, pipeline split, schedule, micro-batches) that fits.

Outer loop: pipeline degree ``pp`` (divisors of the world whose stages are whole nodes or divide a
node), pipeline schedule (1F1B, GPipe, interleaved with ``v`` chunks per rank) and micro-batch count ``m``
(:func:`~flexmesh.plan.space.outer_configurations`). For each, and for each way of splitting the
layers into chunks (:func:`~flexmesh.plan.stage.layer_splits`), every pipeline rank gets a small
set of options; an option is the strategies of all its layers, summarised by what the step time and
memory depend on. The ranks' options are then combined exactly
(:func:`~flexmesh.plan.stage.combine`) and the best few plans are re-evaluated with
:meth:`CostModel.evaluate_stages`, whose numbers are the ones reported.

Two methods produce a rank's options behind one interface
(:class:`~flexmesh.plan.stage.SearchMethod`), chosen once per search by :func:`choose_method`:

- exact (small models and clusters, flexmesh.plan.exact): a dynamic program over the layers of each
  chunk on every layer split; equals brute-force enumeration.
- fast (everything else, flexmesh.plan.fast): one mesh and ZeRO stage per rank with k of its
  layers recomputed, in closed form, on a few balanced layer splits.

This module returns the searched candidates only; flexmesh.plan.best ranks them beside the uniform
baselines and explains when nothing fits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from flexmesh.cost import in_flight
from flexmesh.errors import PlanError
from flexmesh.layout.overlap import Overlap
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.plan.exact import ExactSearch
from flexmesh.plan.fast import FastSearch
from flexmesh.plan.space import (
    FASTEST,
    LEAN,
    REDUCE_ONCE,
    Candidate,
    Chunk,
    Mesh,
    SearchRequest,
    candidate_strategies,
    evaluate_chunks,
    mesh_of,
    outer_configurations,
    to_plan,
)
from flexmesh.plan.stage import RankOptions, SearchMethod, Sizes, StageContext, combine, layer_splits, prune

# "auto" mode runs the exact DP when a stage spanning the world has at most this many strategies.
EXACT_MAX_STRATEGIES = 16
# "auto" mode runs the exact DP only up to this many layers (the DP's frontiers grow with them).
EXACT_MAX_LAYERS = 6

Progress = Callable[[int, int], None]  # (configurations done, configurations in all)
Configuration = tuple[int, str, int, int]  # (pp, pipeline schedule, v, m)
# (estimate, (chunks, pp, schedule, v, m, overlap))
Found = tuple[float, tuple[tuple[Chunk, ...], int, str, int, int, Overlap]]
Deferred = tuple[float, Configuration, Overlap]  # (lower bound on the step, configuration, overlap to price)


@dataclass(frozen=True)
class SearchOutcome:
    """The searched plans that fit, best estimate first (at most three times the request's ``top``)."""

    candidates: tuple[Candidate, ...]
    mode: str  # "exact" or "fast"
    configurations: int  # (pp, schedule, m, mesh, split) combinations examined


def choose_method(request: SearchRequest) -> SearchMethod:
    """The method the request's mode names; "auto" is exact on few layers and a small strategy set.

    >>> from flexmesh.spec import MODEL_PRESETS, parse_cluster
    >>> choose_method(SearchRequest(MODEL_PRESETS["llama2-7b"], parse_cluster("8xA100-80GB"), 2048, 64)).name
    'fast'
    """
    mode = request.mode
    if mode == "auto":
        # The exact DP's frontiers grow quickly with the number of strategies; keep it to small spaces.
        world_strategies = candidate_strategies(request.model, request.cluster, request.world_size, request.space)
        small = len(world_strategies) <= EXACT_MAX_STRATEGIES
        mode = "exact" if request.model.num_layers <= EXACT_MAX_LAYERS and small else "fast"
    return ExactSearch() if mode == "exact" else FastSearch()


def search(request: SearchRequest, progress: Progress | None = None) -> SearchOutcome:
    """The searched plans that fit, best first; raises PlanError when no layout can even be formed.

    An empty outcome means nothing fits (flexmesh.plan.best says what would).
    """
    request.check()
    request = request.resolved()
    method = choose_method(request)
    configs = _configurations(request)
    found: list[Found] = []
    examined = 0
    pruned: dict[tuple, list[LayerStrategy]] = {}  # per (stage devices, micro-batch size, mesh)
    later: list[Deferred] = []
    for ci, config in enumerate(configs):
        if progress:
            progress(ci, len(configs))
        n, best, deferred = _search_configuration(request, method, config, pruned)
        examined += n
        found.extend(best)
        later.extend(deferred)
    # Deferred options (fast method): priced only where their lower bound beats the top estimates so far.
    top = max(request.top, 1)
    for bound, config, overlap in sorted(later, key=lambda x: x[0]):
        estimates = sorted(f[0] for f in found)[:top]
        if len(estimates) == top and bound >= estimates[-1]:
            break  # every later bound is higher still
        n, best, _ = _search_configuration(request, method, config, pruned, only=overlap)
        examined += n
        found.extend(best)
    if progress:
        progress(len(configs), len(configs))
    return SearchOutcome(tuple(_evaluate(request, found)), method.name, examined)


def _configurations(request: SearchRequest) -> list[Configuration]:
    """The outer configurations, or PlanError when the world size or the batch leaves none."""
    model, cluster, world, gb = request.model, request.cluster, request.world_size, request.global_batch
    configs = list(outer_configurations(model, world, gb, request.space, cluster.devices_per_node))
    if not configs:
        raise PlanError(
            f"no pipeline/micro-batch layout for world size {world} with {model.num_layers} layers and global "
            f"batch {gb}: pipeline stages must be whole nodes of {cluster.devices_per_node} or divide one; "
            "change the device count or the pipeline degrees allowed")
    if not any(candidate_strategies(model, cluster, world // pp, request.space, gb // m) for pp, _, _, m in configs):
        raise PlanError(
            f"world size {world} cannot be factored into pp x tp x cp x dp for {model.name} ({model.num_heads} "
            f"heads) with global batch {gb}: dp must divide the sequences of a micro-batch, tp the node size "
            f"and the heads, and cp is a power of two; use a global batch with more factors in common with "
            f"{world}")
    return configs


def overlap_choices(strategies: Sequence[LayerStrategy], m: int) -> list[Overlap]:
    """The overlap options worth pricing for these strategies and ``m`` micro-batches, fastest first.

    :data:`FASTEST` always; the others only where they change something: :data:`LEAN` when some
    strategy uses tp or ZeRO-3 (it frees their buffers), :data:`REDUCE_ONCE` when ``m > 1`` and some
    strategy shards gradients (ZeRO-2/3). Both methods price the same options; the fast method skips
    :data:`LEAN` on a configuration where no option :data:`FASTEST` left out for memory would fit
    with the buffers it frees (LEAN is otherwise never faster, see :func:`_search_configuration`).

    >>> from flexmesh.layout.strategy import LayerStrategy as S
    >>> [o.label for o in overlap_choices([S(tp=2, dp=2, zero=3)], 4)]
    ['tp-overlap grad:bucketed', 'tp-overlap grad:last', 'grad:bucketed no-prefetch']
    >>> [o.label for o in overlap_choices([S(dp=4, zero=1)], 4)]
    ['tp-overlap grad:bucketed']
    """
    out = [FASTEST]
    if m > 1 and any(s.zero >= 2 for s in strategies):
        out.append(REDUCE_ONCE)
    if any(s.tp > 1 or s.zero == 3 for s in strategies):
        out.append(LEAN)
    return out


def _search_configuration(request: SearchRequest, method: SearchMethod, config: Configuration,
                          pruned: dict[tuple, list[LayerStrategy]],
                          only: Overlap | None = None) -> tuple[int, list[Found], list[Deferred]]:
    """(splits examined, best layout per mesh and overlap, deferred overlaps) of one (pp, schedule, v, m);
    ``pruned`` caches across calls; ``only`` prices that one overlap option.

    The exact method prices every overlap option. The fast method prices :data:`FASTEST`, then:

    - :data:`LEAN` only where some option FASTEST left out for memory would fit with the buffers LEAN
      frees: LEAN keeps the same states, activations and tails and is never faster, so elsewhere its
      options are FASTEST's, slower;
    - :data:`REDUCE_ONCE` deferred with a lower bound: its options are FASTEST's keeping unsharded
      ZeRO-2/3 gradients, without their backward reduce-scatters, with tails no shorter; the step of
      each split is at least the pipeline of each rank's least time plus the largest least tail
      over the options that fit (:meth:`~flexmesh.plan.fast.FastRanks.bounds`). :func:`search`
      prices it where the bound beats the estimates found.
    """
    pp, schedule, v, m = config
    cost = request.cost_model()
    D, mbs = request.world_size // pp, request.global_batch // m
    strategies = candidate_strategies(request.model, request.cluster, D, request.space, mbs)
    if not strategies:
        return 0, [], []
    flight = tuple(in_flight(schedule, pp, r, m, v) for r in range(pp))
    overlaps = [only] if only is not None else list(request.space.overlaps or overlap_choices(strategies, m))
    meshes: Sequence[Mesh | None] = sorted({mesh_of(s) for s in strategies}) if request.space.same_mesh else [None]
    examined, found, deferred = 0, list[Found](), list[Deferred]()
    prune_more = only is None and request.space.overlaps is None and not method.exhaustive_splits
    lean_fits_more = not (prune_more and FASTEST in overlaps)
    once_bound = float("inf")  # lower bound on the step under REDUCE_ONCE (fast method)
    for overlap in overlaps:
        if prune_more and overlap == LEAN and not lean_fits_more:
            continue
        if prune_more and overlap == REDUCE_ONCE:
            if once_bound < float("inf"):
                deferred.append((once_bound, config, overlap))
            continue
        overlap = cost.effective_overlap(overlap, m)  # priced exactly as evaluate_stages prices it
        ctx = StageContext(cost, request.seq_len, mbs, pp, v, flight, cost.memory_budget, overlap, cost.cluster.pace)
        for mesh in meshes:
            key = (D, mbs, mesh, overlap)
            if key not in pruned:
                pruned[key] = prune(ctx, [s for s in strategies if mesh is None or mesh_of(s) == mesh])
            ranks = method.ranks(ctx, pruned[key], mesh)
            splits = layer_splits(ctx, pruned[key], request.model.num_layers, pp * v, method.exhaustive_splits)
            examined += len(splits)
            best = _best_split(ranks, splits, pp, schedule, m, v)
            if overlap == FASTEST:
                lean_fits_more = lean_fits_more or getattr(ranks, "lean_fits_more", True)
                bound = getattr(ranks, "once_bound", None)
                once_bound = min([once_bound] + ([bound(sz, schedule, m, v) for sz in splits] if bound else [0.0]))
            if best is not None:
                obj, sizes, chosen = best
                chunks = tuple(tuple(c) for c in ranks.chunks(sizes, chosen))
                found.append((obj, (chunks, pp, schedule, v, m, overlap)))
    return examined, found, deferred


def _best_split(ranks: RankOptions, splits: list[Sizes], pp: int, schedule: str, m: int,
                v: int) -> tuple[float, Sizes, list[Any]] | None:
    """(estimate, split, chosen payload per rank) of the best split, or None when no split fits."""
    best: tuple[float, Sizes, list[Any]] | None = None
    for sizes in splits:
        options, payloads = [], []
        for r in range(pp):
            t, u, pay = ranks.options(sizes, r)
            if not len(t):
                break
            options.append((t, u))
            payloads.append(pay)
        else:
            res = combine(options, schedule, m, v)
            if res is not None and (best is None or res[0] < best[0]):
                best = (res[0], sizes, [payloads[r][int(j)] for r, j in enumerate(res[1])])
    return best


def _evaluate(request: SearchRequest, found: list[Found]) -> list[Candidate]:
    """Re-evaluate the best estimates with the cost model until ``3 x top`` distinct plans that fit."""
    cost = request.cost_model()
    found.sort(key=lambda x: x[0])
    results: list[Candidate] = []
    seen = set()
    for obj, (chunks, pp, schedule, v, m, overlap) in found:
        if len(results) >= max(request.top, 1) * 3:
            break
        ev = evaluate_chunks(cost, chunks, pp, schedule, v, m, request.seq_len, request.global_batch, overlap)
        if not ev.fits:
            continue
        plan = to_plan(request.model, request.cluster, cost, chunks, pp, schedule, v, m, request.seq_len,
                       request.global_batch, ev, overlap)
        if plan.layout in seen:
            continue
        seen.add(plan.layout)
        results.append(Candidate(plan, ev, "search", obj))
    return results
