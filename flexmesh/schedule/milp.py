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
    sum_{b: tmin_d(b) > T/(q+1)} x[b, d] <= q * m[d]      q = 1, 2: whole sequences do not split
    minimise sum_{b,d} x[b, d] * d * tbar_d(b)            spend the fewest rank-seconds

where ``tbar_d(b)`` and ``tmin_d(b)`` are the mean and the shortest load of bucket b's sequences on
d ranks (each one's share of a packed micro-batch, :meth:`ScheduleContext.seq_load`; the edge's
time alone for the memory and fit test). The load row is an average over a size's groups; the
rows over ``q`` (valid for every real schedule: a group finishing within T holds at most q
sequences longer than T / (q + 1)) stop the MILP from planning, say, three sequences of 0.6 T onto
two groups.

With speed factors the load row weighs each rank by its speed: a size's groups finish within T on
the speed capacity they draw from the ranks' total (:func:`_speed_rows`), and the realised schedule
prices every group at its slowest member's speed.

Each feasible solution becomes a real schedule three ways, all placed on the MILP's groups by LPT
and the balance pass: sequences of a bucket go longest-first to the largest sizes chosen for it; or
spread over those sizes by time; or every sequence may take any group that holds it. The fastest is
scored exactly by the cost model. The warm start is the best heuristic schedule (``hdp`` and
``balanced``): SciPy's ``milp`` takes no initial point, so the warm start enters as the upper end of
the bisection and as the fallback; the result is never worse than it.

Deterministic for a given input: each MILP stops after ``node_limit`` branch-and-bound nodes (HiGHS
explores them in a fixed order), the bisection after ``iterations`` solves, so the schedule does not
depend on the machine's load. ``time_limit`` (seconds, off by default) adds a wall-clock cap for a
caller that needs one; a run it cuts short is no longer reproducible and says so in its
diagnostics: ``extra["stopped_by"]`` is ``"time_limit"`` (else ``"converged"``, ``"iterations"``),
and ``extra["source"]`` whether the MILP or the warm start gave the schedule.
"""

from __future__ import annotations

import time

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.layout.step import StepSchedule
from flexmesh.schedule.assemble import aligned_layout, build_step_schedule
from flexmesh.schedule.assign import place
from flexmesh.schedule.bucketing import dp_buckets
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.hdp import hdp
from flexmesh.schedule.lower_bound import lower_bound, min_groups, seq_times
from flexmesh.schedule.placement import Batch, check_lengths, pack_groups, round_up_to
from flexmesh.schedule.static import balanced


def _solve(T: float, mean_t: dict[int, np.ndarray], max_t: dict[int, np.ndarray], need_b: np.ndarray,
           counts: np.ndarray, n_ranks: int, node_limit: int, time_limit: float | None = None,
           min_t: dict[int, np.ndarray] | None = None,
           speeds: tuple[float, float] | None = None) -> tuple[dict[int, int], np.ndarray] | None:
    """One feasibility MILP at makespan ``T``: (groups per size, x[b, d]) or None.

    ``mean_t[d][b]`` is the mean time of bucket ``b``'s sequences on ``d`` ranks (so a whole bucket's
    work is exact, not rounded up to its edge); ``max_t`` that of its longest, which must fit in ``T``.
    ``speeds`` = (sum, largest) of the data ranks' speed factors when they differ from nominal: see
    :func:`_speed_rows`.
    """
    # Imported here, not at the top: scipy.optimize takes about 0.3 s to import, and every `flexmesh`
    # command line loads this module (train's --policy choices come from the registry).
    from scipy.optimize import Bounds, LinearConstraint, milp

    sizes = sorted(mean_t)
    nb, nd = counts.size, len(sizes)
    ok = np.array([[d >= need_b[b] and max_t[d][b] <= T for d in sizes] for b in range(nb)])
    if not ok.any(axis=1).all():
        return None  # some bucket finishes within T on no group size
    pairs = [(b, k) for b in range(nb) for k in range(nd) if ok[b, k]]
    nx = len(pairs)
    nv = nx + nd + (nd if speeds else 0)
    cost = np.zeros(nv)
    A_place = np.zeros((nb, nv))
    A_load = np.zeros((nd, nv))
    for v, (b, k) in enumerate(pairs):
        d = sizes[k]
        cost[v] = d * mean_t[d][b]
        A_place[b, v] = 1.0
        A_load[k, v] = mean_t[d][b]
    for k in range(nd):
        A_load[k, nx + k] = -T
    A_ranks = np.zeros((1, nv))
    A_ranks[0, nx:nx + nd] = sizes
    cons = [LinearConstraint(A_place, counts, counts), LinearConstraint(A_load, -np.inf, 0.0),
            LinearConstraint(A_ranks, 0, n_ranks)]
    if speeds:
        cons[1:2] = _speed_rows(T, A_load, sizes, nx, speeds)
    if min_t is not None:
        # Whole sequences do not split between groups: more than q sequences each longer than T / (q + 1)
        # cannot share one group, so a size holds at most q * m[d] of them (q = 1, 2). The average load
        # row alone would let two sequences of 0.6 T share a group.
        pk = np.array([k for _, k in pairs])
        shortest = np.array([min_t[sizes[k]][b] for b, k in pairs])
        rows = []
        for q in (1, 2):
            for k in range(nd):
                row = np.zeros(nv)
                row[:nx] = (pk == k) & (shortest > T / (q + 1))
                if row.any():
                    row[nx + k] = -q
                    rows.append(row)
        if rows:
            cons.append(LinearConstraint(np.array(rows), -np.inf, 0.0))
    upper = np.concatenate([[counts[b] for b, _ in pairs], [n_ranks // d for d in sizes],
                            [speeds[0] if speeds else 0.0] * (nv - nx - nd)])
    options: dict = {"node_limit": int(node_limit), "disp": False}
    if time_limit is not None:
        options["time_limit"] = max(time_limit, 1e-3)
    integrality = np.r_[np.ones(nx + nd), np.zeros(nv - nx - nd)]  # speed capacity is continuous
    res = milp(cost, integrality=integrality, bounds=Bounds(np.zeros(nv), upper), constraints=cons, options=options)
    if res.x is None:
        return None
    xv = np.rint(res.x).astype(np.int64)
    x = np.zeros((nb, nd), dtype=np.int64)
    for v, (b, k) in enumerate(pairs):
        x[b, k] = xv[v]
    return {d: int(xv[nx + k]) for k, d in enumerate(sizes)}, x


def _speed_rows(T: float, A_load: np.ndarray, sizes: list[int], nx: int,
                speeds: tuple[float, float]) -> list:
    """The load rows with per-rank speeds: each size ``d`` draws a speed capacity ``R[d]`` (continuous,
    the variables after the group counts) from the ranks' total, at most its ranks at the fastest speed::

        sum_b x[b, d] * d * tbar_d(b) <= T * R[d]      groups of d finish within T on the speed they hold
        R[d] <= d * m[d] * s_max                        no rank faster than the fastest
        sum_d R[d] <= sum_r s_r                         the speed the data ranks have

    Group identities stay out of the MILP (a rank's speed is a fluid it hands to a size); the realised
    schedule places sequences on the real groups by their own speeds. At nominal speeds these rows
    say what the plain load row says, so the plain one is used there.
    """
    from scipy.optimize import LinearConstraint

    nd, nv = len(sizes), A_load.shape[1]
    total, fastest = speeds
    load = A_load.copy()
    cap = np.zeros((nd, nv))
    for k, d in enumerate(sizes):
        load[k, :nx] *= d
        load[k, nx + k] = 0.0
        load[k, nx + nd + k] = -T
        cap[k, nx + nd + k] = 1.0
        cap[k, nx + k] = -d * fastest
    supply = np.zeros((1, nv))
    supply[0, nx + nd:] = 1.0
    return [LinearConstraint(load, -np.inf, 0.0), LinearConstraint(cap, -np.inf, 0.0),
            LinearConstraint(supply, 0.0, total)]


def _targets(batch: Batch, sizes: list[int], x: np.ndarray, index: np.ndarray, spread: bool) -> np.ndarray:
    """Each sequence's group size from the MILP's per-bucket counts ``x[b, k]`` (on ``sizes[k]`` ranks).

    Without ``spread``, a bucket's longest sequences take its largest sizes. With ``spread``, the
    bucket's sequences (longest first) go to the size furthest behind its share of the bucket's
    time, so every size gets about the work the MILP planned for it (``x[b, k]`` times the mean), not
    the bucket's longest members alone.
    """
    lens, times, need = batch.lens, batch.times, batch.need
    target = need.copy()
    order_k = sorted(range(len(sizes)), key=lambda k: -sizes[k])
    for b in range(x.shape[0]):
        ids = np.flatnonzero(index == b)
        ids = ids[np.argsort(-lens[ids], kind="stable")]
        if not spread:
            per = [sizes[k] for k in order_k for _ in range(x[b, k])]
            target[ids] = np.maximum(need[ids], per[: ids.size])
            continue
        ks = [k for k in order_k if x[b, k] > 0]
        left = {k: int(x[b, k]) for k in ks}
        plan = {k: x[b, k] * float(times[sizes[k]][ids].mean()) for k in ks}
        done = dict.fromkeys(ks, 0.0)
        for i in ids.tolist():
            open_k = [k for k in ks if left[k] > 0] or ks
            k = min(open_k, key=lambda k: (done[k] + times[sizes[k]][i]) / plan[k])
            target[i] = max(int(need[i]), sizes[k])
            done[k] += times[sizes[k]][i]
            left[k] -= 1
    return target


def _realise(batch: Batch, ctx: ScheduleContext, groups: dict[int, int], x: np.ndarray, index: np.ndarray,
             started: float) -> StepSchedule:
    """The best of a few concrete schedules for one MILP solution (the layout ``groups`` is fixed).

    Bucket counts are only an average; the sequences behind them differ in time, so the MILP's
    sizes are realised three ways (longest to largest, spread by time, and the layout alone with
    every sequence free to take any group that holds it) and each is placed by LPT and balance.
    """
    sizes_sorted = sorted(groups)
    slots = aligned_layout([d for d in sizes_sorted for _ in range(groups[d])], ctx.num_ranks)
    best = None
    for how in ("largest", "spread", "layout"):
        target = batch.need if how == "layout" else _targets(batch, sizes_sorted, x, index, how == "spread")
        target = round_up_to(target, [s.size for s in slots])
        placement = place(batch, ctx, slots, target)
        if best is None or placement.makespan < best[0].makespan - 1e-12:
            best = (placement, how)
    assert best is not None  # three ways were tried
    placement, how = best
    return build_step_schedule("milp", batch.lens, ctx, slots, pack_groups(placement, batch.lens, ctx), started,
                               extra={"realised_by": how})


def milp_schedule(lengths: ArrayLike, ctx: ScheduleContext, *, seed: int = 0, buckets: int = 16,
                  node_limit: int = 200, iterations: int = 8, time_limit: float | None = None,
                  cuts: bool = True) -> StepSchedule:
    """Bucketed MILP over group sizes, warm-started from the best heuristic; never worse than it."""
    import scipy.optimize  # noqa: F401  (loaded before the clock starts: the import is no solver time)

    t0 = time.perf_counter()
    lens = check_lengths(lengths)
    warm = min((hdp(lens, ctx, seed=seed), balanced(lens, ctx, seed=seed)), key=lambda s: s.predicted_step_time)
    batch = Batch.of(lens, ctx)
    times = batch.times
    bk = dp_buckets(lens, k=buckets)
    need_b = min_groups(bk.edges, ctx)
    # Per-rank speeds enter the load rows (_speed_rows); a sequence is at best on the fastest ranks,
    # where it takes at least min(1, 1 / s_max) of its nominal time (compute scales, communication not).
    uneven = bool(ctx.speed) and any(v != 1.0 for v in ctx.speed)
    speeds = (float(sum(ctx.speed)), float(max(ctx.speed))) if uneven else None
    speed = max(1.0, speeds[1]) if speeds else 1.0
    max_t = {d: t / speed for d, t in seq_times(bk.edges, ctx).items()}
    mean_t = {d: np.bincount(bk.index, weights=t, minlength=bk.counts.size) / bk.counts
              for d, t in times.items()}
    min_t = {}
    for d, t in times.items():
        m = np.full(bk.counts.size, np.inf)
        np.minimum.at(m, bk.index, t / speed)
        min_t[d] = m
    lo, hi = lower_bound(lens, ctx), warm.predicted_step_time
    best, solved, status, stopped = warm, 0, "warm start kept", "iterations"
    for _ in range(iterations):
        left = None if time_limit is None else t0 + time_limit - time.perf_counter()
        if left is not None and left <= 0:
            stopped = "time_limit"
            break
        if hi - lo <= 1e-3 * hi:
            stopped = "converged"
            break
        T = 0.5 * (lo + hi)
        sol = _solve(T, mean_t, max_t, need_b, bk.counts, ctx.num_ranks, node_limit, left, min_t if cuts else None,
                     speeds)
        if sol is None:
            lo = T
            continue
        solved += 1
        cand = _realise(batch, ctx, sol[0], sol[1], bk.index, t0)
        if cand.predicted_step_time < best.predicted_step_time:
            best, status = cand, "milp"
        hi = T
    if time_limit is not None and time.perf_counter() - t0 >= time_limit:
        stopped = "time_limit"  # a solve may have been cut short inside HiGHS too
    extra = dict(best.extra)
    extra.update({"source": status, "stopped_by": stopped, "milp_solves": solved,
                  "bucket_token_error": bk.token_error(lens),
                  "warm_start_step_time": warm.predicted_step_time})
    return StepSchedule(lengths=best.lengths, groups=best.groups, policy="milp",
                        predicted_step_time=best.predicted_step_time, lower_bound=best.lower_bound,
                        deferred=best.deferred, scheduler_seconds=time.perf_counter() - t0, extra=extra)
