"""Splitting a model's layers into pipeline chunks: every split for small models, a few balanced ones otherwise.

A partition is a tuple of chunk sizes (each >= 1, but for an interleaved pipeline's first and last
chunk, which may hold the embedding or the head alone: :func:`end_minimums`) summing to the number of
layers; chunk ``i`` holds the next ``sizes[i]`` layers and, with ``pp`` pipeline ranks, runs on rank
``i % pp``.

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


def count_compositions(layers: int, parts: int, lo: Sequence[int] | None = None) -> int:
    """How many ways ``layers`` split into ``parts`` consecutive chunks of at least ``lo_i`` layers each
    (default 1: C(L-1, k-1))."""
    total = layers - (sum(lo) if lo is not None else parts) + parts  # chunk i as n_i - lo_i + 1 >= 1
    return comb(total - 1, parts - 1) if 1 <= parts <= total else 0


def compositions(layers: int, parts: int, lo: Sequence[int] | None = None) -> Iterator[tuple[int, ...]]:
    """Every split of ``layers`` into ``parts`` chunks of at least ``lo_i`` layers each (default 1), by
    choosing the cut points.

    >>> list(compositions(2, 4, (0, 1, 1, 0)))
    [(0, 1, 1, 0)]
    """
    lo = tuple(lo) if lo is not None else (1,) * parts
    total = layers - sum(lo) + parts
    for cuts in combinations(range(1, total), parts - 1):
        edges = (0, *cuts, total)
        yield tuple(b - a - 1 + least for (a, b), least in zip(pairwise(edges), lo, strict=True))


def even_split(layers: int, parts: int) -> tuple[int, ...]:
    """Megatron-style split: equal chunks, the first ``layers % parts`` chunks one layer larger."""
    q, r = divmod(layers, parts)
    return tuple(q + (1 if i < r else 0) for i in range(parts))


def end_minimums(parts: int, ends: bool) -> tuple[int, ...]:
    """The fewest layers each of ``parts`` chunks may hold: one, or with ``ends`` none for the first and
    last chunk (the embedding or the head alone, as Llama 3's pipeline, 2407.21783 section 3.3.2).

    >>> end_minimums(4, True), end_minimums(2, False)
    ((0, 1, 1, 0), (1, 1))
    """
    lo = [1] * parts
    if ends and parts > 2:
        lo[0] = lo[-1] = 0
    return tuple(lo)


def balance(layers: int, parts: int, extra: Sequence[float], weight: Sequence[float] | None = None,
            lo: Sequence[int] | None = None) -> tuple[int, ...]:
    """Chunk sizes minimising ``max_i(weight_i * n_i + extra_i)``, every ``n_i >= lo_i`` (default 1).

    ``extra`` is fixed work per chunk (embedding, LM head) and ``weight`` the cost of one layer on
    that chunk (1 by default; larger where more micro-batches are in flight when balancing memory).
    Adding layers one at a time to the chunk whose cost grows least is optimal for this min-max
    (each chunk's cost is increasing in its own size only), so a heap does it in O(L log k).

    >>> balance(6, 4, extra=[0.5, 0.0, 0.0, 1.5], lo=(0, 1, 1, 0))  # a head of 1.5 layers' worth runs alone
    (2, 2, 2, 0)
    """
    w = list(weight) if weight is not None else [1.0] * parts
    sizes = list(lo) if lo is not None else [1] * parts
    heap = [((sizes[i] + 1) * w[i] + extra[i], i) for i in range(parts)]
    heapq.heapify(heap)
    for _ in range(layers - sum(sizes)):
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        heapq.heappush(heap, ((sizes[i] + 1) * w[i] + extra[i], i))
    return tuple(sizes)


def neighbours(sizes: tuple[int, ...], lo: Sequence[int] | None = None) -> Iterator[tuple[int, ...]]:
    """Splits that move one layer between adjacent chunks (keeping chunk ``i`` at ``lo_i`` layers or
    more, default 1)."""
    lo = lo if lo is not None else [1] * len(sizes)
    for i in range(len(sizes) - 1):
        for a, b in ((i, i + 1), (i + 1, i)):
            if sizes[a] > lo[a]:
                s = list(sizes)
                s[a] -= 1
                s[b] += 1
                yield tuple(s)


def balanced_splits(layers: int, parts: int, time_extra: Sequence[float], mem_weight: Sequence[float],
                    mem_extra: Sequence[float], lo: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """The even split, the time-balanced and the memory-balanced one, and their neighbours, sorted;
    with ``lo`` (each chunk's fewest layers, :func:`end_minimums`) also those two balanced with chunks as
    small as that, and their neighbours.

    ``time_extra`` is each chunk's fixed work in layers' worth (embedding, LM head); ``mem_weight``
    the memory of one layer on each chunk and ``mem_extra`` each chunk's fixed memory (see :func:`balance`).

    >>> balanced_splits(6, 2, [0.0, 2.0], [1.0, 1.0], [0.0, 0.0])
    [(2, 4), (3, 3), (4, 2), (5, 1)]
    """
    seeds = {even_split(layers, parts), balance(layers, parts, time_extra),
             balance(layers, parts, mem_extra, mem_weight)} if layers >= parts else set()
    out = set(seeds)
    for s in seeds:
        out.update(neighbours(s))
    if lo is not None and min(lo) == 0:
        free = {balance(layers, parts, time_extra, lo=lo), balance(layers, parts, mem_extra, mem_weight, lo=lo)}
        out |= free
        for s in free:
            out.update(neighbours(s, lo))
    return sorted(out)
