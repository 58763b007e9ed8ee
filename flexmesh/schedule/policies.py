"""Per-step scheduling policies and their registry.

Every policy is a function ``(lengths, ctx, *, seed, **options) -> StepSchedule``; call them through
:func:`make_schedule`. All are deterministic: the same batch, context and seed give the same schedule (none draws random
numbers today; ``seed`` is part of the signature so that a randomised policy can keep that promise).

- ``fixed``: today's baseline. Documents packed in arrival order into fixed slots of ``context``
  tokens (padding included in the cost), every slot sharded over one static context-parallel degree
  ``cp``, slots dealt round-robin to the ``num_ranks // cp`` groups.
- ``balanced`` (WLB-LLM): one static ``cp``; longest-processing-time on the cost model's time,
  variable-length packing under the memory cap; ``defer=True`` moves outlier sequences (longer than
  a group's fair share) beyond ``max_outliers`` to a later step.
- ``hdp`` (ByteScale): each sequence on the fewest ranks its memory needs (more only when it alone
  would outlast the balanced step), group counts per size by water-filling the work, LPT placement,
  then a balance pass off the slowest group; groups run different numbers of micro-batches. When the
  slowest group holds several sequences, up to ``repairs`` times one more group of its size is made
  from the smallest groups' ranks, kept when that is faster.
- ``milp`` (FlexSP) in :mod:`flexmesh.schedule.milp`; ``chunked`` (InfiniPipe, pipelines) in
  :mod:`flexmesh.schedule.chunking`.

>>> from flexmesh.schedule.testing import tiny_context
>>> s = make_schedule("hdp", [900, 50, 60, 3000], tiny_context(num_ranks=4))
>>> s.validate(4); sorted(s.extra)[:3]
['group_sizes', 'imbalance', 'microbatches']
"""

from __future__ import annotations

import heapq
import time
from typing import Callable

import numpy as np

from flexmesh.errors import ScheduleError
from flexmesh.schedule.assemble import Slot, aligned_layout, build_schedule, pieces_of, slot_speed
from flexmesh.schedule.assign import lpt, rebalance
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.lower_bound import min_groups, seq_times
from flexmesh.schedule.packing import best_fit_decreasing, next_fit
from flexmesh.layout.step import StepSchedule

Policy = Callable[..., StepSchedule]


def _lengths(lengths) -> np.ndarray:
    a = np.asarray(lengths)
    if a.ndim != 1 or a.size == 0:
        raise ScheduleError("a batch needs a non-empty 1-D list of sequence lengths")
    if not np.issubdtype(a.dtype, np.integer) and not np.all(np.mod(a, 1) == 0):
        raise ScheduleError("sequence lengths must be whole token counts")
    a = a.astype(np.int64)
    if (a < 1).any():
        raise ScheduleError(f"sequence lengths must be >= 1 token; found {int(a.min())}")
    return a


def _static_cp(lens: np.ndarray, ctx: ScheduleContext, cp: int | None, tokens: int) -> int:
    """The static context-parallel degree: given, or the smallest group holding ``tokens``."""
    if cp is None:
        return ctx.min_group(tokens)
    if cp not in ctx.group_sizes:
        raise ScheduleError(f"cp={cp} is not an allowed group size; use one of {ctx.group_sizes}")
    if ctx.max_tokens(cp) < tokens:
        raise ScheduleError(
            f"cp={cp} holds at most {ctx.max_tokens(cp)} tokens per micro-batch but {tokens} are needed; "
            f"use cp >= {ctx.min_group(tokens)}"
        )
    return cp


def _pack_groups(lens: np.ndarray, ctx: ScheduleContext, slots: list[Slot], members: list[list[int]]):
    """Best-fit-decreasing micro-batches per group under ``ctx.pack_tokens``; a member longer than that
    budget (it fits memory, or it would not be here) rides in a micro-batch of its own length."""
    ll = lens.tolist()
    return [[pieces_of(mb, ll) for mb in best_fit_decreasing(m, ll, max(ctx.pack_tokens(s.size),
                                                                        max(ll[i] for i in m)))] if m else []
            for s, m in zip(slots, members)]


def fixed(lengths, ctx: ScheduleContext, *, seed: int = 0, cp: int | None = None,
          context: int | None = None) -> StepSchedule:
    """Arrival-order fixed slots of ``context`` tokens on ``num_ranks // cp`` groups of ``cp``, round-robin."""
    t0 = time.perf_counter()
    lens = _lengths(lengths)
    context = int(lens.max()) if context is None else int(context)
    if context < lens.max():
        raise ScheduleError(f"a sequence of {int(lens.max())} tokens exceeds the slot (context) of {context}; "
                            f"raise context or truncate sequences to it")
    cp = _static_cp(lens, ctx, cp, context)
    n_groups = ctx.num_ranks // cp
    slots = aligned_layout([cp] * n_groups, ctx.num_ranks)
    mbs: list[list] = [[] for _ in slots]
    charged: list[list[int]] = [[] for _ in slots]
    for k, slot_ids in enumerate(next_fit(range(lens.size), lens, context)):
        mbs[k % n_groups].append(pieces_of(slot_ids, lens))
        charged[k % n_groups].append(context)
    return build_schedule("fixed", lens, ctx, slots, mbs, t0, charged_tokens=charged, extra={"cp": cp})


def balanced(lengths, ctx: ScheduleContext, *, seed: int = 0, cp: int | None = None, defer: bool = False,
             max_outliers: int | None = None) -> StepSchedule:
    """LPT over ``num_ranks // cp`` equal groups with best-fit packing; optional outlier deferral."""
    t0 = time.perf_counter()
    lens = _lengths(lengths)
    cp = _static_cp(lens, ctx, cp, int(lens.max()))
    n_groups = ctx.num_ranks // cp
    slots = aligned_layout([cp] * n_groups, ctx.num_ranks)
    sizes = [s.size for s in slots]
    speeds = [slot_speed(ctx, s) for s in slots]
    times = seq_times(lens, ctx)
    t = times[cp]
    ids = np.arange(lens.size)
    deferred: list[int] = []
    if defer:
        # An outlier alone outlasts a group's fair share; keep the earliest ``max_outliers`` of them.
        fair = t.sum() / n_groups
        outliers = np.flatnonzero(t > fair)
        keep = n_groups if max_outliers is None else max(0, int(max_outliers))
        deferred = [int(i) for i in outliers[keep:]]
        if len(deferred) == lens.size:
            deferred = deferred[1:]  # never defer the whole batch
        ids = np.setdiff1d(ids, deferred)
    need = np.full(lens.size, cp)
    need_sizes = np.asarray(sizes)
    order = ids[np.argsort(-t[ids], kind="stable")]
    members, loads = lpt(order, np.minimum(need, need_sizes.max()), times, sizes, speeds)
    # Only groups of size cp take work; spare ranks (num_ranks not a multiple of cp) stay idle.
    rebalance(members, loads, need, times, sizes, speeds)
    return build_schedule("balanced", lens, ctx, slots, _pack_groups(lens, ctx, slots, members), t0,
                          deferred=deferred, extra={"cp": cp})


def hdp_layout(lens: np.ndarray, ctx: ScheduleContext, times: dict[int, np.ndarray], need: np.ndarray,
               grow: bool = True, fair_share: bool = True) -> tuple[list[int], np.ndarray]:
    """Group sizes for a batch and each sequence's target size (>= its memory need).

    Targets start at the memory need. With ``grow``, a sequence that alone would outlast the ideal
    step ``T = total rank-seconds / total speed`` moves to the smallest larger group on which it
    finishes within ``T`` (or its fastest group). Each class then gets its fair share of ranks
    (``work / T``) in whole groups, rounded down; a class too small for one group rides on the next
    larger one (with ``fair_share=False`` every class starts from one group instead). Spare ranks
    water-fill: the class with the slowest estimated group gets another.
    """
    n = ctx.num_ranks
    speed_total = float(sum(ctx.speed)) if ctx.speed else float(n)
    target = need.copy()
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


def hdp(lengths, ctx: ScheduleContext, *, seed: int = 0, grow: bool = True, balance: bool = True,
        repairs: int = 2) -> StepSchedule:
    """Hybrid data parallelism: variable group sizes per step, LPT placement, balance pass."""
    t0 = time.perf_counter()
    lens = _lengths(lengths)
    need = min_groups(lens, ctx)
    times = seq_times(lens, ctx)
    # Two ways to size the groups; each is placed, and the one whose slowest group is faster is kept.
    best, tried = None, []
    for fair in (True, False):
        sizes, target = hdp_layout(lens, ctx, times, need, grow=grow, fair_share=fair)
        if any(sizes == s and np.array_equal(target, t) for s, t in tried):
            continue  # both ways gave the same layout: place it once
        tried.append((sizes, target))
        slots = aligned_layout(sizes, ctx.num_ranks)
        members, loads = assign_to_slots(lens, ctx, slots, times, need, target, balance=balance, with_loads=True)
        if best is None or loads.max() < best[2].max():
            best = (slots, members, loads, target)
    for _ in range(repairs):
        fixed_up = _split_slowest(lens, ctx, *best, times, need, balance)
        if fixed_up is None or not fixed_up[2].max() < best[2].max() - 1e-12:
            break
        best = fixed_up
    slots, members = best[0], best[1]
    return build_schedule("hdp", lens, ctx, slots, _pack_groups(lens, ctx, slots, members), t0)


COARSE = 0.25


def _split_slowest(lens: np.ndarray, ctx: ScheduleContext, slots: list[Slot], members: list[list[int]],
                   loads: np.ndarray, target: np.ndarray, times: dict[int, np.ndarray], need: np.ndarray,
                   balance: bool = True):
    """One more group of the slowest group's size, paid for with the smallest groups' ranks.

    Whole sequences are coarse: two long ones forced onto one group can outlast every other group
    while a second group of that size would split them. The slowest group's sequences and those of
    the dropped groups are placed again (LPT onto the other groups' current loads), then the balance
    pass runs. Returns ``(slots, members, loads, target)`` or None when no such layout exists; the
    caller keeps it only if it is faster.
    """
    g = int(np.argmax(loads))
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
    old_by = {}
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
    tgt = round_up_to(target, [s.size for s in new_slots])
    sizes_l = [s.size for s in new_slots]
    speeds = [slot_speed(ctx, s) for s in new_slots]
    init = np.array([float(times[s][m].sum()) / sp if m else 0.0 for s, m, sp in zip(sizes_l, new_members, speeds)])
    orphans = np.asarray(orphans, dtype=np.int64)
    t_target = np.choose(np.searchsorted(ctx.group_sizes, tgt[orphans]), [times[c][orphans] for c in ctx.group_sizes])
    order = orphans[np.lexsort((orphans, -(tgt[orphans] * t_target)))]
    placed, loads2 = lpt(order, tgt, times, sizes_l, speeds, loads=init)
    for k, extra in enumerate(placed):
        new_members[k].extend(extra)
    if balance:
        loads2 = rebalance(new_members, loads2, need, times, sizes_l, speeds)
    return new_slots, new_members, loads2, tgt


def round_up_to(target: np.ndarray, sizes) -> np.ndarray:
    """Each target group size raised to the smallest of ``sizes`` holding it (the largest when none does).

    >>> round_up_to(np.array([1, 2, 8, 16]), [4, 8, 4]).tolist()
    [4, 4, 8, 8]
    """
    have = np.unique(np.asarray(sizes, dtype=np.int64))
    return have[np.minimum(np.searchsorted(have, target, side="left"), have.size - 1)]


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


def assign_to_slots(lens: np.ndarray, ctx: ScheduleContext, slots: list[Slot], times: dict[int, np.ndarray],
                    need: np.ndarray, target: np.ndarray, balance: bool = True, with_loads: bool = False):
    """LPT of sequences (most rank-seconds first) onto groups of at least their target size, then balance."""
    sizes = [s.size for s in slots]
    speeds = [slot_speed(ctx, s) for s in slots]
    t_target = np.choose(np.searchsorted(ctx.group_sizes, target), [times[d] for d in ctx.group_sizes])
    order = np.lexsort((np.arange(lens.size), -(target * t_target)))
    members, loads = lpt(order, target, times, sizes, speeds)
    if balance:
        loads = rebalance(members, loads, need, times, sizes, speeds)
    return (members, loads) if with_loads else members


def _milp(lengths, ctx: ScheduleContext, *, seed: int = 0, **options) -> StepSchedule:
    from flexmesh.schedule.milp import milp_schedule  # imported late: it builds on the heuristics above

    return milp_schedule(lengths, ctx, seed=seed, **options)


def _chunked(lengths, ctx: ScheduleContext, *, seed: int = 0, **options) -> StepSchedule:
    from flexmesh.schedule.chunking import chunked_schedule

    return chunked_schedule(lengths, ctx, seed=seed, **options)


POLICIES: dict[str, Policy] = {"fixed": fixed, "balanced": balanced, "hdp": hdp, "milp": _milp, "chunked": _chunked}


def make_schedule(policy: str, lengths, ctx: ScheduleContext, *, seed: int = 0, **options) -> StepSchedule:
    """Schedule one global batch with the named policy (options are the policy's keyword arguments)."""
    if policy not in POLICIES:
        raise ScheduleError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
    try:
        return POLICIES[policy](lengths, ctx, seed=seed, **options)
    except TypeError as e:
        if "unexpected keyword" in str(e):
            raise ScheduleError(f"policy {policy!r}: {e}; see flexmesh.schedule.policies for its options") from None
        raise
