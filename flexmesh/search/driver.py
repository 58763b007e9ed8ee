"""The static search: the fastest plan (per-layer strategies, pipeline split, schedule, micro-batches) that fits.

Outer loop: pipeline degree ``pp`` (divisors of the world whose stages are whole nodes or divide a
node), pipeline schedule (1F1B, GPipe, interleaved with ``v`` chunks per rank) and micro-batch count ``m``
(:func:`~flexmesh.search.space.outer_configurations`). For each, and for each way of splitting the
layers into chunks (:func:`~flexmesh.search.stage.layer_splits`), every pipeline rank gets a small
set of options; an option is the strategies of all its layers, summarised by what the step time and
memory depend on. The ranks' options are then combined exactly
(:func:`~flexmesh.search.stage.combine`) and the best few plans are re-evaluated with
:meth:`CostModel.evaluate_stages`, whose numbers are the ones reported.

Two methods produce a rank's options behind one interface
(:class:`~flexmesh.search.stage.SearchMethod`), chosen once per search by :func:`choose_method`:

- exact (small models and clusters, flexmesh.search.exact): a dynamic program over the layers of each
  chunk on every layer split; equals brute-force enumeration.
- fast (everything else, flexmesh.search.fast): one mesh and ZeRO stage per rank with k of its
  layers recomputed, in closed form, on a few balanced layer splits.

This module returns the searched candidates only; flexmesh.search.best ranks them beside the uniform
baselines and explains when nothing fits.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from flexmesh.cost import CostModel, in_flight, pipeline_time
from flexmesh.errors import PlanError
from flexmesh.layout.overlap import Overlap
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.search.exact import ExactSearch
from flexmesh.search.fast import FastSearch
from flexmesh.search.space import (
    FASTEST,
    LEAN,
    REDUCE_ONCE,
    Candidate,
    Chunk,
    Mesh,
    SearchRequest,
    batches_near,
    candidate_strategies,
    evaluate_chunks,
    mesh_of,
    outer_configurations,
    to_plan,
)
from flexmesh.search.stage import RankOptions, SearchMethod, Sizes, StageContext, combine, layer_splits, prune

# "auto" mode runs the exact DP when a stage spanning the world has at most this many strategies.
EXACT_MAX_STRATEGIES = 16
# "auto" mode runs the exact DP only up to this many layers (the DP's frontiers grow with them).
EXACT_MAX_LAYERS = 6
# Skip configurations and layer splits whose lower bound passes the estimates found (tests switch it off
# to compare with pricing every one).
BOUNDED = True
_SLACK = 1 + 1e-9  # a bound is summed in another order than the estimate: skip only past rounding

Progress = Callable[[int, int], None]  # (configurations done, configurations in all)
Configuration = tuple[int, str, int, int]  # (pp, pipeline schedule, v, m)
# (estimate, (chunks, pp, schedule, v, m, overlap))
Found = tuple[float, tuple[tuple[Chunk, ...], int, str, int, int, Overlap]]
Deferred = tuple[float, Configuration, Overlap]  # (lower bound on the step, configuration, overlap to price)

# What searches under one cost model share (the mixed search runs one per device type and batch share):
# per-layer floors (:func:`_lower_bound`) and pruned strategy sets, keyed by everything they depend on
# besides the cost model -- sequence length, micro-batch size, the strategies, the overlap -- and not
# by the global batch, the pipeline schedule or the search space.
_SHARED: weakref.WeakKeyDictionary[CostModel, dict[tuple, Any]] = weakref.WeakKeyDictionary()


def _shared(cost: CostModel) -> dict[tuple, Any]:
    memo = _SHARED.get(cost)
    if memo is None:
        memo = _SHARED[cost] = {}
    return memo


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

    An empty outcome means nothing fits (flexmesh.search.best says what would).
    """
    request.check()
    request = request.resolved()
    method = choose_method(request)
    configs = _configurations(request)
    # Best first: configurations in order of a lower bound on their step (:func:`_lower_bound`); once the
    # bound passes the estimates the evaluation will look at, no later configuration can enter them, and
    # within a configuration no layer split whose bound passes them (:func:`_best_split`).
    bounds = [_lower_bound(request, config) if BOUNDED else 0.0 for config in configs]
    order = sorted(range(len(configs)), key=lambda i: (bounds[i], i))
    horizon = 3 * max(request.top, 1)  # the estimates _evaluate may need
    # (order key, found): estimates that tie keep the order of pricing every configuration in turn
    found: list[tuple[tuple[int, int], Found]] = []
    examined = 0
    later: list[tuple[Deferred, int]] = []
    for done, ci in enumerate(order):
        if progress:
            progress(done, len(configs))
        cutoff = _cutoff(found, horizon)
        if bounds[ci] > cutoff * _SLACK:
            break  # every later bound is higher still
        n, best, deferred = _search_configuration(request, method, configs[ci], cutoff=cutoff)
        examined += n
        found.extend(((0, ci), f) for f in best)
        later.extend((d, ci) for d in deferred)
    # Deferred options (fast method): priced only where their lower bound beats the top estimates so far.
    top = max(request.top, 1)
    for turn, ((bound, config, overlap), _) in enumerate(sorted(later, key=lambda x: (x[0][0], x[1]))):
        estimates = sorted(f[0] for _, f in found)[:top]
        if len(estimates) == top and bound >= estimates[-1]:
            break  # every later bound is higher still
        n, best, _ = _search_configuration(request, method, config, only=overlap,
                                           cutoff=_cutoff(found, horizon))
        examined += n
        found.extend(((1, turn), f) for f in best)
    if progress:
        progress(len(configs), len(configs))
    ordered = [f for _, f in sorted(found, key=lambda x: x[0])]
    return SearchOutcome(tuple(_evaluate(request, ordered)), method.name, examined)


def _cutoff(found: list[tuple[tuple[int, int], Found]], horizon: int) -> float:
    """The ``horizon``-th least estimate of distinct layouts found so far (inf: fewer found, or bounds
    switched off): a plan estimated above it can no longer be among the plans the evaluation looks at.
    One layout found under several overlap options counts once, as the evaluation counts it."""
    if not BOUNDED:
        return float("inf")
    least: dict[tuple, float] = {}
    for _, (estimate, (chunks, pp, schedule, v, m, _overlap)) in found:
        key = (chunks, pp, schedule, v, m)
        least[key] = min(estimate, least.get(key, float("inf")))
    estimates = sorted(least.values())[:horizon]
    return estimates[-1] if len(estimates) == horizon else float("inf")


def _lower_bound(request: SearchRequest, config: Configuration) -> float:
    """A lower bound on the step of every plan of ``config`` from per-layer costs: time, and memory
    where it binds.

    A rank's time per micro-batch is its layers' times plus its ends, pipeline sends and transitions; its
    memory is its layers' ``states + in-flight x activations`` plus transients and ends (none negative).
    Some rank holds ``n >= ceil(layers / pp)`` layers within the budget ``B`` with at least the fewest
    micro-batches in flight of any rank, ``f``: its time is at least ``n x h(B / n)``, ``h(b)`` the least
    mean time of layers averaging ``b`` bytes at most (the linear relaxation: the lower convex hull of the
    strategies' (bytes, time) points, :func:`_least_time`), which grows with ``n``; every other layer
    takes at least the least time of any strategy. The 1F1B/GPipe (``sum + (m - 1) max``) and
    interleaved (``m max + (sum - max) / v``) pipeline times grow with the sum and the largest of the
    rank times, and tails are not negative. Strategies are priced under every overlap the configuration
    may price (:data:`LEAN` frees only transient buffers and never runs faster than :data:`FASTEST`, so
    it is left out). The (time, states, activations) arrays are kept for later configurations and searches
    (:func:`_shared`).
    """
    pp, schedule, v, m = config
    cost = request.cost_model()
    D, mbs, L = request.world_size // pp, request.global_batch // m, request.model.num_layers
    strategies = tuple(candidate_strategies(request.model, request.cluster, D, request.space, mbs))
    overlaps = sorted({cost.effective_overlap(o, m) for o in request.space.overlaps or (FASTEST, REDUCE_ONCE)},
                      key=lambda o: o.label)
    memo, key = _shared(cost), ("floors", request.seq_len, mbs, strategies, tuple(overlaps))
    if key not in memo:
        ctxs = [StageContext(cost, request.seq_len, mbs, pp, v, (), cost.memory_budget, o, cost.cluster.pace)
                for o in overlaps]
        memo[key] = [np.array([[c.time, c.states, c.act] for c in map(ctx.layer, strategies)]).reshape(-1, 3)
                     for ctx in ctxs]
    tables = memo[key]
    t_min = min((float(a[:, 0].min()) for a in tables if len(a)), default=float("inf"))
    n = -(-L // pp)
    f = min(in_flight(schedule, pp, r, m, v) for r in range(pp))
    busy = n * min(_least_time(a[:, 0], a[:, 1] + f * a[:, 2], cost.memory_budget / n) for a in tables)
    if busy == float("inf"):
        return busy  # no rank of n layers fits
    rest = (L - n) * t_min / (pp - 1) if pp > 1 else 0.0
    return float(pipeline_time(schedule, [busy] + [rest] * (pp - 1), m, v))


def _least_time(times: np.ndarray, bytes_: np.ndarray, budget: float) -> float:
    """The least ``sum(x * times)`` over weights ``x >= 0`` summing to 1 with ``sum(x * bytes_) <= budget``
    (inf when no point fits): the best fitting point, or a mix of a fitting point and a faster larger one.

    >>> _least_time(np.array([1.0, 3.0]), np.array([10.0, 2.0]), 6.0)  # half and half
    2.0
    """
    fits = bytes_ <= budget
    if not fits.any():
        return float("inf")
    best = float(times[fits].min())
    faster = ~fits & (times < best)
    if faster.any():
        ti, wi = times[fits][:, None], bytes_[fits][:, None]
        tj, wj = times[faster][None, :], bytes_[faster][None, :]
        best = min(best, float((ti + (budget - wi) / (wj - wi) * (tj - ti)).min()))
    return best


def _configurations(request: SearchRequest) -> list[Configuration]:
    """The outer configurations, or PlanError when the world size or the batch leaves none."""
    model, cluster, world, gb = request.model, request.cluster, request.world_size, request.global_batch
    configs = list(outer_configurations(model, world, gb, request.space, cluster.devices_per_node))
    if not configs:
        raise PlanError(
            f"no pipeline/micro-batch layout for world size {world} with {model.num_layers} layers and global "
            f"batch {gb}: pipeline stages must be whole nodes of {cluster.devices_per_node} or divide one; "
            "change the device count or the pipeline degrees allowed")
    if not _factored(request, gb, configs):
        degrees = sorted({s.dp for pp in {c[0] for c in configs}
                          for s in candidate_strategies(model, cluster, world // pp, request.space)})
        if not degrees:  # no strategy at any batch: the degrees asked for, not the batch
            raise PlanError(f"{world} devices leave no layout for {model.name} whatever the batch: tp must divide the "
                            f"node size and the {model.num_heads} heads, cp be a power of two; change the device "
                            "count or the degrees the plan must use")
        nearest = next((b for b in batches_near(gb, set(degrees), tries=8) if _factored(request, b)), None)
        raise PlanError(
            f"global batch {gb} divides over no data-parallel degree that {world} devices leave for {model.name} "
            f"(degree{'s' * (len(degrees) > 1)} {', '.join(map(str, degrees))}, beside tp dividing the node size and "
            f"the {model.num_heads} heads, cp a power of two), so no layout takes it; "
            + (f"try --global-batch {nearest}" if nearest is not None else
               f"use a global batch with more factors in common with {world}"))
    return configs


def _factored(request: SearchRequest, batch: int, configs: list[Configuration] | None = None) -> bool:
    """Whether some outer configuration of ``request`` at ``batch`` sequences has a strategy that divides its
    micro-batch (``configs``: the configurations at that batch, when made already)."""
    model, cluster, world = request.model, request.cluster, request.world_size
    if configs is None:
        configs = list(outer_configurations(model, world, batch, request.space, cluster.devices_per_node))
    return any(candidate_strategies(model, cluster, world // pp, request.space, batch // m) for pp, _, _, m in configs)


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
                          only: Overlap | None = None,
                          cutoff: float = float("inf")) -> tuple[int, list[Found], list[Deferred]]:
    """(splits examined, best layout per mesh and overlap, deferred overlaps) of one (pp, schedule, v, m);
    pruned strategy sets are kept for later calls and searches (:func:`_shared`); ``only`` prices that one
    overlap option; layer splits whose bound passes ``cutoff`` are not combined (:func:`_best_split`).

    The exact method prices every overlap option. The fast method prices :data:`FASTEST`, then:

    - :data:`LEAN` only where some option FASTEST left out for memory would fit with the buffers LEAN
      frees: LEAN keeps the same states, activations and tails and is never faster, so elsewhere its
      options are FASTEST's, slower;
    - :data:`REDUCE_ONCE` deferred with a lower bound: its options are FASTEST's keeping unsharded
      ZeRO-2/3 gradients, without their backward reduce-scatters, with tails no shorter; the step of
      each split is at least the pipeline of each rank's least time plus the largest least tail
      over the options that fit (:meth:`~flexmesh.search.fast.FastRanks.bounds`). :func:`search`
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
    memo = _shared(cost)
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
            mine = tuple(s for s in strategies if mesh is None or mesh_of(s) == mesh)
            key = ("pruned", request.seq_len, mbs, overlap, mine)
            if key not in memo:
                memo[key] = prune(ctx, list(mine))
            kept = memo[key]
            ranks = method.ranks(ctx, kept, mesh)
            splits = layer_splits(ctx, kept, request.model.num_layers, pp * v, method.exhaustive_splits)
            examined += len(splits)
            best = _best_split(ranks, splits, pp, schedule, m, v, cutoff)
            if overlap == FASTEST:
                lean_fits_more = lean_fits_more or getattr(ranks, "lean_fits_more", True)
                bound = getattr(ranks, "once_bound", None)
                once_bound = min([once_bound] + ([bound(sz, schedule, m, v) for sz in splits] if bound else [0.0]))
            if best is not None:
                obj, sizes, chosen = best
                chunks = tuple(tuple(c) for c in ranks.chunks(sizes, chosen))
                found.append((obj, (chunks, pp, schedule, v, m, overlap)))
    return examined, found, deferred


def _best_split(ranks: RankOptions, splits: list[Sizes], pp: int, schedule: str, m: int, v: int,
                cutoff: float = float("inf")) -> tuple[float, Sizes, list[Any]] | None:
    """(estimate, split, chosen payload per rank) of the best split, or None when no split fits or every
    split's bound passes ``cutoff``.

    A split's step is at least the pipeline of each rank's fastest option plus the largest of each
    rank's shortest tail (the pipeline time grows with every rank's time); a split whose bound passes
    ``cutoff`` or reaches the best step so far cannot improve on them and is not combined.
    """
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
            # frontiers: times ascending, tails descending
            bound = pipeline_time(schedule, [t[0] for t, _ in options], m, v) + max(u[-1] for _, u in options)
            if bound > cutoff * _SLACK or (best is not None and bound > best[0] * _SLACK):
                continue
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
