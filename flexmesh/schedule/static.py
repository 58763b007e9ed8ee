"""The baselines with one static context-parallel degree: ``fixed``, ``padded``, ``balanced``.

What people run, each at a degree ``cp`` the caller sweeps (flexmesh.sim.compare keeps the best):

- ``fixed``: Megatron-LM / torchtitan with packing: documents packed best-fit-decreasing into
  micro-batches of at most ``context`` tokens (the packed sequence length) with no padding, every
  micro-batch sharded over ``cp`` ranks, micro-batches dealt round-robin to the ``num_ranks // cp``
  groups (with speed factors, in proportion to the groups' speeds: :func:`deal`, the per-device
  batch shares users set by hand on mixed cards).
- ``padded``: the same without best-fit packing: documents in arrival order into fixed slots of
  ``context`` tokens, padding included in the cost (a loader that pads every slot to the context).
- ``balanced``: longest-processing-time on the cost model's time of each sequence in a packed
  micro-batch (:meth:`ScheduleContext.seq_load`), then a balance pass, and
  best-fit packing under the memory cap; ``defer=True`` moves outlier sequences (longer than a
  group's fair share) beyond ``max_outliers`` to a later step.

WLB-LLM's packing with outlier delay is :mod:`flexmesh.schedule.wlb`. All leave the ranks beyond the
last whole group of ``cp`` idle. Run them through :func:`flexmesh.schedule.registry.make_schedule`.
"""

from __future__ import annotations

import heapq
import time
from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.errors import ScheduleError
from flexmesh.layout.step import StepSchedule
from flexmesh.schedule.assemble import aligned_layout, build_step_schedule, pieces_of
from flexmesh.schedule.assign import lpt, rebalance
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.lower_bound import seq_loads
from flexmesh.schedule.packing import best_fit_decreasing, next_fit
from flexmesh.schedule.placement import Batch, Placement, check_lengths, pack_groups, slot_speeds


def static_cp(ctx: ScheduleContext, cp: int | None, tokens: int) -> int:
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


def deal(count: int, speeds: Sequence[float]) -> list[int]:
    """The group of each of ``count`` micro-batches: each to the group whose share per unit of speed
    stays smallest (lowest index on ties), which is round-robin when every speed is equal.

    >>> deal(5, [1.0, 1.0]), deal(6, [1.0, 0.5])
    ([0, 1, 0, 1, 0], [0, 0, 1, 0, 0, 1])
    """
    heap = [(1.0 / float(v), g) for g, v in enumerate(speeds)]
    heapq.heapify(heap)
    out = []
    for _ in range(count):
        share, g = heap[0]
        out.append(g)
        heapq.heapreplace(heap, (share + 1.0 / float(speeds[g]), g))
    return out


def fixed(lengths: ArrayLike, ctx: ScheduleContext, *, seed: int = 0, cp: int | None = None,
          context: int | None = None) -> StepSchedule:
    """Best-fit-decreasing micro-batches of at most ``context`` tokens, no padding, dealt round-robin.

    ``context`` defaults to what memory and the packing budget allow on ``cp`` ranks
    (:meth:`ScheduleContext.pack_tokens`), and is never below the longest sequence.
    """
    t0 = time.perf_counter()
    lens = check_lengths(lengths)
    longest = int(lens.max())
    if context is not None and context < longest:
        raise ScheduleError(f"a sequence of {longest} tokens exceeds the packed length (context) of {context}; "
                            f"raise context or truncate sequences to it")
    cp = static_cp(ctx, cp, longest if context is None else int(context))
    cap = max(longest, ctx.pack_tokens(cp)) if context is None else int(context)
    n_groups = ctx.num_ranks // cp
    slots = aligned_layout([cp] * n_groups, ctx.num_ranks)
    mbs: list[list] = [[] for _ in slots]
    ll = lens.tolist()
    packed = best_fit_decreasing(range(lens.size), ll, cap)
    for g, ids in zip(deal(len(packed), slot_speeds(ctx, slots, lens)[:n_groups]), packed, strict=True):
        mbs[g].append(pieces_of(ids, ll))
    return build_step_schedule("fixed", lens, ctx, slots, mbs, t0, extra={"cp": cp, "context": cap})


def padded(lengths: ArrayLike, ctx: ScheduleContext, *, seed: int = 0, cp: int | None = None,
           context: int | None = None) -> StepSchedule:
    """Arrival-order fixed slots of ``context`` tokens on ``num_ranks // cp`` groups of ``cp``, round-robin."""
    t0 = time.perf_counter()
    lens = check_lengths(lengths)
    context = int(lens.max()) if context is None else int(context)
    if context < lens.max():
        raise ScheduleError(f"a sequence of {int(lens.max())} tokens exceeds the slot (context) of {context}; "
                            f"raise context or truncate sequences to it")
    cp = static_cp(ctx, cp, context)
    n_groups = ctx.num_ranks // cp
    slots = aligned_layout([cp] * n_groups, ctx.num_ranks)
    mbs: list[list] = [[] for _ in slots]
    charged: list[list[int]] = [[] for _ in slots]
    filled = next_fit(range(lens.size), lens, context)
    for g, slot_ids in zip(deal(len(filled), slot_speeds(ctx, slots, lens)[:n_groups]), filled, strict=True):
        mbs[g].append(pieces_of(slot_ids, lens))
        charged[g].append(context)
    return build_step_schedule("padded", lens, ctx, slots, mbs, t0, charged_tokens=charged,
                               extra={"cp": cp, "context": context})


def balanced(lengths: ArrayLike, ctx: ScheduleContext, *, seed: int = 0, cp: int | None = None, defer: bool = False,
             max_outliers: int | None = None) -> StepSchedule:
    """LPT over ``num_ranks // cp`` equal groups with best-fit packing; optional outlier deferral."""
    t0 = time.perf_counter()
    lens = check_lengths(lengths)
    cp = static_cp(ctx, cp, int(lens.max()))
    n_groups = ctx.num_ranks // cp
    slots = aligned_layout([cp] * n_groups, ctx.num_ranks)
    sizes = [s.size for s in slots]
    speeds = slot_speeds(ctx, slots, lens)
    times = seq_loads(lens, ctx)
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
    # Only groups of size cp take work; spare ranks (num_ranks not a multiple of cp) stay idle.
    need = np.full(lens.size, cp)
    target = np.minimum(need, np.asarray(sizes).max())
    order = ids[np.argsort(-t[ids], kind="stable")]
    members, loads = lpt(order, target, times, sizes, speeds)
    placement = rebalance(Placement(slots, speeds, members, loads, target), Batch(lens, times, need))
    return build_step_schedule("balanced", lens, ctx, slots, pack_groups(placement, lens, ctx), t0,
                               deferred=deferred, extra={"cp": cp})
