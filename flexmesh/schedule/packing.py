"""Packing whole sequences into micro-batches under a token cap (the memory limit of a group).

Two packers, one job each:

- :func:`next_fit` keeps arrival order and opens a new micro-batch when the next sequence does not
  fit: what a fixed-slot data loader does.
- :func:`best_fit_decreasing` places the longest first, each into the fullest micro-batch that still
  holds it. Fewer micro-batches means fewer fixed per-micro-batch costs, and BFD uses at most
  11/9 OPT + 1 bins (Johnson's bound), which is why it is used here.

Both return lists of sequence ids, never cut a sequence, and raise a ScheduleError naming the
length when a sequence exceeds the cap.

>>> best_fit_decreasing([0, 1, 2, 3], [6, 5, 4, 3], cap=9)
[[0, 3], [1, 2]]
>>> next_fit([0, 1, 2, 3], [6, 5, 4, 3], cap=9)
[[0], [1, 2], [3]]
"""

from __future__ import annotations

import bisect
from typing import Iterable, Sequence

import numpy as np

from flexmesh.errors import ScheduleError


def _check(lengths: np.ndarray, cap: int) -> None:
    if lengths.size and int(lengths.max()) > cap:
        raise ScheduleError(
            f"a sequence of {int(lengths.max())} tokens exceeds the micro-batch cap of {cap} tokens; use a larger "
            f"group (context-parallel degree) or truncate sequences to {cap}"
        )


def next_fit(ids: Iterable[int], lengths: Sequence[int] | np.ndarray, cap: int) -> list[list[int]]:
    """Arrival-order packing: append while the running total stays within ``cap``."""
    ids = [int(i) for i in ids]
    lens = np.asarray(lengths, dtype=np.int64)
    _check(lens[ids] if ids else lens[:0], cap)
    out: list[list[int]] = []
    room = -1
    for i in ids:
        n = int(lens[i])
        if n > room:
            out.append([])
            room = cap
        out[-1].append(i)
        room -= n
    return out


def best_fit_decreasing(ids: Iterable[int], lengths: Sequence[int] | np.ndarray, cap: int) -> list[list[int]]:
    """Longest first, each into the micro-batch with the least room that still holds it."""
    ids = [int(i) for i in ids]
    lens = lengths.tolist() if isinstance(lengths, np.ndarray) else list(lengths)
    if ids and max(lens[i] for i in ids) > cap:
        _check(np.asarray([max(lens[i] for i in ids)]), cap)
    # Plain lists: groups hold a handful of sequences, where numpy's per-call cost dominates.
    order = sorted(ids, key=lambda i: -lens[i])
    if sum(lens[i] for i in ids) <= cap:
        return [order] if order else []  # all in one micro-batch: what the loop below would build
    bins: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # sorted (room left, bin index)
    for i in order:
        n = lens[i]
        k = bisect.bisect_left(rooms, (n, -1))
        if k == len(rooms):
            bins.append([i])
            bisect.insort(rooms, (cap - n, len(bins) - 1))
        else:
            room, b = rooms.pop(k)
            bins[b].append(i)
            bisect.insort(rooms, (room - n, b))
    return bins
