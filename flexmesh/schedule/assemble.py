"""Turn a policy's decisions (groups of ranks, micro-batches of pieces) into a scored StepSchedule.

Every policy ends here, so every policy is scored the same way, by the one cost model through
:class:`ScheduleContext`:

- a micro-batch on a group of ``d`` ranks costs ``ctx.microbatch_time(d, tokens, sum of squared
  lengths)``, divided by the slowest member's speed factor;
- a group's time is the sum of its micro-batch times plus ``(pp - 1)`` times the largest one (the
  pipeline fill and drain; with ``pp == 1`` just the sum);
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


def microbatch_times(ctx: ScheduleContext, sizes: np.ndarray, tokens: np.ndarray, sq: np.ndarray) -> np.ndarray:
    """Vectorised ``ctx.microbatch_time`` over micro-batches on groups of different sizes (speed 1)."""
    out = np.zeros(len(sizes))
    for d in np.unique(sizes):
        m = sizes == d
        out[m] = ctx.microbatch_time(int(d), tokens[m], sq[m])
    return out


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
    real = np.array([sum(p.end - p.start for p in mb) for mbs in microbatches for mb in mbs], dtype=float)
    # A piece [a, b) of a sequence attends to its whole prefix: its squared-length term is b^2 - a^2.
    sq = np.array([sum(float(p.end) ** 2 - float(p.start) ** 2 for p in mb) for mbs in microbatches for mb in mbs],
                  dtype=float)
    charged = real if charged_tokens is None else np.array([t for ts in charged_tokens for t in ts], dtype=float)
    t_mb = microbatch_times(ctx, sizes, charged, sq) if len(sizes) else np.zeros(0)
    groups, times, pos = [], [], 0
    for slot, mbs in zip(slots, microbatches, strict=True):
        t = t_mb[pos:pos + len(mbs)] / slot_speed(ctx, slot)
        pos += len(mbs)
        g_time = float(t.sum() + (ctx.pp - 1) * t.max()) if len(t) else 0.0
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


def pieces_of(seq_ids: Sequence[int], lengths: Sequence[int] | np.ndarray) -> list[Piece]:
    """A micro-batch holding the given sequences whole (``lengths``: a list is fastest)."""
    return [Piece(int(i), 0, int(lengths[i])) for i in seq_ids]
