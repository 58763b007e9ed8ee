"""How much of a trace's prompts a prefix cache could reuse, from the requests' prefix block ids alone.

A request's prompt is a run of block ids (Mooncake's ``hash_ids``: equal ids, equal prefix blocks). A
cache that holds the blocks of earlier prompts serves a request's leading blocks as far as they are all
cached (a prefix matches only up to its first miss). Reuse is the fraction of all prompt blocks so served:

- :func:`block_reuse`: with an unbounded cache (every earlier prompt's blocks kept);
- :func:`lru_hit_rates`: with caches of given capacities in blocks, least recently used blocks evicted (a
  request's blocks are used when it arrives): the hit-rate curve.

One cache for the whole trace, as one engine with every request would have (a fleet splits it per replica).

>>> from flexmesh.data.requests import load_trace
>>> reqs = load_trace("mooncake").requests
>>> round(block_reuse(reqs), 3)
0.366
>>> [round(h, 3) for h in lru_hit_rates(reqs, [1_000, 200_000])]
[0.044, 0.366]
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from flexmesh.data.requests import Request
from flexmesh.errors import DataError


def _blocks(requests: Sequence[Request]) -> int:
    total = sum(len(r.prefix_blocks) for r in requests)
    if total == 0:
        raise DataError("the requests carry no prefix block ids (a Mooncake trace's hash_ids, or prefix_blocks of "
                        "one's own); reuse cannot be computed without them")
    return total


def block_reuse(requests: Sequence[Request]) -> float:
    """The fraction of all prompt blocks an unbounded prefix cache serves (requests in arrival order)."""
    total = _blocks(requests)
    seen: set[int] = set()
    hits = 0
    for r in requests:
        for i in r.prefix_blocks:
            if i not in seen:
                break
            hits += 1
        seen.update(r.prefix_blocks)
    return hits / total


def lru_hit_rates(requests: Sequence[Request], capacities: Sequence[int]) -> list[float]:
    """The fraction of all prompt blocks served by an LRU cache of each capacity (blocks)."""
    total = _blocks(requests)
    out = []
    for cap in capacities:
        if cap < 1:
            raise DataError(f"a cache capacity is at least one block, got {cap}")
        cache: OrderedDict[int, None] = OrderedDict()
        hits = 0
        for r in requests:
            leading = True
            for i in r.prefix_blocks:
                if leading and i in cache:
                    hits += 1
                else:
                    leading = False
                cache[i] = None
                cache.move_to_end(i)
            while len(cache) > cap:
                cache.popitem(last=False)
        out.append(hits / total)
    return out
