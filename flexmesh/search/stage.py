"""What both search methods share: one configuration's context, pruning, layer splits, and combining ranks.

For one outer configuration (pp, pipeline schedule, v, m) the search asks a method (exact or fast,
see :class:`SearchMethod`) for every pipeline rank's options on a given layer split. An option is
summarised by the two numbers the step time depends on across ranks: the rank's time per
micro-batch and its tail (exposed gradient sync + optimizer after the pipeline drains); the step is
``pipeline_time(times) + max(tails)`` exactly as :meth:`CostModel.evaluate_stages` computes it, and
:func:`combine` finds its best choice of one option per rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Protocol

import numpy as np

from flexmesh.cost import CostModel, LayerCost, Work, pipeline_times
from flexmesh.layout.overlap import NO_OVERLAP, Overlap
from flexmesh.layout.strategy import LayerStrategy, Recompute
from flexmesh.search.partition import balanced_splits, compositions, count_compositions, end_minimums
from flexmesh.search.space import Chunk, Mesh, mesh_of

# Exhaustive splits are enumerated up to this many per (pp, schedule); beyond it, balanced ones.
MAX_EXACT_SPLITS = 64

Sizes = tuple[int, ...]  # layers per chunk; chunk i runs on pipeline rank i % pp
# (times, tails, payloads) of one rank's options, on the (time, tail) Pareto frontier: times
# ascending, tails strictly descending; a payload is whatever the method needs to rebuild the option.
Options = tuple[np.ndarray, np.ndarray, list[Any]]


@dataclass(frozen=True)
class StageContext:
    """One outer configuration as the per-rank searches see it."""

    cost: CostModel
    seq_len: int
    mbs: int  # sequences per micro-batch across a stage
    pp: int
    v: int
    flight: tuple[float, ...]  # micro-batches in flight per pipeline rank
    budget: float
    overlap: Overlap = NO_OVERLAP  # the plan-level overlap options this configuration is priced under
    # Every device's compute speed (the cluster's pace): compute stretches by 1 / speed, communication
    # does not, as CostModel.evaluate_stages prices it, so the estimate stays the reported step.
    speed: float = 1.0
    _works: dict = field(default_factory=dict, compare=False, repr=False)  # memo of work()

    def work(self, s: LayerStrategy) -> Work:
        """One layer's share of a micro-batch under ``s`` (asked for every layer, option and split)."""
        w = self._works.get(s)
        if w is None:
            w = self._works[s] = self.cost.layer_work(s, self.mbs, self.seq_len)
        return w

    def layer(self, s: LayerStrategy) -> LayerCost:
        """One transformer layer under ``s`` (the cost model caches it)."""
        return self._paced(self.cost.layer(s, self.work(s), self.overlap))

    def ends(self, s: LayerStrategy, embed: bool, head: bool) -> LayerCost:
        """The embedding and/or LM head run next to a layer under ``s``. No recomputation touches
        them, so strategies differing only in it share one (cached) cost."""
        return self._paced(self.cost.ends(_without_recompute(s), self.work(s), embed, head, self.overlap))

    def _paced(self, c: LayerCost) -> LayerCost:
        if self.speed == 1.0:
            return c
        return replace(c, fwd=c.fwd / self.speed, bwd=c.bwd / self.speed, optim=c.optim / self.speed)

    def crosses(self, rank: int) -> bool:
        """Whether pipeline rank ``rank``'s sends leave its node (:meth:`CostModel.pipeline_crossings`)."""
        return self.cost.pipeline_crossings(self.pp, self.v)[rank]

    def p2p(self, s: LayerStrategy, crosses_nodes: bool) -> float:
        """Pipeline sends of a rank whose first chunk starts with ``s``, once per virtual stage."""
        return self.cost.pipeline_p2p(s, self.mbs, self.seq_len, self.pp, crosses_nodes) * self.v


@lru_cache(maxsize=None)
def _without_recompute(s: LayerStrategy) -> LayerStrategy:
    return s if s.recompute_kind is Recompute.NONE else replace(s, recompute=Recompute.NONE)


class RankOptions(Protocol):
    """A method's options for every rank of one configuration and strategy set."""

    def options(self, sizes: Sizes, rank: int) -> Options:
        """Feasible options of pipeline rank ``rank`` under the layer split ``sizes``."""
        ...

    def chunks(self, sizes: Sizes, chosen: Sequence[Any]) -> list[Chunk]:
        """Per-chunk strategies from one chosen payload per rank."""
        ...


class SearchMethod(Protocol):
    """The exact or the fast search; the driver (flexmesh.search.driver) picks one per search."""

    name: str  # "exact" or "fast", as SearchResult.mode reports it
    exhaustive_splits: bool  # every layer split (True) or a few balanced ones past MAX_EXACT_SPLITS

    def ranks(self, ctx: StageContext, strategies: list[LayerStrategy], mesh: Mesh | None) -> RankOptions:
        """Rank options for ``strategies`` (already pruned) under ``ctx``; ``mesh`` keys any cache."""
        ...


def tail(cost: CostModel, grad_sync: Any, bwd: Any, optim: Any, layers: Any) -> Any:
    """Exposed gradient sync + optimizer after the pipeline drains, as evaluate_stages computes it (arrays too)."""
    return cost.exposed_sync(grad_sync, bwd, layers) + optim


def pareto2(t: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Indices of the (t, u) frontier sorted by t ascending (u then strictly descending).

    >>> pareto2(np.array([3.0, 1.0, 2.0, 2.0]), np.array([1.0, 3.0, 1.0, 2.0])).tolist()
    [1, 2]
    """
    order = np.lexsort((u, t))
    best_u = np.minimum.accumulate(u[order])
    keep = np.ones(len(order), dtype=bool)
    keep[1:] = u[order][1:] < best_u[:-1]
    return order[keep]


def prune(ctx: StageContext, strategies: list[LayerStrategy]) -> list[LayerStrategy]:
    """Drop strategies another one of the same mesh beats in every cost entry, as a layer and as an end.

    Same mesh means identical transitions and pipeline sends, so a dominated strategy can be swapped
    for its dominator anywhere without making the step slower or larger (e.g. ZeRO-1 over ZeRO-0).
    """
    def key(s: LayerStrategy) -> list[float]:
        parts = [ctx.layer(s), ctx.ends(s, True, False), ctx.ends(s, False, True)]
        return [x for c in parts for x in (c.time, c.states, c.act, c.transient, c.grad_sync, c.optim, -c.bwd)]

    by_mesh: dict[Mesh, list[LayerStrategy]] = {}
    for s in sorted(strategies):
        by_mesh.setdefault(mesh_of(s), []).append(s)
    out = []
    for group in by_mesh.values():
        keys = np.array([key(s) for s in group])
        for i, s in enumerate(group):
            le = np.all(keys <= keys[i], axis=1)
            lt = np.any(keys < keys[i], axis=1)
            le[i] = False
            # Equal keys: keep only the first in strategy order.
            if not (le & (lt | (np.arange(len(group)) < i))).any():
                out.append(s)
    return out


def layer_splits(ctx: StageContext, strategies: list[LayerStrategy], layers: int, parts: int,
                 exhaustive: bool) -> list[Sizes]:
    """Layer splits to try: all of them when asked or when few, else a few balanced ones and their neighbours.

    Interleaved (``ctx.v >= 2``), the first and last chunk may hold no layer (the embedding or the head
    alone, :func:`~flexmesh.search.partition.end_minimums`); each then runs on a rank that holds other
    chunks, whose layout it takes (:func:`~flexmesh.layout.strategy.chunk_anchors`), so a rank's
    options stay its own.
    """
    lo = end_minimums(parts, ctx.v >= 2)
    if exhaustive or count_compositions(layers, parts, lo) <= MAX_EXACT_SPLITS:
        return list(compositions(layers, parts, lo))
    # Balance by time (the last chunk also runs the head, the first the embedding) and by memory
    # (early 1F1B ranks hold more micro-batches), with a reference strategy: the least-memory one.
    costs = [ctx.layer(s) for s in strategies]  # each priced once: this runs for every configuration
    ref = strategies[min(range(len(strategies)), key=lambda i: (costs[i].states + costs[i].act, costs[i].time))]
    lc = ctx.layer(ref)
    time_extra = [0.0] * parts
    time_extra[0] += ctx.ends(ref, True, False).time / lc.time
    time_extra[-1] += ctx.ends(ref, False, True).time / lc.time
    mem_weight = [lc.states + ctx.flight[i % ctx.pp] * lc.act for i in range(parts)]
    mem_extra = [0.0] * parts
    mem_extra[-1] = ctx.ends(ref, False, True).transient
    return balanced_splits(layers, parts, time_extra, mem_weight, mem_extra, lo)


def combine(options: Sequence[tuple[np.ndarray, np.ndarray]], schedule: str, m: int,
            v: int) -> tuple[float, np.ndarray] | None:
    """Best choice of one option per rank for ``pipeline_time(times) + max(tails)``; exact.

    For a bound U on the largest tail, each rank's best option is its fastest one with tail <= U
    (the step time grows with every rank's time), so sweeping U over every tail value finds the
    optimum. Options arrive as per-rank (times, tails) already reduced to their Pareto frontier.
    Returns (objective, per-rank option index) or None when some rank has no option.

    >>> a = (np.array([1.0, 2.0]), np.array([0.5, 0.1]))
    >>> b = (np.array([1.0]), np.array([0.2]))
    >>> obj, picks = combine([a, b], "1f1b", 4, 1)  # 4 x max time + bubble + max tail
    >>> round(obj, 6), picks.tolist()
    (5.5, [0, 0])
    """
    if any(len(t) == 0 for t, _ in options):
        return None
    all_u = np.unique(np.concatenate([u for _, u in options]))
    # The step is feasible only once every rank has an option with tail <= U.
    lo = max(u.min() for _, u in options)
    all_u = all_u[all_u >= lo]
    # Frontier: t ascending, u descending; the first index with u <= U is the fastest allowed.
    picks = np.stack([np.searchsorted(-u, -all_u, side="left") for _, u in options])  # ranks x len(all_u)
    times = np.stack([t[p] for (t, _), p in zip(options, picks, strict=True)])
    tails = np.stack([u[p] for (_, u), p in zip(options, picks, strict=True)])
    obj = pipeline_times(schedule, times.T, m, v) + tails.max(axis=0)
    c = int(np.argmin(obj))
    return float(obj[c]), picks[:, c]
