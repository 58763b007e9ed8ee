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

In a step of length ``T`` a rank of speed ``s_r`` delivers ``s_r * T`` of them, hence
``T >= sum_i w_i / sum_r s_r`` (total work spread perfectly over all data ranks). A sequence is
never faster than on its best group with the fastest ranks, and its pieces run one after another on
one group, hence also ``T >= max_i min_{d >= m_i} t_d(l_i) / max_r s_r`` with ``t_d`` the cost
model's own time of the sequence alone (a micro-batch never takes less than its longest member).
The bound is the larger.

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
    """``t_d(l_i)``: each sequence alone on a group of each allowed size ``d`` (speed 1)."""
    return {d: np.asarray(ctx.seq_time(d, lengths), dtype=float).reshape(-1) for d in ctx.group_sizes}


def lower_bound(lengths: ArrayLike, ctx: ScheduleContext) -> float:
    """Seconds: the larger of perfectly spread work and the slowest single sequence (see module doc)."""
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0:
        return 0.0
    need = min_groups(lens, ctx)
    times = seq_times(lens, ctx)
    work = np.full(lens.size, np.inf)
    alone = np.full(lens.size, np.inf)
    for d, t in times.items():
        ok = need <= d
        work = np.where(ok, np.minimum(work, ctx.seq_work(d, lens)), work)
        alone = np.where(ok, np.minimum(alone, t), alone)
    speeds = np.asarray(ctx.speed, dtype=float) if ctx.speed else np.ones(ctx.num_ranks)
    return float(max(work.sum() / speeds.sum(), alone.max() / speeds.max()))
