"""A per-step lower bound on the step time: no schedule of the batch can beat it.

Derivation. Let sequence ``i`` have length ``l_i`` and let ``m_i`` be the smallest group whose memory
holds it (:meth:`ScheduleContext.min_group`). Whatever the schedule, ``i`` runs on some group of
``d >= m_i`` ranks and keeps all ``d`` of them busy for at least ``e_d(l_i) - c_d`` seconds, where
``e_d`` is the time of the sequence alone by the cost model's lower envelope (compute plus its
context-parallel communication, which no schedule can avoid once memory forces ``d > 1``, with every
kernel at its best rate: tiles, waves and launches make a packed micro-batch cheaper than its
documents run one by one, so the model's own times would not bound a packing) and ``c_d`` the fixed
cost of a micro-batch by the envelope, which packing may share among sequences. So ``i`` consumes at least

    w_i = min over d >= m_i of  d * (e_d(l_i) - c_d)      rank-seconds (at speed 1)

(:meth:`ScheduleContext.seq_work`).

In a step of length ``T`` a rank of nominal speed delivers ``T`` of them, hence
``T >= sum_i w_i / num_ranks`` (total work spread perfectly over all data ranks). A sequence is
never faster than on its best group, and its pieces run one after another on one group, hence also
``T >= max_i min_{d >= m_i} t_d(l_i)`` with ``t_d`` the cost model's time of the sequence alone
(a micro-batch never takes less than its longest member), by its packing floor
(:meth:`ScheduleContext.packing_floor`: the model prices attention over blocks of a micro-batch's
mean length, which a short document packed beside a long one lowers, possibly past a tile boundary;
the floor never charges a document alone more than any micro-batch holding it). The bound is the larger, tightened: in a
step of length ``T`` sequence ``i`` can only have run on a group size with ``t_d(l_i) <= T``, so its
minimum in ``w_i`` runs over those sizes only, and the bound is the least ``T`` with
``T >= sum_i w_i(T) / num_ranks`` (found by bisection, :func:`_tightest`). A short ``T`` closes the
small groups to long sequences, whose work on larger groups then counts.

Speed factors. A device of relative speed ``s`` computes ``1 / s`` times as long but communicates
as long as at nominal speed (the simulator's rule, :meth:`ScheduleContext.at_speed`). So split
``w_i = c_i + k_i`` into compute and exposed communication (:meth:`ScheduleContext.seq_work_split`)
and let ``f_i(s) = c_i / s + k_i * min(1, 1 / s)``. On a group of ``d`` ranks whose slowest member has
speed ``s``, sequence ``i`` keeps each member ``r`` busy for at least ``f_i(s) / d >= f_i(s_r) / d``
(``f`` falls as ``s`` grows; above nominal speed the time is at least ``w_i / (d s)``). Weigh each
rank's busy time by any ``mu_r >= 0`` and add up: ``T * sum_r mu_r >= sum_i min_r mu_r f_i(s_r)``, so

    T >= max over mu of  sum_i min_{d >= m_i} min_r mu_r f_i(s_r) / sum_r mu_r

(the dual of spreading the work perfectly, each rank at its own speed). The bound tries
``mu_r = s_r ** alpha`` for ``alpha`` in :data:`ALPHAS`: ``alpha = 1`` charges every sequence
``c_i + min(1, min_r s_r) * k_i`` against the total speed ``sum_r s_r``, ``alpha = 0`` every sequence
its time on the fastest rank against ``num_ranks`` ranks; in between suits a few slow ranks among
many. It also tries ``mu_r = 1 / f(s_r)`` with ``f`` the batch's whole work (``c = sum_i c_i``,
``k = sum_i k_i`` on each sequence's smallest group): the weights at which every rank's share costs
the same, the optimum of the fluid relaxation when every sequence has the batch's mix of compute and
communication. With communication, which a slow rank does not stretch, no power of ``s_r`` reaches it:
12 ranks at speed 1 and 4 at 0.25 with a sixth of the work communication get 0.0913 per unit of work
from it against 0.0895 from the best ``alpha``. With ``S = max_r s_r`` a sequence alone takes at
least ``min_{d >= m_i} (t^c_d(l_i) / S + t^k_d(l_i) * min(1, 1 / S))`` (``t_d = t^c_d + t^k_d``, the
packing floor's time split the same way).
Every term reduces to the nominal bound when all ``s_r = 1``.

Worked example (numbers illustrative): 4 ranks of speed 1, sequences that each cost 1 s on one rank
with ``c_1 = 0``: lengths ``[a, a, a, a, a, a]`` give ``max(6 / 4, 1) = 1.5`` s; a single one gives
``max(1 / 4, 1) = 1`` s.

Gradient synchronisation and the optimizer step are per-step constants added by the simulator, not
by the scheduler, and are left out here as they are in the policies' predicted times.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.schedule.context import ScheduleContext


def min_groups(lengths: np.ndarray, ctx: ScheduleContext) -> np.ndarray:
    """Vectorised :meth:`ScheduleContext.min_group`: fewest ranks holding each sequence.

    Raises the context's ScheduleError (naming the length and the largest that fits) when the
    longest sequence fits nowhere.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0:
        return np.zeros(0, dtype=np.int64)
    ctx.min_group(int(lens.max()))  # raises the user-facing error if nothing holds the longest
    sizes = np.array(ctx.group_sizes)
    caps = np.maximum.accumulate(np.array([ctx.max_tokens(int(d)) for d in sizes]))
    return sizes[np.searchsorted(caps, lens, side="left")]


def seq_times(lengths: np.ndarray, ctx: ScheduleContext) -> dict[int, np.ndarray]:
    """``t_d(l_i)``: each sequence alone on a group of each allowed size ``d`` (speed 1, read-only)."""
    return ctx.by_size("time", lengths)


def seq_loads(lengths: np.ndarray, ctx: ScheduleContext) -> dict[int, np.ndarray]:
    """Each sequence's share of a packed group of each allowed size (:meth:`ScheduleContext.seq_load`;
    speed 1, read-only): what the placing policies sum per group."""
    return ctx.by_size("load", lengths)


def lower_bound(lengths: ArrayLike, ctx: ScheduleContext) -> float:
    """Seconds: the larger of perfectly spread work and the slowest single sequence (see module doc)."""
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0:
        return 0.0
    need = min_groups(lens, ctx)
    if ctx.speed:
        return _with_speeds(lens, need, ctx)
    times = ctx.floor_times(lens)
    works = ctx.by_size("work", lens)
    alone = np.stack([np.where(need <= d, t, np.inf) for d, t in times.items()])
    work = np.stack([np.where(need <= d, works[d], np.inf) for d in times])
    return _tightest(alone, lambda allowed: float(np.where(allowed, work, np.inf).min(axis=0).sum()) / ctx.num_ranks)


# Bisection steps of _tightest: each halves the interval in which the bound lies, so 40 leave it
# within 1e-12 of its width; every answer returned is below the exact root, so the bound stays valid.
BISECTION_STEPS = 40


def _tightest(alone: np.ndarray, spread) -> float:
    """The least ``T`` with ``T >= spread(alone <= T)``: work spread over the ranks when each sequence
    may use only the group sizes on which it finishes within ``T`` (``alone``: sizes x sequences, the
    sequence's time alone on each size, ``inf`` where it does not fit).

    A step of length ``T`` runs each sequence on one group that holds it for at least its time alone
    there (module doc), so only sizes with ``alone <= T`` are open to it, and the work it consumes is
    at least its cheapest open size's. ``spread`` falls as ``T`` grows (more sizes open), so the least
    such ``T`` is found by bisection between the slowest single sequence (every sequence has a size
    open there) and the spread at that point; the lower end, never above that root, is returned.
    """
    lo = float(alone.min(axis=0).max())
    hi = spread(alone <= lo)
    if hi <= lo:
        return lo
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        if spread(alone <= mid) <= mid:
            hi = mid
        else:
            lo = mid
    return lo


# Rank weights mu_r = s_r ** alpha the bound tries with speed factors (module doc). Any weights give a
# valid bound; 0 and 1 are the two classic ends (ranks counted alike, ranks weighed by speed), the
# steps between suit a few slow ranks among many. Each costs one pass over sequences x group sizes.
ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
# At most this many distinct speeds enter that pass; more are rounded up onto a geometric grid (a rank
# counted faster than it is can only lower the bound, so it stays valid), bounding its cost.
SPEED_LEVELS = 16


def speed_levels(speeds: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Distinct speeds and how many ranks have each; beyond :data:`SPEED_LEVELS`, each speed rounded up
    onto a geometric grid from the slowest to the fastest.

    >>> [a.tolist() for a in speed_levels([1.0, 0.5, 1.0])]
    [[0.5, 1.0], [1, 2]]
    """
    s = np.asarray(speeds, dtype=float)
    levels, counts = np.unique(s, return_counts=True)
    if levels.size > SPEED_LEVELS:
        grid = np.geomspace(levels[0], levels[-1], SPEED_LEVELS)
        grid[[0, -1]] = levels[[0, -1]]
        levels, counts = np.unique(grid[np.searchsorted(grid, s * (1 - 1e-12))], return_counts=True)
    return levels, counts


def _with_speeds(lens: np.ndarray, need: np.ndarray, ctx: ScheduleContext) -> float:
    """The bound with speed factors: the best of the weighted sums over :data:`ALPHAS`, or the slowest
    single sequence on the fastest ranks (module doc)."""
    levels, counts = speed_levels(ctx.speed)
    fastest = float(levels[-1])
    a = lens.astype(float)
    sizes = ctx.group_sizes
    comp, comm = np.empty((len(sizes), lens.size)), np.empty((len(sizes), lens.size))
    alone = np.full((len(sizes), lens.size), np.inf)
    for j, d in enumerate(sizes):
        ok = need <= d
        comp[j], comm[j] = ctx.seq_work_split(d, lens)
        comp[j, ~ok] = comm[j, ~ok] = np.inf
        tc, tk = ctx.packing_floor().microbatch_split(d, a, ctx.cost.attention_sq(0.0, a))
        alone[j] = np.where(ok, tc / fastest + tk * min(1.0, 1.0 / fastest), np.inf)

    # The fluid weights (module doc): each sequence's work on its smallest group, summed.
    first = np.argmax(np.isfinite(comp), axis=0)
    c_all, k_all = float(comp[first, np.arange(lens.size)].sum()), float(comm[first, np.arange(lens.size)].sum())
    weights = [levels ** alpha for alpha in ALPHAS]
    if c_all + k_all > 0:
        weights.append(1.0 / (c_all / levels + k_all * np.minimum(1.0, 1.0 / levels)))
    # Per weighting and speed level, what does not depend on the sizes allowed (the bisection asks spread about
    # forty times): mu * f(s) = per_c * c + per_k * k, as (weightings x levels x 1 x 1) arrays; and per weighting
    # the weighted rank count.
    per_c = np.array([mu / levels for mu in weights])[:, :, None, None]
    per_k = np.array([mu * np.minimum(1.0, 1.0 / levels) for mu in weights])[:, :, None, None]
    ranks = np.array([(mu * counts).sum() for mu in weights])

    def spread(allowed: np.ndarray) -> float:
        c, k = np.where(allowed, comp, np.inf), np.where(allowed, comm, np.inf)
        w = (per_c * c + per_k * k).min(axis=(1, 2))  # per weighting, each sequence's cheapest level and size
        return max(0.0, *(w.sum(axis=1) / ranks).tolist())

    return _tightest(alone, spread)
