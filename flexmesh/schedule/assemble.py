"""Turn a policy's decisions (groups of ranks, micro-batches of pieces) into a scored StepSchedule.

Every policy ends here, so every policy is scored the same way, by the one cost model through
:class:`ScheduleContext`:

- a micro-batch on a group of ``d`` ranks costs ``ctx.microbatch_time(d, tokens, sum of squared
  lengths)``, its compute divided by the slowest member's speed factor (communication does not slow
  down with a device's compute: :meth:`ScheduleContext.at_speed`, the simulator's rule);
- a group's time is the sum of its micro-batch times plus ``(pp - 1)`` times the largest one (the
  pipeline fill and drain; with ``pp == 1`` just the sum); with cut documents under a pipeline, the
  span of the unit order (:func:`group_time`);
- the step time is the slowest group; every rank of a group is charged its group's time, which gives
  the imbalance ``max / mean`` over ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.errors import ScheduleError
from flexmesh.layout.mesh import padded_microbatch_count
from flexmesh.layout.pipeline_order import chain_plan, timed_order, units_from_ends
from flexmesh.layout.step import Group, Piece, StepSchedule
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.lower_bound import lower_bound


@dataclass(frozen=True)
class Slot:
    """Where a group sits: ranks ``[start, start + size)``."""

    start: int
    size: int

    @property
    def ranks(self) -> tuple[int, ...]:
        """The group's data ranks, in order."""
        return tuple(range(self.start, self.start + self.size))


def aligned_layout(sizes: Iterable[int], num_ranks: int) -> list[Slot]:
    """Place groups of power-of-two ``sizes`` on ranks, each aligned to its size; spare ranks become 1-groups.

    Placing the largest first keeps every start a multiple of its size, because each start is a sum
    of larger powers of two. Groups therefore never straddle a node whose size is a power of two.

    >>> [(s.start, s.size) for s in aligned_layout([2, 4, 1], 8)]
    [(0, 4), (4, 2), (6, 1), (7, 1)]
    """
    sizes = sorted((int(s) for s in sizes), reverse=True)
    if any(s < 1 or s & (s - 1) for s in sizes):
        raise ScheduleError(f"group sizes must be powers of two, got {sizes}")
    if sum(sizes) > num_ranks:
        raise ScheduleError(f"groups of sizes {sizes} need {sum(sizes)} ranks but only {num_ranks} data ranks exist")
    out, pos = [], 0
    for s in sizes + [1] * (num_ranks - sum(sizes)):
        out.append(Slot(pos, s))
        pos += s
    return out


def slot_speed(ctx: ScheduleContext, slot: Slot) -> float:
    """Speed factor of a group: its slowest member's (1.0 without speed factors)."""
    return min(ctx.speed[slot.start:slot.start + slot.size]) if ctx.speed else 1.0


def microbatch_times(ctx: ScheduleContext, sizes: np.ndarray, tokens: np.ndarray, sq: np.ndarray,
                     speed: np.ndarray | None = None) -> np.ndarray:
    """Vectorised ``ctx.microbatch_time`` over micro-batches on groups of different sizes, at nominal
    speed or, given ``speed`` (one factor per micro-batch), with the compute at that speed."""
    out = np.zeros(len(sizes))
    for d in np.unique(sizes):
        m = sizes == d
        if speed is None:
            out[m] = ctx.microbatch_time(int(d), tokens[m], sq[m])
        else:
            compute, comm = ctx.microbatch_split(int(d), tokens[m], sq[m])
            out[m] = ctx.at_speed(compute, comm, speed[m])
    return out


def lockstep_padding(ctx: ScheduleContext, sizes: ArrayLike, counts: Sequence[int],
                     longest: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """The empty micro-batches the runtime adds in lockstep, and each group's micro-batch shape.

    Mirrors ``flexmesh.runtime.train.trainer.Trainer.local_batches``: when :attr:`ScheduleContext.in_lockstep`,
    every group (``sizes[g]`` ranks holding ``counts[g]`` micro-batches, the longest of
    ``longest[g]`` tokens) runs ``padded_microbatch_count(schedule, max(counts), pp)`` of them, the
    missing ones empty: one document of ``cp * tp`` tokens (the smallest shape that shards), or with
    ``pp > 1`` every micro-batch of the group at its longest, rounded up to that (a pipeline runs one
    shape per step). Returns (empty micro-batches per group, tokens of each of the group's micro-batch
    shapes; 0 where shapes are not padded).
    """
    n = len(counts)
    if not ctx.in_lockstep or n == 0:
        return np.zeros(n, dtype=np.int64), np.zeros(n)
    top = padded_microbatch_count(ctx.pipeline_schedule, max(counts), ctx.pp)
    quantum = np.asarray(sizes, dtype=float) * ctx.base.tp
    if ctx.pp == 1:
        shape = quantum
    else:
        shape = np.ceil(np.maximum(np.asarray(longest, dtype=float), 1.0) / quantum) * quantum
    return top - np.asarray(counts, dtype=np.int64), shape


def build_step_schedule(policy: str, lengths: ArrayLike, ctx: ScheduleContext, slots: Sequence[Slot],
                        microbatches: list[list[list[Piece]]], started: float, *, deferred: Sequence[int] = (),
                        charged_tokens: list[list[int]] | None = None, extra: dict | None = None) -> StepSchedule:
    """Score and package a step schedule.

    ``microbatches[g]`` lists group ``g``'s micro-batches in run order. ``charged_tokens[g][k]``, when
    given, is the token count the hardware actually processes for micro-batch ``k`` of group ``g``
    (a fixed-size slot computes its padding too); padding is the charged tokens not holding data.
    ``started`` is ``time.perf_counter()`` when the policy began, for ``scheduler_seconds``.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    n_mb = [len(m) for m in microbatches]
    sizes = np.repeat([s.size for s in slots], n_mb).astype(np.int64)
    # Every piece at once (one cost-model call, not one per piece), summed per micro-batch in order.
    pieces = [p for mbs in microbatches for mb in mbs for p in mb]
    mb_of = np.repeat(np.arange(len(sizes)), [len(mb) for mbs in microbatches for mb in mbs])
    starts = np.fromiter((p.start for p in pieces), dtype=float, count=len(pieces))
    stops = np.fromiter((p.end for p in pieces), dtype=float, count=len(pieces))
    real = np.bincount(mb_of, weights=stops - starts, minlength=len(sizes))
    # A piece [a, b) of a sequence attends to its whole prefix (within the window, if any): its
    # squared-length term is b^2 - a^2 without a window (CostModel.attention_sq).
    sq_of = ctx.cost.attention_sq
    sq = np.bincount(mb_of, weights=np.asarray(sq_of(starts, stops), dtype=float), minlength=len(sizes))
    charged = real if charged_tokens is None else np.array([t for ts in charged_tokens for t in ts], dtype=float)
    g_speed = np.array([slot_speed(ctx, s) for s in slots]) if ctx.speed else None
    mb_speed = None if g_speed is None else np.repeat(g_speed, n_mb)
    t_mb = microbatch_times(ctx, sizes, charged, sq, mb_speed) if len(sizes) else np.zeros(0)
    # In lockstep (ZeRO-3, pipelines) a group also runs empty micro-batches up to the step's count, and
    # with pp > 1 every one at the same shape: charge them as the runtime runs them.
    ends = np.cumsum(n_mb)
    longest = [float(charged[e - k:e].max()) if k else 0.0 for e, k in zip(ends, n_mb, strict=True)]
    g_sizes = np.array([s.size for s in slots], dtype=np.int64)
    n_pad, shape = lockstep_padding(ctx, g_sizes, n_mb, longest)
    if ctx.pp > 1 and ctx.in_lockstep and len(sizes):
        t_mb = microbatch_times(ctx, sizes, np.maximum(charged, np.repeat(shape, n_mb)), sq, mb_speed)
    pad_sq = np.array([sq_of(0.0, float(x)) for x in shape])  # an empty micro-batch is one document
    t_pad = microbatch_times(ctx, g_sizes, shape, pad_sq, g_speed) if n_pad.any() else np.zeros(len(slots))
    groups, times, pos = [], [], 0
    for g, (slot, mbs) in enumerate(zip(slots, microbatches, strict=True)):
        t = np.concatenate([t_mb[pos:pos + len(mbs)], np.full(int(n_pad[g]), t_pad[g])])
        pos += len(mbs)
        g_time = group_time(ctx.pp, t, units_from_ends(chain_plan(Group(slot.ranks, tuple(map(tuple, mbs))))[1]
                                                       + [True] * int(n_pad[g])))
        times.append(g_time)
        groups.append(Group(ranks=slot.ranks, microbatches=tuple(tuple(mb) for mb in mbs), predicted_time=g_time))
    rank_time = np.repeat(times, [s.size for s in slots])
    step = float(rank_time.max()) if rank_time.size else 0.0
    mean = float(rank_time.mean()) if rank_time.size else 0.0
    lb = lower_bound(np.delete(lens, list(deferred)) if len(deferred) else lens, ctx)
    info = {
        "imbalance": step / mean if mean > 0 else 1.0,
        "padding": float(1.0 - real.sum() / charged.sum()) if charged.sum() > 0 else 0.0,
        "ratio_to_lower_bound": step / lb if lb > 0 else 1.0,
        "microbatches": int(len(sizes)),
        "group_sizes": {str(d): sum(1 for s in slots if s.size == d) for d in sorted({s.size for s in slots})},
    }
    info.update(extra or {})
    return StepSchedule(lengths=tuple(int(x) for x in lens), groups=tuple(groups), policy=policy,
                        predicted_step_time=step, lower_bound=lb, deferred=tuple(sorted(int(i) for i in deferred)),
                        scheduler_seconds=time.perf_counter() - started, extra=info)


def group_time(pp: int, t: np.ndarray, units: Sequence[Sequence[int]]) -> float:
    """A group's time from its micro-batches' times ``t`` (fwd + bwd of one stage): the sum plus
    ``(pp - 1)`` times the largest (fill and drain), or, where cut documents link micro-batches into
    units under a pipeline, the span of the runtime's unit order (flexmesh.layout.pipeline_order) with
    a backward taking twice a forward."""
    if not len(t):
        return 0.0
    if pp == 1 or all(len(u) == 1 for u in units):
        return float(t.sum() + (pp - 1) * t.max())
    return timed_order(units, pp, pp, lambda a: float(t[a.mb]) * (1 / 3 if a.kind == "F" else 2 / 3))[1].makespan


def pieces_of(seq_ids: Sequence[int], lengths: Sequence[int] | np.ndarray) -> list[Piece]:
    """A micro-batch holding the given sequences whole (``lengths``: a list is fastest)."""
    return [Piece(int(i), 0, int(lengths[i])) for i in seq_ids]
