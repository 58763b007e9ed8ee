"""``hdp`` (ByteScale): hybrid data parallelism with group sizes chosen per step.

Each sequence goes on the fewest ranks its memory needs (more only when it alone would outlast the
balanced step); group counts per size come from water-filling the work (:func:`hdp_layout`, which
``chunked`` shares), then LPT placement and a balance pass off the slowest group
(:mod:`flexmesh.schedule.assign`); groups run different numbers of micro-batches. When the slowest
group holds several sequences, up to ``repairs`` times one more group of its size is made from the
smallest groups' ranks, kept when that is faster. Run it through
:func:`flexmesh.schedule.registry.make_schedule`.
"""

from __future__ import annotations

import heapq
import time

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.layout.step import StepSchedule
from flexmesh.schedule.assemble import aligned_layout, build_step_schedule
from flexmesh.schedule.assign import lpt, place, rebalance
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.placement import Batch, Placement, pack_groups, round_up_to, slot_speeds

# Only a group made of few long sequences is coarse (see _split_slowest): its second-longest
# sequence takes at least this share of the group's time.
COARSE = 0.25


def hdp_layout(batch: Batch, ctx: ScheduleContext, *, grow: bool = True,
               fair_share: bool = True) -> tuple[list[int], np.ndarray]:
    """Group sizes for a batch and each sequence's target size (>= its memory need).

    Targets start at the memory need. With ``grow``, a sequence that alone would outlast the ideal
    step ``T = total rank-seconds / total speed`` moves to the smallest larger group on which it
    finishes within ``T`` (or its fastest group). Each class then gets its fair share of ranks
    (``work / T``) in whole groups, rounded down; a class too small for one group rides on the next
    larger one (with ``fair_share=False`` every class starts from one group instead). Spare ranks
    water-fill: the class with the slowest estimated group gets another.
    """
    times = batch.times
    n = ctx.num_ranks
    speed_total = float(sum(ctx.speed)) if ctx.speed else float(n)
    target = batch.need.copy()
    allowed = ctx.group_sizes
    if grow:
        for _ in range(3):
            t_now = np.choose(np.searchsorted(allowed, target), [times[d] for d in allowed])
            ideal = float((target * t_now).sum()) / speed_total
            slow = np.flatnonzero(t_now > ideal)
            if slow.size == 0:
                break
            for i in slow:
                opts = [d for d in allowed if d >= target[i]]
                fits = [d for d in opts if times[d][i] <= ideal]
                target[i] = fits[0] if fits else min(opts, key=lambda d: times[d][i])
    ideal = sum(float((d * times[d][target == d]).sum()) for d in allowed) / speed_total
    # Each class's fair share of ranks, in whole groups (rounded down, so they always fit); a class
    # too small for one group of its own rides on the next larger class that has one.
    classes = sorted(set(int(d) for d in target))
    groups: dict[int, int] = {}
    for pos, d in enumerate(classes):
        share = float((d * times[d][target == d]).sum()) / max(ideal, 1e-30) / d
        if not fair_share:  # start from one group per class and let the water-fill do the rest
            share = 1.0
        groups[d] = max(1, int(share)) if pos == len(classes) - 1 else int(share)
        if groups[d] == 0:
            target[target == d] = classes[pos + 1]
    classes = sorted((d for d in classes if groups[d]), reverse=True)
    desc = {d: np.sort(times[d][target == d])[::-1] for d in classes}
    count = {d: desc[d].size for d in classes}

    def per_group(d: int, g: int) -> float:
        """Estimated slowest group of class d on g groups: the mean, or two sequences forced together."""
        t = desc[d]
        pair = t[g - 1] + t[g] if t.size > g else t[0]
        return max(float(t.sum()) / g, float(pair))

    for d in classes:
        groups[d] = min(groups[d], count[d])
    while sum(d * groups[d] for d in classes) > n:  # the largest class's one group can overshoot
        # Shed a group where that hurts least; a smaller class may drop to none and ride on larger groups.
        shed = [c for c in classes if groups[c] > 1 or (groups[c] == 1 and c != classes[0])]
        d = min(shed, key=lambda c: per_group(c, groups[c] - 1) if groups[c] > 1 else np.inf)
        groups[d] -= 1
    left = n - sum(d * groups[d] for d in classes)
    heap = [(-per_group(d, groups[d]), d) for d in classes if groups[d]]
    heapq.heapify(heap)
    while heap and left > 0:
        _, d = heapq.heappop(heap)
        if d > left or groups[d] >= count[d] or groups[d] == 0:
            continue  # this class is full or too big for what is left: drop it from the fill
        groups[d] += 1
        left -= d
        heapq.heappush(heap, (-per_group(d, groups[d]), d))
    sizes = [d for d in classes for _ in range(groups[d])]
    # Sequences of a class that got no group of its own ride on the next larger class.
    have = sorted(d for d in classes if groups[d])
    target = round_up_to(target, have) if len(have) else target
    return sizes, target


def hdp(lengths: ArrayLike, ctx: ScheduleContext, *, seed: int = 0, grow: bool = True, balance: bool = True,
        repairs: int = 2) -> StepSchedule:
    """Hybrid data parallelism: variable group sizes per step, LPT placement, balance pass."""
    t0 = time.perf_counter()
    batch = Batch.of(lengths, ctx)
    # Two ways to size the groups; each is placed, and the one whose slowest group is faster is kept.
    best: Placement | None = None
    tried: list[tuple[list[int], np.ndarray]] = []
    for fair in (True, False):
        sizes, target = hdp_layout(batch, ctx, grow=grow, fair_share=fair)
        if any(sizes == s and np.array_equal(target, t) for s, t in tried):
            continue  # both ways gave the same layout: place it once
        tried.append((sizes, target))
        placement = place(batch, ctx, aligned_layout(sizes, ctx.num_ranks), target, balance=balance)
        if best is None or placement.loads.max() < best.loads.max():
            best = placement
    assert best is not None  # the first layout is always placed
    for _ in range(repairs):
        fixed_up = _split_slowest(batch, ctx, best, balance)
        if fixed_up is None or not fixed_up.loads.max() < best.loads.max() - 1e-12:
            break
        best = fixed_up
    return build_step_schedule("hdp", batch.lens, ctx, best.slots, pack_groups(best, batch.lens, ctx), t0)


def _split_slowest(batch: Batch, ctx: ScheduleContext, best: Placement, balance: bool = True) -> Placement | None:
    """One more group of the slowest group's size, paid for with the smallest groups' ranks.

    Whole sequences are coarse: two long ones forced onto one group can outlast every other group
    while a second group of that size would split them. The slowest group's sequences and those of
    the dropped groups are placed again (LPT onto the other groups' current loads), then the balance
    pass runs. Returns the new placement or None when no such layout exists; the caller keeps it
    only if it is faster.
    """
    slots, members, times = best.slots, best.member_lists(), batch.times
    g = int(np.argmax(best.loads))
    d = slots[g].size
    own = np.sort(times[d][members[g]])[::-1]
    # Only a group made of few long sequences is coarse: on bench/schedule.py's batches every split
    # that helped had its second-longest sequence at >= 27% of the group's time, and below a quarter
    # the balance pass's moves had already done what a split could (the attempt only cost time).
    if own.size < 2 or own[1] < COARSE * own.sum():
        return None
    sizes = _one_more_group([s.size for s in slots], d)
    if sizes is None:
        return None
    new_slots = aligned_layout(sizes, ctx.num_ranks)
    # Old groups keep their members in order within each size; the last ones of the dropped sizes go.
    old_by: dict[int, list[int]] = {}
    for k, s in enumerate(slots):
        old_by.setdefault(s.size, []).append(k)
    new_members: list[list[int]] = [[] for _ in new_slots]
    taken = {c: 0 for c in old_by}
    for k, s in enumerate(new_slots):
        olds = old_by.get(s.size, [])
        if taken.get(s.size, 0) < len(olds):
            new_members[k] = list(members[olds[taken[s.size]]])
            taken[s.size] += 1
    used = {olds[i] for c, olds in old_by.items() for i in range(taken[c])}
    orphans = [i for k in range(len(slots)) if k not in used or k == g for i in members[k]]
    for k, s in enumerate(new_slots):  # the slowest group's members are orphans too
        if s.size == d and new_members[k] == members[g]:
            new_members[k] = []
            break
    tgt = round_up_to(best.target, [s.size for s in new_slots])
    sizes_l = [s.size for s in new_slots]
    speeds = slot_speeds(ctx, new_slots, batch.lens)
    init = np.array([float(times[s][m].sum()) / sp if m else 0.0
                     for s, m, sp in zip(sizes_l, new_members, speeds, strict=True)])
    ids = np.asarray(orphans, dtype=np.int64)
    t_target = np.choose(np.searchsorted(ctx.group_sizes, tgt[ids]), [times[c][ids] for c in ctx.group_sizes])
    order = ids[np.lexsort((ids, -(tgt[ids] * t_target)))]
    placed, loads = lpt(order, tgt, times, sizes_l, speeds, loads=init)
    for k, extra in enumerate(placed):
        new_members[k].extend(extra)
    fixed_up = Placement(new_slots, speeds, new_members, loads, tgt)
    return rebalance(fixed_up, batch) if balance else fixed_up


def _one_more_group(sizes: list[int], d: int) -> list[int] | None:
    """``sizes`` plus one group of ``d`` ranks, made by dropping the smallest groups (all smaller than d).

    Ranks freed beyond ``d`` come back as groups of one. None when the smaller groups hold fewer than
    ``d`` ranks.

    >>> _one_more_group([4, 2, 1, 1, 1, 1], 4)
    [4, 4, 2]
    >>> _one_more_group([4, 2, 2, 1], 4)
    [4, 4, 1]
    """
    rest = sorted(sizes)
    freed = 0
    while freed < d and rest and rest[0] < d:
        freed += rest.pop(0)
    if freed < d:
        return None
    return sorted(rest + [d] + [1] * (freed - d), reverse=True)
