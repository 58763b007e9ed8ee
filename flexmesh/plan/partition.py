"""Splitting a model's layers into pipeline chunks: every split for small models, a few balanced ones otherwise.

A partition is a tuple of chunk sizes (each >= 1) summing to the number of layers; chunk ``i`` holds
the next ``sizes[i]`` layers and, with ``pp`` pipeline ranks, runs on rank ``i % pp``.

>>> list(compositions(4, 2))
[(1, 3), (2, 2), (3, 1)]
>>> even_split(10, 4)
(3, 3, 2, 2)
>>> balance(10, 4, extra=[0.0, 0.0, 0.0, 2.0])  # the last chunk also runs the LM head (2 layers' worth)
(3, 3, 3, 1)
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from itertools import combinations, pairwise
from math import comb


def count_compositions(layers: int, parts: int) -> int:
    """How many ways ``layers`` split into ``parts`` non-empty consecutive chunks: C(L-1, k-1)."""
    return comb(layers - 1, parts - 1) if 1 <= parts <= layers else 0


def compositions(layers: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every split of ``layers`` into ``parts`` non-empty chunks, by choosing the cut points."""
    for cuts in combinations(range(1, layers), parts - 1):
        edges = (0, *cuts, layers)
        yield tuple(b - a for a, b in pairwise(edges))


def even_split(layers: int, parts: int) -> tuple[int, ...]:
    """Megatron-style split: equal chunks, the first ``layers % parts`` chunks one layer larger."""
    q, r = divmod(layers, parts)
    return tuple(q + (1 if i < r else 0) for i in range(parts))


def balance(layers: int, parts: int, extra: Sequence[float], weight: Sequence[float] | None = None) -> tuple[int, ...]:
    """Chunk sizes minimising ``max_i(weight_i * n_i + extra_i)``, every ``n_i >= 1``.

    ``extra`` is fixed work per chunk (embedding, LM head) and ``weight`` the cost of one layer on
    that chunk (1 by default; larger where more micro-batches are in flight when balancing memory).
    Adding layers one at a time to the chunk whose cost grows least is optimal for this min-max
    (each chunk's cost is increasing in its own size only), so a heap does it in O(L log k).
    """
    w = list(weight) if weight is not None else [1.0] * parts
    sizes = [1] * parts
    heap = [((sizes[i] + 1) * w[i] + extra[i], i) for i in range(parts)]
    heapq.heapify(heap)
    for _ in range(layers - parts):
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        heapq.heappush(heap, ((sizes[i] + 1) * w[i] + extra[i], i))
    return tuple(sizes)


def neighbours(sizes: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Splits that move one layer between adjacent chunks (keeping every chunk non-empty)."""
    for i in range(len(sizes) - 1):
        for a, b in ((i, i + 1), (i + 1, i)):
            if sizes[a] > 1:
                s = list(sizes)
                s[a] -= 1
                s[b] += 1
                yield tuple(s)


def balanced_splits(layers: int, parts: int, time_extra: Sequence[float], mem_weight: Sequence[float],
                    mem_extra: Sequence[float]) -> list[tuple[int, ...]]:
    """The even split, the time-balanced and the memory-balanced one, and their neighbours, sorted.

    ``time_extra`` is each chunk's fixed work in layers' worth (embedding, LM head); ``mem_weight``
    the memory of one layer on each chunk and ``mem_extra`` each chunk's fixed memory (see :func:`balance`).

    >>> balanced_splits(6, 2, [0.0, 2.0], [1.0, 1.0], [0.0, 0.0])
    [(2, 4), (3, 3), (4, 2), (5, 1)]
    """
    seeds = {even_split(layers, parts), balance(layers, parts, time_extra),
             balance(layers, parts, mem_extra, mem_weight)}
    out = set(seeds)
    for s in seeds:
        out.update(neighbours(s))
    return sorted(out)
