"""The exact search method: a dynamic program over the layers of each chunk (small models and clusters).

The DP state is the last layer's strategy (transitions between meshes cost
:meth:`CostModel.transition`), and each state keeps the Pareto frontier of (time, memory, largest
transient, gradient sync, optimizer, -backward) with exact values. The step time is monotone in
each of these, so dropping dominated points never drops the optimum; with every split of the layers
enumerated (:attr:`ExactSearch.exhaustive_splits`), the result equals brute-force enumeration
(tests/test_search.py checks this).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import product
from typing import Any

import numpy as np

from flexmesh.cost import LayerCost
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.search.space import Chunk, Mesh
from flexmesh.search.stage import Options, Sizes, StageContext, pareto2, tail

# Vector of a partial chunk in the exact DP; every entry is one the step time or memory grows with.
_T, _MEM, _TRANS, _GS, _OPT, _NBWD = range(6)
Frontier = tuple[np.ndarray, list[Chunk]]  # (points x 6 vectors, the strategy sequence of each point)


def _vec(c: LayerCost, flight: float, extra_mem: float = 0.0) -> np.ndarray:
    return np.array([c.time, c.states + flight * c.act + extra_mem, c.transient, c.grad_sync, c.optim, -c.bwd])


def pareto(vecs: np.ndarray, block: int = 64) -> np.ndarray:
    """Indices of the points no other point weakly dominates (duplicates keep one), in lexicographic order.

    >>> pareto(np.array([[1.0, 2.0], [2.0, 1.0], [2.0, 2.0], [1.0, 2.0]])).tolist()
    [0, 1]

    Lexicographic order puts every point that weakly dominates another before it (of equal points, the
    first index first), so a point stays when no earlier point dominates it (dominance being transitive:
    when no earlier point that stayed does). The points are compared ``block`` at a time with numpy,
    against the ones kept before the block and with each other inside it, rather than one at a time.
    """
    order = np.lexsort(vecs.T[::-1])
    ranked = vecs[order]
    keep = np.zeros(len(order), dtype=bool)
    kept = ranked[:0]
    for lo in range(0, len(ranked), block):
        part = ranked[lo:lo + block]
        # [i, j]: point j of the block comes before point i and dominates it
        within = np.tri(len(part), k=-1, dtype=bool)
        # [i, j]: kept point j dominates point i
        by_kept = np.ones((len(part), len(kept)), dtype=bool)
        for d in range(ranked.shape[1]):
            within &= part[None, :, d] <= part[:, None, d]
            by_kept &= kept[None, :, d] <= part[:, None, d]
        dominated = within.any(axis=1) | by_kept.any(axis=1)
        keep[lo:lo + block] = ~dominated
        kept = np.concatenate([kept, part[~dominated]])
    return order[keep]


class ExactChunks:
    """Pareto frontiers of every strategy sequence of a chunk, by dynamic programming over layers."""

    def __init__(self, ctx: StageContext, strategies: list[LayerStrategy]):
        self.ctx = ctx
        self.strategies = strategies
        self.cache: dict[tuple, Frontier] = {}

    def frontier(self, n: int, embed: bool, head: bool, sends: bool | None, flight: float) -> Frontier:
        """List of (vector, strategies) for a chunk of ``n`` layers; memory counts ``flight`` micro-batches.
        ``sends``: None for a chunk that does not carry its rank's pipeline sends, else whether they
        leave the node."""
        key = (n, embed, head, sends, flight)
        if key not in self.cache:
            self.cache[key] = self._finish(self._layers(n, embed, sends, flight), head, flight)
        return self.cache[key]

    def _layers(self, n: int, embed: bool, sends: bool | None, flight: float) -> list[Frontier]:
        """Per last strategy, the frontier of the chunk's ``n`` layers (embedding included, head not)."""
        ctx, S = self.ctx, self.strategies
        states: list[Frontier] = []
        for s in S:
            c = ctx.layer(s)
            if embed:
                c = c + ctx.ends(s, True, False)
            v = _vec(c, flight)
            if sends is not None:
                v[_T] += ctx.p2p(s, sends)
            states.append((v[None, :], [(s,)]))
        for _ in range(n - 1):
            new: list[Frontier] = []
            for s in S:
                add = _vec(ctx.layer(s), flight)
                vecs: list[np.ndarray] = []
                seqs: list[Chunk] = []
                for (pv, ps), sp in zip(states, S, strict=True):
                    if not len(pv):
                        continue
                    step = add.copy()
                    step[_T] += ctx.cost.transition(sp, s, ctx.work(sp))
                    nv = pv + step
                    nv[:, _TRANS] = np.maximum(pv[:, _TRANS], add[_TRANS])
                    vecs.append(nv)
                    seqs.extend(q + (s,) for q in ps)
                allv = np.vstack(vecs)
                keep = pareto(allv)
                new.append((allv[keep], [seqs[i] for i in keep]))
            states = new
        return states

    def _finish(self, states: list[Frontier], head: bool, flight: float) -> Frontier:
        """Add the LM head (when this chunk holds it) and merge the per-strategy frontiers."""
        vecs: list[np.ndarray] = []
        seqs: list[Chunk] = []
        for (pv, ps), s in zip(states, self.strategies, strict=True):
            if head:
                e = self.ctx.ends(s, False, True)
                # Logits count once on the rank holding the head; folded into the additive memory entry.
                ev = _vec(e, flight, extra_mem=e.transient)
                ev[_TRANS] = 0.0
                pv = pv + ev
            vecs.append(pv)
            seqs.extend(ps)
        allv = np.vstack(vecs)
        keep = pareto(allv)
        return allv[keep], [seqs[i] for i in keep]


class ExactRanks:
    """:class:`~flexmesh.search.stage.RankOptions` from the chunk DP; a payload is the rank's chunk strategy tuples."""

    def __init__(self, ctx: StageContext, strategies: list[LayerStrategy]):
        self.ctx = ctx
        self.chunker = ExactChunks(ctx, strategies)

    def options(self, sizes: Sizes, rank: int) -> Options:
        """Every feasible combination of the rank's chunk frontiers, reduced to the (time, tail) frontier.

        A chunk of no layers (the embedding or the head alone) runs as the rank's next chunk's first
        layer, or its previous chunk's last (:func:`~flexmesh.layout.strategy.chunk_anchors`; the search
        makes one only where the rank holds other chunks): that chunk's frontier carries its embedding
        or head, and the rank's pipeline sends, exactly."""
        ctx, pp = self.ctx, self.ctx.pp
        n_chunks = len(sizes)
        idx = self._live(sizes, rank)
        embed, head = rank == 0, rank == (n_chunks - 1) % pp
        sends = ctx.crosses(rank)
        fronts = [self.chunker.frontier(sizes[i], embed and i == idx[0], head and i == idx[-1],
                                        sends if i == idx[0] else None, ctx.flight[rank]) for i in idx]
        layers = sum(sizes[i] for i in idx)
        t, u, payload = [], [], []
        for combo in product(*[range(len(f[0])) for f in fronts]):
            vec = sum(fronts[k][0][j] for k, j in enumerate(combo))
            trans = max(fronts[k][0][j][_TRANS] for k, j in enumerate(combo))
            if vec[_MEM] + trans > ctx.budget:
                continue
            t.append(vec[_T])
            u.append(tail(ctx.cost, vec[_GS], -vec[_NBWD], vec[_OPT], layers))
            payload.append(tuple(fronts[k][1][j] for k, j in enumerate(combo)))
        ta, ua = np.asarray(t), np.asarray(u)
        if not len(ta):
            return ta, ua, []
        keep = pareto2(ta, ua)
        return ta[keep], ua[keep], [payload[i] for i in keep]

    def chunks(self, sizes: Sizes, chosen: Sequence[Any]) -> list[Chunk]:
        """Put each rank's chunk tuples back at their chunk indices (rank r holds r, r + pp, ...)."""
        out: list[Chunk] = [()] * len(sizes)
        for r, pay in enumerate(chosen):
            for k, i in enumerate(self._live(sizes, r)):
                out[i] = pay[k]
        return out

    def _live(self, sizes: Sizes, rank: int) -> list[int]:
        """The indices of the rank's chunks that hold layers."""
        return [i for i in range(rank, len(sizes), self.ctx.pp) if sizes[i]]


class ExactSearch:
    """The exact method: the chunk DP on every layer split. One instance per search."""

    name = "exact"
    exhaustive_splits = True

    def ranks(self, ctx: StageContext, strategies: list[LayerStrategy], mesh: Mesh | None) -> ExactRanks:
        # The DP's frontiers depend on the schedule's in-flight counts, so nothing is shared across configurations.
        return ExactRanks(ctx, strategies)
