"""Length bucketing by dynamic programming: few buckets, least padding.

A MILP over sequences is too big; over buckets it is small. Each sequence is rounded *up* to its
bucket's upper edge (so memory and time are never underestimated), which costs ``edge - length``
phantom tokens. Choosing ``k`` edges to minimise the total phantom tokens is a 1-D optimal
partition, solved exactly by dynamic programming over the sorted distinct lengths ``v`` with
counts ``c``:

    cost(i, j) = sum_{t=i..j} c_t * (v_j - v_t)            (one bucket covering v_i..v_j)
    best[b][j] = min_{i <= j} best[b-1][i-1] + cost(i, j)

``cost`` comes from prefix sums in O(1), each DP layer is one vectorised min over an upper
triangle, O(k u^2) in all. Beyond ``max_points`` distinct lengths, values are first rounded up to
a quantile grid (a little extra padding, bounded by the grid's spacing) to keep u small.

>>> b = dp_buckets([1, 2, 10, 11, 100], k=3)
>>> b.edges.tolist(), b.index.tolist(), b.padding_tokens
([2, 11, 100], [0, 0, 1, 1, 2], 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.errors import ScheduleError


@dataclass(frozen=True)
class Buckets:
    """Length buckets of a batch: each sequence's bucket and each bucket's upper edge and count."""

    edges: np.ndarray  # upper edge (longest length) of each bucket, increasing
    index: np.ndarray  # bucket of each input sequence
    counts: np.ndarray  # sequences per bucket

    @property
    def padding_tokens(self) -> int:
        """Tokens added by rounding every sequence up to its bucket's edge (needs the lengths: see below)."""
        return int(self._padding)

    _padding: int = 0

    def token_error(self, lengths: ArrayLike) -> float:
        """Phantom tokens as a fraction of real tokens."""
        a = np.asarray(lengths, dtype=np.int64)
        return float((self.edges[self.index] - a).sum() / a.sum())


def _grid(values: np.ndarray, max_points: int) -> np.ndarray:
    """Round values up to at most ``max_points`` quantile points (the maximum always kept)."""
    points = np.unique(np.quantile(values, np.linspace(0, 1, max_points), method="higher"))
    return points[np.searchsorted(points, values, side="left")]


def dp_buckets(lengths: ArrayLike, k: int = 16, max_points: int = 512) -> Buckets:
    """Split ``lengths`` into at most ``k`` buckets minimising phantom tokens (exact on ``max_points`` values)."""
    a = np.asarray(lengths, dtype=np.int64)
    if a.ndim != 1 or a.size == 0:
        raise ScheduleError("bucketing needs a non-empty 1-D list of lengths")
    if k < 1:
        raise ScheduleError(f"bucketing needs k >= 1 buckets, got {k}")
    work = _grid(a, max_points) if np.unique(a).size > max_points else a
    v, c = np.unique(work, return_counts=True)
    u = v.size
    k = min(k, u)
    C = np.concatenate([[0], np.cumsum(c)]).astype(float)
    S = np.concatenate([[0], np.cumsum(c * v.astype(float))])
    i, j = np.meshgrid(np.arange(u), np.arange(u), indexing="ij")
    # cost[i, j] for one bucket over v[i..j]; the lower triangle (i > j) is not a bucket.
    cost = np.where(i <= j, v[j] * (C[j + 1] - C[i]) - (S[j + 1] - S[i]), np.inf)
    best = cost[0].copy()  # one bucket covering v[0..j]
    choice = []
    for _ in range(1, k):
        prev = np.concatenate([[np.inf], best[:-1]])  # best over v[0..i-1] for a bucket starting at i
        total = prev[:, None] + cost
        arg = np.argmin(total, axis=0)
        new = total[arg, np.arange(u)]
        keep = best <= new  # fewer buckets may already be optimal (ties keep the earlier layer)
        choice.append(np.where(keep, -1, arg))
        best = np.minimum(best, new)
    # Walk back from the last value: each layer either starts a bucket at arg or defers to fewer buckets.
    uppers, last = [u - 1], u - 1
    for layer in reversed(choice):
        start = int(layer[last])
        if start > 0:
            uppers.append(start - 1)
            last = start - 1
    edges_work = v[np.array(sorted(uppers))]
    index = np.searchsorted(edges_work, work, side="left")
    # Edges on the original lengths: the longest real length of each bucket (never above the grid edge).
    edges = np.array([a[index == b].max() for b in range(edges_work.size)], dtype=np.int64)
    counts = np.bincount(index, minlength=edges.size)
    return Buckets(edges=edges, index=index, counts=counts, _padding=int((edges[index] - a).sum()))
