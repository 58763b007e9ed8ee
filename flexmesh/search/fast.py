"""The fast search method: closed-form rank options for identical layers (everything but small problems).

Layers are identical, so within a rank whose layers share one mesh and one ZeRO stage the only
per-layer choice left is recomputation (none, selective, full), and then only *how many* layers
take each kind matters (order changes no cost). A rank mixes at most two kinds, k layers of the
more recomputing one (none + full, none + selective or selective + full: 3(n + 1) options instead of
every (n + 1)(n + 2) / 2 split of three). Each rank's options are therefore ``mesh x zero x pair x k``, evaluated
in closed form with numpy from the cost model's per-layer :class:`LayerCost`; the driver tries a few
time- and memory-balanced layer splits (:attr:`FastSearch.exhaustive_splits` is False).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import combinations
from typing import Any, cast

import numpy as np

from flexmesh.cost import LayerCost, pipeline_time
from flexmesh.cost.training.memory import sharded_dp_buffer_bytes, tp_buffer_bytes
from flexmesh.layout.overlap import Overlap
from flexmesh.layout.strategy import LayerStrategy, Recompute
from flexmesh.search.space import LEAN, Chunk, Mesh, mesh_of
from flexmesh.search.stage import Options, Sizes, StageContext, pareto2, tail

_ATTRS = ("time", "bwd", "states", "act", "grad_sync", "optim", "transient")
# Per (mesh, zero): two strategies differing in recomputation, the second recomputing more (it may
# be None when the group has a single strategy).
Group = tuple[LayerStrategy | None, LayerStrategy | None]
Pick = tuple[LayerStrategy | None, LayerStrategy | None, int]  # (lesser, greater recompute, k layers of the greater)
_ORDER = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)


def groups(strategies: list[LayerStrategy]) -> list[Group]:
    """Pairs (lesser, greater recomputation) per (mesh, zero), in first-seen order.

    A (mesh, zero) with one strategy gives (it, None); with two or three, every pair of them.

    >>> from flexmesh.layout.strategy import LayerStrategy as S
    >>> [(str(a), str(b)) for a, b in groups([S(dp=2), S(dp=2, recompute="full"), S(dp=2, recompute="selective")])]
    [('tp1-dp2z0', 'tp1-dp2z0-sac'), ('tp1-dp2z0', 'tp1-dp2z0-ac'), ('tp1-dp2z0-sac', 'tp1-dp2z0-ac')]
    """
    by: dict[tuple, dict[Recompute, LayerStrategy]] = {}
    for s in strategies:
        by.setdefault((mesh_of(s), s.zero), {})[s.recompute_kind] = s
    out: list[Group] = []
    for kinds in by.values():
        present = [kinds[k] for k in _ORDER if k in kinds]
        out.extend(combinations(present, 2) if len(present) > 1 else [(present[0], None)])
    return out


def memory_saving(ctx: StageContext, strategies: list[LayerStrategy]) -> list[LayerStrategy]:
    """Drop a strategy whose recomputation keeps no fewer activation bytes than a sibling (same mesh
    and ZeRO stage) that recomputes less.

    Recomputation trades backward time for activation memory; one that saves no memory only makes
    each micro-batch longer. (Its longer backward may hide a little more gradient sync, at most its
    extra time once per step against that time on every micro-batch, which is why
    :func:`~flexmesh.search.stage.prune`, exact, keeps it.) Under the analytic cost model selective
    recomputation is such a case (flash-style attention keeps no s^2 term); under a model profile
    that measured what the runtime keeps it may save bytes, and stays.
    """
    by: dict[tuple, list[LayerStrategy]] = {}
    for s in strategies:
        by.setdefault((mesh_of(s), s.zero), []).append(s)
    out = []
    for sibs in by.values():
        least = float("inf")
        for s in sorted(sibs, key=lambda x: _ORDER.index(x.recompute_kind)):
            act = ctx.layer(s).act
            if act < least:
                out.append(s)
                least = act
    return out


class FastRanks:
    """Rank options for identical layers: one mesh and ZeRO stage per rank, k of its layers recomputing more.

    ``groups`` lists per (mesh, zero) pairs of strategies with less and more recomputation (the
    second may be None). All groups and all k are evaluated at once as (group x k) numpy arrays from the per-layer
    LayerCost; options are cached per (layers, embed, head, in-flight) since many ranks and splits share them.
    Built once per (pp, v, micro-batch size, mesh): nothing here depends on the schedule or m but
    the in-flight counts, which arrive per call.
    """

    def __init__(self, ctx: StageContext, groups: list[Group]):
        self.ctx, self.groups = ctx, groups
        G = len(groups)

        def table(fn: Callable[[Group, LayerStrategy], LayerCost | None]) -> np.ndarray:
            out = np.zeros((G, len(_ATTRS)))
            for g, pair in enumerate(groups):
                s = pair[0] or pair[1]
                assert s is not None
                c = fn(pair, s)
                if c is not None:
                    out[g] = [getattr(c, a) for a in _ATTRS]
            return out

        self.l0 = table(lambda pr, s: ctx.layer(pr[0]) if pr[0] else None)
        self.l1 = table(lambda pr, s: ctx.layer(pr[1]) if pr[1] else None)
        self.emb = table(lambda pr, s: ctx.ends(s, True, False))
        self.head = table(lambda pr, s: ctx.ends(s, False, True))
        self.has0 = np.array([p[0] is not None for p in groups])[:, None]
        self.has1 = np.array([p[1] is not None for p in groups])[:, None]
        self.crossings = ctx.cost.pipeline_crossings(ctx.pp, ctx.v)
        # Pipeline sends per group, by whether the rank's leave its node (False, True).
        self.p2p = [np.array([ctx.p2p(_any(p), crosses) for p in groups])[:, None] for crosses in (False, True)]
        # Bytes each layer would free under LEAN's overlap (its buffers), when this one's grad reduce is LEAN's.
        lean = ctx.overlap.grad_reduce == LEAN.grad_reduce
        self.lean_l0 = np.array([_freed(ctx, p[0], LEAN) if lean and p[0] else 0.0 for p in groups])[:, None]
        self.lean_l1 = np.array([_freed(ctx, p[1], LEAN) if lean and p[1] else 0.0 for p in groups])[:, None]
        # Backward communication each layer (and the ends) would not expose per micro-batch with ZeRO-2/3
        # gradients reduced once (REDUCE_ONCE), and the gradient bytes it keeps more: for the search's bound.
        self.once_l0 = np.array([_once_saving(ctx, p[0]) if p[0] else 0.0 for p in groups])[:, None]
        self.once_l1 = np.array([_once_saving(ctx, p[1]) if p[1] else 0.0 for p in groups])[:, None]
        self.once_emb = np.array([_once_saving(ctx, _any(p), (True, False)) for p in groups])[:, None]
        self.once_head = np.array([_once_saving(ctx, _any(p), (False, True)) for p in groups])[:, None]
        self.once_x0 = np.array([_once_extra_bytes(ctx, p[0]) if p[0] else 0.0 for p in groups])[:, None]
        self.once_x1 = np.array([_once_extra_bytes(ctx, p[1]) if p[1] else 0.0 for p in groups])[:, None]
        self.cache: dict[tuple, tuple[Options, bool, float, float]] = {}

    def entry(self, sizes: Sizes, pp: int, rank: int, flight: float) -> tuple[Options, bool, float, float]:
        """A rank's options, (times, tails, payload) on the (time, tail) frontier with payload[i] = (group,
        k) (see :meth:`pick`), then :meth:`bounds`' three values; priced once per key."""
        key = self._key(sizes, pp, rank, flight)
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = self._options(*key)
        return hit

    def _key(self, sizes: Sizes, pp: int, rank: int, flight: float) -> tuple[int, bool, bool, float, bool]:
        """(layers, holds the embedding, holds the head, flight, sends leave the node) of the rank's chunks."""
        return (sum(sizes[rank::pp]), rank == 0, (len(sizes) - 1) % pp == rank, flight, self.crossings[rank])

    def bounds(self, sizes: Sizes, pp: int, rank: int, flight: float) -> tuple[bool, float, float]:
        """Of the rank's options under this overlap: whether one left out for memory would fit with
        the buffers :data:`~flexmesh.search.space.LEAN` frees; and under
        :data:`~flexmesh.search.space.REDUCE_ONCE` (the same options with their ZeRO-2/3 gradients
        reduced once: unsharded gradients kept, backward reduce-scatters not exposed, tails no
        shorter) the least time per micro-batch and the least tail of an option that fits (inf: none)."""
        return self.entry(sizes, pp, rank, flight)[1:]

    def pick(self, payload_item: tuple[int, int]) -> Pick:
        """(lesser, greater recompute, k) of a payload item (group, k)."""
        g, k = payload_item
        return (self.groups[g][0], self.groups[g][1], k)

    def _options(self, n: int, embed: bool, head: bool, flight: float,
                 crosses: bool) -> tuple[Options, bool, float, float]:
        ctx = self.ctx
        k = np.arange(n + 1)[None, :]
        nk = n - k
        e = self.emb * embed + self.head * head

        def tot(a: str) -> np.ndarray:
            i = _ATTRS.index(a)
            return nk * self.l0[:, i:i + 1] + k * self.l1[:, i:i + 1] + e[:, i:i + 1]

        ti = _ATTRS.index("transient")
        trans = np.maximum(np.where(nk > 0, self.l0[:, ti:ti + 1], 0.0), np.where(k > 0, self.l1[:, ti:ti + 1], 0.0))
        logits = self.head[:, ti:ti + 1] if head else 0.0
        mem = tot("states") + flight * tot("act") + trans + logits
        formed = (self.has0 | (k == n)) & (self.has1 | (k == 0))
        valid = formed & (mem <= ctx.budget)
        # LEAN keeps states and activations as they are and frees transient buffers only: at most the
        # larger of the two layer kinds' savings comes off the largest transient.
        freed = np.maximum(np.where(nk > 0, self.lean_l0, 0.0), np.where(k > 0, self.lean_l1, 0.0))
        lean_more = bool((formed & ~valid & (mem - freed <= ctx.budget)).any())
        if not valid.any():
            return (np.zeros(0), np.zeros(0), []), lean_more, np.inf, np.inf
        time_ = tot("time") + self.p2p[crosses]
        tails = tail(ctx.cost, tot("grad_sync"), tot("bwd"), tot("optim"), n)
        once = nk * self.once_l0 + k * self.once_l1 + self.once_emb * embed + self.once_head * head
        once_fits = valid & (mem + nk * self.once_x0 + k * self.once_x1 <= ctx.budget)
        once_t = float((time_ - once)[once_fits].min()) if once_fits.any() else np.inf
        once_u = float(tails[once_fits].min()) if once_fits.any() else np.inf
        g, kk = np.nonzero(valid)
        t, u = time_[g, kk], tails[g, kk]
        keep = pareto2(t, u)
        picks = list(zip(g[keep].tolist(), kk[keep].tolist(), strict=True))
        return (t[keep], u[keep], picks), lean_more, once_t, once_u


def _once_extra_bytes(ctx: StageContext, s: LayerStrategy) -> float:
    """Gradient bytes a layer under ``s`` keeps beyond its shard when ZeRO-2/3 gradients are reduced
    once (unsharded until the step's reduce-scatter; ``CostModel._states``)."""
    if s.zero < 2 or ctx.overlap.grad_reduce == "last":
        return 0.0
    return ctx.cost.model.layer_params / s.tp * ctx.cost.grad_bytes * (1 - 1 / s.shard_degree)


def _once_saving(ctx: StageContext, s: LayerStrategy, ends: tuple[bool, bool] | None = None) -> float:
    """Backward communication per micro-batch of ``s`` (a layer, or the ``ends``) under ``ctx.overlap``
    that reducing ZeRO-2/3 gradients once (``grad_reduce="last"``) takes off."""
    if s.zero < 2 or ctx.overlap.grad_reduce == "last":
        return 0.0
    once = replace(ctx.overlap, grad_reduce="last")
    cost, work = ctx.cost, ctx.work(s)
    if s.zero == 2:  # its backward exposes the reduce-scatter beyond ZeRO-1's, which reduces once (cached)
        one = replace(s, zero=1)
        if ends is None:
            return max(0.0, ctx.layer(s).comm_bwd - ctx.layer(one).comm_bwd)
        return max(0.0, ctx.ends(s, *ends).comm_bwd - ctx.ends(one, *ends).comm_bwd)
    if ends is None:
        return max(0.0, ctx.layer(s).comm_bwd - cost.layer(s, work, once).comm_bwd)
    return max(0.0, ctx.ends(s, *ends).comm_bwd - cost.ends(s, work, *ends, once).comm_bwd)


def _freed(ctx: StageContext, s: LayerStrategy, other: Overlap) -> float:
    """Transient bytes a layer under ``s`` needs less under ``other`` than under ``ctx.overlap``
    (communication buffers: TP userbuffers, a prefetched ZeRO-3 layer, per-micro-batch reduce-scatter
    buffers); the rest of its memory is alike."""
    m, tokens, own, g = ctx.cost.model, ctx.work(s).tokens, ctx.overlap, ctx.cost.reduce_bytes
    return max(0.0, tp_buffer_bytes(m, s, tokens, own) - tp_buffer_bytes(m, s, tokens, other)
               + sharded_dp_buffer_bytes(m, s, own, g) - sharded_dp_buffer_bytes(m, s, other, g))


def _any(pair: Group) -> LayerStrategy:
    s = pair[0] or pair[1]
    assert s is not None  # groups() never makes an empty pair
    return s


def expand(picks: Sequence[Pick], sizes: Sizes, pp: int) -> list[Chunk]:
    """Per-chunk strategy tuples from per-rank (lesser, greater, k): the first k layers of a rank take the greater.

    >>> from flexmesh.layout.strategy import LayerStrategy as S
    >>> a, b = S(tp=1, dp=2), S(tp=1, dp=2, recompute=True)
    >>> [[str(s) for s in c] for c in expand([(a, b, 3)], (2, 2), 1)]
    [['tp1-dp2z0-ac', 'tp1-dp2z0-ac'], ['tp1-dp2z0-ac', 'tp1-dp2z0']]
    """
    chunks: list[Chunk] = [()] * len(sizes)
    for rank, (s0, s1, k) in enumerate(picks):
        left = k
        for i in range(rank, len(sizes), pp):
            a = min(left, sizes[i])
            # FastRanks allows k > 0 only with a recomputing strategy and k < n only with the other.
            chunks[i] = cast(Chunk, (s1,) * a + (s0,) * (sizes[i] - a))
            left -= a
    return chunks


class _FastView:
    """:class:`~flexmesh.search.stage.RankOptions` of one configuration over a shared :class:`FastRanks`."""

    def __init__(self, fast: FastRanks, ctx: StageContext):
        self.fast, self.pp, self.flight = fast, ctx.pp, ctx.flight
        # Whether some option of the ranks asked for so far was left out for memory that LEAN would fit.
        self.lean_fits_more = False

    def options(self, sizes: Sizes, rank: int) -> Options:
        out, lean_more, _, _ = self.fast.entry(sizes, self.pp, rank, self.flight[rank])
        self.lean_fits_more = self.lean_fits_more or lean_more
        return out

    def once_bound(self, sizes: Sizes, schedule: str, m: int, v: int) -> float:
        """A lower bound on the step of this split under REDUCE_ONCE: each rank's least time and least
        tail of its options that fit then (:meth:`FastRanks.bounds`); inf when some rank has none."""
        b = [self.fast.bounds(sizes, self.pp, r, self.flight[r])[1:] for r in range(self.pp)]
        if any(t == np.inf for t, _ in b):
            return np.inf
        return pipeline_time(schedule, [t for t, _ in b], m, v) + max(u for _, u in b)

    def chunks(self, sizes: Sizes, chosen: Sequence[Any]) -> list[Chunk]:
        return expand([self.fast.pick(c) for c in chosen], sizes, self.pp)


class FastSearch:
    """The fast method: closed-form rank options on balanced layer splits. One instance per search."""

    name = "fast"
    exhaustive_splits = False

    def __init__(self) -> None:
        self._ranks: dict[tuple, FastRanks] = {}

    def ranks(self, ctx: StageContext, strategies: list[LayerStrategy], mesh: Mesh | None) -> _FastView:
        # Shared by every schedule and m with the same (pp, v, micro-batch size, mesh): the tables
        # depend only on those; the in-flight counts of the configuration come with the view.
        key = (ctx.pp, ctx.v, ctx.mbs, mesh, ctx.overlap)
        if key not in self._ranks:
            self._ranks[key] = FastRanks(ctx, groups(memory_saving(ctx, strategies)))
        return _FastView(self._ranks[key], ctx)
