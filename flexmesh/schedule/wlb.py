"""``wlb``: WLB-LLM's variable-length packing with outlier delay (Wang et al., OSDI'25, arXiv 2503.17924).

One static context-parallel degree ``cp`` (the caller sweeps it, as for every baseline). Per step:

1. *Outlier delay.* A sequence whose workload on ``cp`` ranks exceeds ``threshold`` times a
   group's fair share of the step (total workload / number of groups) is an outlier: two of them on one
   group already outlast the others. Every group takes at most one; the outliers beyond that, latest
   arrivals first, wait for a later step, at most ``queue`` of them (default: one per group), so a
   sequence is never held for long. The caller puts the held sequences at the front of the next
   batch (:func:`flexmesh.sim.compare.run_policy` does); arriving first, they are kept first.
2. *Variable-length packing.* Longest work first, each sequence goes to the group with the least
   workload so far, workload being the cost model's time of the sequence in a packed micro-batch
   (:meth:`ScheduleContext.seq_load`: attention-aware, quadratic in its length, as WLB-LLM's
   workload model; a long sequence's time alone), not its token count; each group's sequences are then packed
   best-fit-decreasing into micro-batches under the memory cap and the packing budget.

Unlike ``balanced`` there is no balance pass after the greedy placement: WLB-LLM has none.

>>> from flexmesh.schedule.testing import tiny_context
>>> ctx = tiny_context(num_ranks=4)
>>> s = wlb([3000, 2900, 2800, 100, 120, 2700, 2600, 2500], ctx, cp=1)
>>> s.deferred, s.extra["outliers"]
((6, 7), 6)
"""

from __future__ import annotations

import time

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.layout.step import StepSchedule
from flexmesh.schedule.assemble import aligned_layout, build_step_schedule
from flexmesh.schedule.assign import lpt
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.lower_bound import seq_loads
from flexmesh.schedule.placement import Placement, check_lengths, pack_groups, slot_speeds
from flexmesh.schedule.static import static_cp


def wlb(lengths: ArrayLike, ctx: ScheduleContext, *, seed: int = 0, cp: int | None = None, threshold: float = 0.5,
        queue: int | None = None) -> StepSchedule:
    """Outliers beyond one per group delayed (at most ``queue``), the rest greedily to the least-loaded group."""
    t0 = time.perf_counter()
    lens = check_lengths(lengths)
    cp = static_cp(ctx, cp, int(lens.max()))
    n_groups = ctx.num_ranks // cp
    slots = aligned_layout([cp] * n_groups, ctx.num_ranks)
    times = seq_loads(lens, ctx)
    t = times[cp]
    outliers = np.flatnonzero(t > threshold * t.sum() / n_groups)
    room = n_groups if queue is None else max(0, int(queue))
    # Keep the earliest n_groups outliers; hold the latest ones, as many as the queue takes.
    held = outliers[n_groups:][::-1][:room]
    if held.size == lens.size:
        held = held[1:]  # never hold the whole batch
    deferred = sorted(int(i) for i in held)
    ids = np.setdiff1d(np.arange(lens.size), deferred)
    order = ids[np.argsort(-t[ids], kind="stable")]
    speeds = slot_speeds(ctx, slots, lens)
    target = np.full(lens.size, cp)
    members, loads = lpt(order, target, times, [s.size for s in slots], speeds)
    placement = Placement(slots, speeds, members, loads, target)
    return build_step_schedule("wlb", lens, ctx, slots, pack_groups(placement, lens, ctx), t0, deferred=deferred,
                               extra={"cp": cp, "outliers": int(outliers.size)})
