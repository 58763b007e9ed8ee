"""Assigning whole sequences to groups of ranks: longest-processing-time first, then a balance pass.

A sequence ``i`` may go to any group at least as large as its memory needs (``need[i]``); on a group
of ``d`` ranks it adds ``times[d][i]`` seconds (its share of a packed micro-batch,
:meth:`ScheduleContext.seq_load`), divided by the group's speed. Greedy LPT places sequences in
decreasing order of work, each on the eligible group that would finish earliest; per group size a
heap keeps the least-loaded group on top, so a placement costs O(#sizes * log #groups) and a batch
O(n log n) (32K sequences over 4096 ranks stay well under a second).

The balance pass then repeatedly takes the slowest group and moves the one sequence whose move
lowers the larger of the two groups' times most, until no move helps (ByteScale's "give more to
ranks below the slowest"); when no move helps, it swaps a long sequence of the slowest group for a
shorter one of a lightly loaded group.

Per-sequence loads assume micro-batches packed with sequences of like length; the micro-batches
the group really packs differ a little (a group of few tokens shares its fixed costs among fewer
sequences). The exact times come afterwards from :func:`flexmesh.schedule.assemble.build_step_schedule`.

:func:`lpt` works on plain arrays; :func:`place` and :func:`rebalance` take and give
:class:`~flexmesh.schedule.placement.Placement` values.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from itertools import chain
from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.schedule.assemble import Slot
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.placement import Batch, Placement, slot_speeds

# Search effort of the balance pass, chosen on bench/schedule.py's batches (512 sequences over 64
# ranks; wikipedia, prolong, wlbllm): steps that lower the slowest group by less than 1e-4 of its time
# (a fraction of a millisecond, below the per-micro-batch cost that packing shares afterwards), and
# swap candidates beyond the 8 longest sequences of the slowest group and the 16 least-loaded groups,
# changed the mean step time by under 0.2% but cost a third of the pass's run time.
MAX_SWAPS = 32
MIN_GAIN = 1e-4


def lpt(order: ArrayLike, need: np.ndarray, times: dict[int, np.ndarray], sizes: Sequence[int], speeds: Sequence[float],
        loads: np.ndarray | None = None) -> tuple[list[list[int]], np.ndarray]:
    """Place sequences ``order`` (ids, most work first) on groups of ``sizes``; returns members and loads.

    >>> t = {1: np.array([4.0, 3.0, 3.0, 2.0])}
    >>> lpt([0, 1, 2, 3], np.ones(4, int), t, [1, 1], [1.0, 1.0])[0]
    [[0, 3], [1, 2]]
    """
    loads = np.zeros(len(sizes)) if loads is None else loads.astype(float).copy()
    members: list[list[int]] = [[] for _ in sizes]
    heaps: dict[int, list[tuple[float, int]]] = {}
    for g, d in enumerate(sizes):
        heaps.setdefault(d, []).append((float(loads[g]), g))
    for h in heaps.values():
        heapq.heapify(h)
    classes = sorted(heaps)
    # Python lists, not numpy scalars, inside the per-sequence loop: several times faster; each need
    # maps straight to its eligible (heap, times) pairs.
    t_list = {d: times[d].tolist() for d in classes}
    eligible = {d: [(heaps[c], t_list[c]) for c in classes if c >= d] for d in set(int(x) for x in np.unique(need))}
    need_list = np.asarray(need).tolist()
    inv_speed = [1.0 / s for s in speeds]
    load_list = loads.tolist()
    for i in np.asarray(order).tolist():
        best, best_h = float("inf"), None
        for h, t in eligible[need_list[i]]:
            f, g = h[0]
            cand = f + t[i] * inv_speed[g]
            if cand < best:
                best, best_h = cand, h
        if best_h is None:
            raise ValueError(f"no group of size >= {need_list[i]} for sequence {i}")  # callers size groups first
        g = heapq.heapreplace(best_h, (best, best_h[0][1]))[1]
        members[g].append(i)
        load_list[g] = best
    return members, np.asarray(load_list)


def place(batch: Batch, ctx: ScheduleContext, slots: Sequence[Slot], target: np.ndarray, *,
          balance: bool = True) -> Placement:
    """LPT of sequences (most rank-seconds first) onto groups of at least their ``target`` size, then balance."""
    speeds = slot_speeds(ctx, slots, batch.lens)
    times = batch.times
    t_target = np.choose(np.searchsorted(ctx.group_sizes, target), [times[d] for d in ctx.group_sizes])
    order = np.lexsort((np.arange(batch.lens.size), -(target * t_target)))
    members, loads = lpt(order, target, times, [s.size for s in slots], speeds)
    placement = Placement(slots, speeds, members, loads, target)
    return rebalance(placement, batch) if balance else placement


@dataclass(frozen=True, eq=False)
class _Costs:
    """What the balance pass looks up, built once per pass (eq=False: numpy fields)."""

    need: np.ndarray  # smallest group size each sequence may move to
    table: np.ndarray  # table[c, i]: sequence i's time on a group of size classes[c]
    classes: list[int]
    sizes: list[int]  # ranks per group
    speeds: np.ndarray  # speed factor per group


def rebalance(placement: Placement, batch: Batch, *, max_moves: int = 256, max_swaps: int = MAX_SWAPS,
              min_gain: float = MIN_GAIN) -> Placement:
    """Move sequences off the slowest group while that lowers it; returns the improved placement.

    A sequence may move to any group of at least ``batch.need`` ranks. When no single move helps,
    one swap with a shorter sequence elsewhere is tried. Both are capped by count (not by clock, so
    the result stays deterministic) to bound the run time at scale, and each must lower the slowest
    group by at least ``min_gain`` of its time.
    """
    members = placement.member_lists()
    loads = placement.loads.astype(float).copy()
    need, times, sizes = batch.need, batch.times, placement.sizes
    size_arr = np.asarray(sizes)
    speed_arr = np.asarray(placement.speeds, dtype=float)
    by_size = {d: np.flatnonzero(size_arr == d) for d in sorted(set(sizes))}
    swaps = 0
    classes = sorted(times)
    costs = _Costs(need=need, table=np.stack([times[d] for d in classes]), classes=classes, sizes=sizes,
                   speeds=speed_arr)
    for _ in range(max_moves):
        g = int(np.argmax(loads))
        if not members[g]:
            break
        mem = np.asarray(members[g])
        own = times[sizes[g]][mem] / speed_arr[g]
        bar = loads[g] * (1.0 - min_gain) - 1e-12
        best = (bar, -1, -1)  # (resulting max of the two groups, member position, target group)
        for d, idx in by_size.items():
            ok = need[mem] <= d
            if not ok.any():
                continue
            tgt_loads = loads[idx].copy()
            if sizes[g] == d:
                tgt_loads[np.searchsorted(idx, g)] = np.inf
            h = int(idx[np.argmin(tgt_loads)])
            new_h = loads[h] + times[d][mem] / speed_arr[h]
            worst = np.where(ok, np.maximum(new_h, loads[g] - own), np.inf)
            k = int(np.argmin(worst))
            if worst[k] < best[0]:
                best = (float(worst[k]), k, h)
        if best[1] < 0:
            swaps += 1
            if swaps > max_swaps or not _swap(g, members, loads, costs, min_gain=min_gain):
                break
            continue
        k, h = best[1], best[2]
        i = members[g].pop(k)
        members[h].append(i)
        loads[g] -= own[k]
        loads[h] += times[sizes[h]][i] / speed_arr[h]
    return replace(placement, members=members, loads=loads)


def _swap(g: int, members: list[list[int]], loads: np.ndarray, costs: _Costs, *, width: int = 8,
          partners: int = 16, max_candidates: int = 512, min_gain: float = 0.0) -> bool:
    """Exchange one sequence of the slowest group ``g`` with one elsewhere, if that lowers ``g``.

    The ``width`` longest members of ``g`` are scored at once against every sequence of the
    ``partners`` least-loaded groups, at most about ``max_candidates`` of them (only lightly loaded
    groups can take more work; the caps keep a swap cheap on thousands of ranks): new time of both
    groups, keeping the pair whose larger new time is smallest. Edits ``members`` and ``loads`` in
    place; returns whether it swapped.
    """
    need, table, classes, sizes, speed_arr = costs.need, costs.table, costs.classes, costs.sizes, costs.speeds
    cand = np.argsort(loads, kind="stable")[: partners + 1]
    cand = cand[cand != g][:partners]
    counts = np.array([len(members[h]) for h in cand], dtype=np.int64)
    keep = max(1, int(np.searchsorted(np.cumsum(counts), max_candidates)) + 1)  # bound the pairs scored
    cand, counts = cand[:keep], counts[:keep].tolist()
    if sum(counts) == 0:
        return False
    h = np.repeat(cand, counts)
    j = np.fromiter(chain.from_iterable(members[q] for q in cand.tolist()), dtype=np.int64, count=len(h))
    size_arr = np.asarray(sizes)
    d_g = sizes[g]
    cls_h, cls_g = np.searchsorted(classes, size_arr[h]), classes.index(d_g)
    sp_h, sp_g = speed_arr[h], speed_arr[g]
    mine = np.asarray(members[g])
    mine = mine[np.argsort(-table[cls_g, mine], kind="stable")[:width]]
    t_j_on_h = table[cls_h, j] / sp_h
    t_j_on_g = table[cls_g, j] / sp_g
    t_i_on_h = table[cls_h[:, None], mine[None, :]] / sp_h[:, None]  # (partner sequences, mine)
    new_g = loads[g] - table[cls_g, mine][None, :] / sp_g + t_j_on_g[:, None]
    new_h = (loads[h] - t_j_on_h)[:, None] + t_i_on_h
    ok = (need[mine][None, :] <= size_arr[h][:, None]) & (need[j] <= d_g)[:, None]
    worst = np.where(ok, np.maximum(new_g, new_h), np.inf)
    q, k = np.unravel_index(int(np.argmin(worst)), worst.shape)
    if not worst[q, k] < loads[g] * (1.0 - min_gain) - 1e-12:
        return False
    i, jj, hh = int(mine[k]), int(j[q]), int(h[q])
    members[g][members[g].index(i)] = jj
    members[hh][members[hh].index(jj)] = i
    loads[g] = new_g[q, k]
    loads[hh] = new_h[q, k]
    return True
