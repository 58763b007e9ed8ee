"""``milp``: FlexSP-style choice of group sizes by mixed-integer programming over length buckets.

Per step, pick how many groups of each power-of-two size to form and how many sequences of each
length bucket each size takes, so that the slowest group is as fast as possible. Variables count
groups *per size* and sequences *per bucket and size*, never per group identity: that removes the
symmetry that makes per-group formulations (FlexSP's) stall at scale.

The makespan ``T`` multiplies the group count in "work of size d <= m_d * T", so for a fixed ``T``
the problem is a linear feasibility MILP, and ``T`` is found by bisection between the lower bound
and the warm start's step time::

    x[b, d] >= 0 integer   sequences of bucket b on groups of d  (only where memory holds the bucket
                           edge and its longest sequence alone finishes within T)
    m[d]    >= 0 integer   groups of d ranks
    sum_d x[b, d] = n_b                                   every sequence placed
    sum_b x[b, d] * tbar_d(b) <= T * m[d]                 groups of d finish within T on average
    sum_d d * m[d] <= num_ranks                           ranks exist
    minimise sum_{b,d} x[b, d] * d * tbar_d(b)            spend the fewest rank-seconds

where ``tbar_d(b)`` is the mean time of bucket b's sequences on d ranks.

Each feasible solution becomes a real schedule (sequences of a bucket go longest-first to the
largest sizes chosen for it, then the LPT and balance pass place them on concrete groups) and is
scored exactly by the cost model. The warm start is the best heuristic schedule (``hdp`` and
``balanced``): SciPy's ``milp`` takes no initial point, so the warm start enters as the upper end of
the bisection and as the fallback; the result is never worse than it. HiGHS solves each MILP
within ``time_limit`` seconds in all.
"""

from __future__ import annotations

import time

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from flexmesh.schedule.assemble import aligned_layout, build_schedule
from flexmesh.schedule.bucketing import dp_buckets
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.lower_bound import lower_bound, min_groups, seq_times
from flexmesh.schedule.types import StepSchedule


def _solve(T: float, mean_t: dict[int, np.ndarray], max_t: dict[int, np.ndarray], need_b: np.ndarray,
           counts: np.ndarray, n_ranks: int, time_limit: float) -> tuple[dict[int, int], np.ndarray] | None:
    """One feasibility MILP at makespan ``T``: (groups per size, x[b, d]) or None.

    ``mean_t[d][b]`` is the mean time of bucket ``b``'s sequences on ``d`` ranks (so a whole bucket's
    work is exact, not rounded up to its edge); ``max_t`` that of its longest, which must fit in ``T``.
    """
    sizes = sorted(mean_t)
    nb, nd = counts.size, len(sizes)
    ok = np.array([[d >= need_b[b] and max_t[d][b] <= T for d in sizes] for b in range(nb)])
    if not ok.any(axis=1).all():
        return None  # some bucket finishes within T on no group size
    pairs = [(b, k) for b in range(nb) for k in range(nd) if ok[b, k]]
    nx = len(pairs)
    nv = nx + nd
    cost = np.zeros(nv)
    A_place = np.zeros((nb, nv))
    A_load = np.zeros((nd, nv))
    for v, (b, k) in enumerate(pairs):
        d = sizes[k]
        cost[v] = d * mean_t[d][b]
        A_place[b, v] = 1.0
        A_load[k, v] = mean_t[d][b]
    for k, d in enumerate(sizes):
        A_load[k, nx + k] = -T
    A_ranks = np.zeros((1, nv))
    A_ranks[0, nx:] = sizes
    upper = np.concatenate([[counts[b] for b, _ in pairs], [n_ranks // d for d in sizes]])
    res = milp(cost, integrality=np.ones(nv), bounds=Bounds(np.zeros(nv), upper),
               constraints=[LinearConstraint(A_place, counts, counts), LinearConstraint(A_load, -np.inf, 0.0),
                            LinearConstraint(A_ranks, 0, n_ranks)],
               options={"time_limit": max(time_limit, 1e-3), "disp": False})
    if res.x is None:
        return None
    xv = np.rint(res.x).astype(np.int64)
    x = np.zeros((nb, nd), dtype=np.int64)
    for v, (b, k) in enumerate(pairs):
        x[b, k] = xv[v]
    return {d: int(xv[nx + k]) for k, d in enumerate(sizes)}, x


def _realise(lens: np.ndarray, ctx: ScheduleContext, groups: dict[int, int], x: np.ndarray, index: np.ndarray,
             times, need: np.ndarray, started: float, extra: dict) -> StepSchedule:
    from flexmesh.schedule.policies import _pack_groups, assign_to_slots

    sizes_sorted = sorted(groups)
    target = need.copy()
    for b in range(x.shape[0]):
        ids = np.flatnonzero(index == b)
        ids = ids[np.argsort(-lens[ids], kind="stable")]
        per = [d for k, d in sorted(enumerate(sizes_sorted), key=lambda kd: -kd[1]) for _ in range(x[b, k])]
        target[ids] = np.maximum(need[ids], per[: ids.size])
    slots = aligned_layout([d for d in sizes_sorted for _ in range(groups[d])], ctx.num_ranks)
    have = sorted({s.size for s in slots})
    target = np.asarray([next((h for h in have if h >= t), have[-1]) for t in target])
    members = assign_to_slots(lens, ctx, slots, times, need, target)
    return build_schedule("milp", lens, ctx, slots, _pack_groups(lens, ctx, slots, members), started, extra=extra)


def milp_schedule(lengths, ctx: ScheduleContext, *, seed: int = 0, buckets: int = 16, time_limit: float = 1.0,
                  iterations: int = 8) -> StepSchedule:
    """Bucketed MILP over group sizes, warm-started from the best heuristic; never worse than it."""
    from flexmesh.schedule.policies import _lengths, balanced, hdp

    t0 = time.perf_counter()
    lens = _lengths(lengths)
    warm = min((hdp(lens, ctx, seed=seed), balanced(lens, ctx, seed=seed)), key=lambda s: s.predicted_step_time)
    need = min_groups(lens, ctx)
    times = seq_times(lens, ctx)
    bk = dp_buckets(lens, k=buckets)
    need_b = min_groups(bk.edges, ctx)
    speed = min(ctx.speed) if ctx.speed else 1.0  # conservative: a bucket's sequence on the slowest ranks
    max_t = {d: t / speed for d, t in seq_times(bk.edges, ctx).items()}
    mean_t = {d: np.bincount(bk.index, weights=t, minlength=bk.counts.size) / bk.counts / speed
              for d, t in times.items()}
    lo, hi = lower_bound(lens, ctx), warm.predicted_step_time
    best, solved, status = warm, 0, "warm start kept"
    deadline = t0 + time_limit
    for _ in range(iterations):
        left = deadline - time.perf_counter()
        if left <= 0 or hi - lo <= 1e-3 * hi:
            break
        T = 0.5 * (lo + hi)
        sol = _solve(T, mean_t, max_t, need_b, bk.counts, ctx.num_ranks, left)
        if sol is None:
            lo = T
            continue
        solved += 1
        cand = _realise(lens, ctx, sol[0], sol[1], bk.index, times, need, t0, {})
        if cand.predicted_step_time < best.predicted_step_time:
            best, status = cand, "milp"
        hi = T
    extra = dict(best.extra)
    extra.update({"source": status, "milp_solves": solved, "bucket_token_error": bk.token_error(lens),
                  "warm_start_step_time": warm.predicted_step_time})
    return StepSchedule(lengths=best.lengths, groups=best.groups, policy="milp",
                        predicted_step_time=best.predicted_step_time, lower_bound=best.lower_bound,
                        deferred=best.deferred, scheduler_seconds=time.perf_counter() - t0, extra=extra)
