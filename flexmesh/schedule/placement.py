"""What the placing policies pass around: a batch's per-sequence costs and a placement of it on groups.

A placing policy (``balanced``, ``hdp``, ``milp``, ``chunked``) works in two stages. First it decides
which whole sequences each group of ranks runs: a :class:`Placement`, built and improved by
:mod:`flexmesh.schedule.assign` from a :class:`Batch` (each sequence's load on every group size, its
share of a packed micro-batch, and the smallest group it may use). Then :func:`pack_groups` packs
each group's sequences into
micro-batches, and :func:`flexmesh.schedule.assemble.build_step_schedule` scores the result.

>>> from flexmesh.schedule.assemble import aligned_layout
>>> p = Placement(aligned_layout([2], 4), (1.0, 1.0, 1.0), [[0, 2], [1], []], np.array([3.0, 1.0, 0.0]),
...               np.array([2, 1, 2]))
>>> p.members, p.sizes, p.makespan
(((0, 2), (1,), ()), [2, 1, 1], 3.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.errors import ScheduleError
from flexmesh.layout.step import Piece
from flexmesh.schedule.assemble import Slot, pieces_of, slot_speed
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.lower_bound import min_groups, seq_loads
from flexmesh.schedule.packing import best_fit_decreasing


def check_lengths(lengths: ArrayLike) -> np.ndarray:
    """A batch's sequence lengths as int64, or a ScheduleError saying what is wrong with them.

    >>> check_lengths([3, 5.0]).tolist()
    [3, 5]
    """
    a = np.asarray(lengths)
    if a.ndim != 1 or a.size == 0:
        raise ScheduleError("a batch needs a non-empty 1-D list of sequence lengths")
    if not np.issubdtype(a.dtype, np.integer) and not np.all(np.mod(a, 1) == 0):
        raise ScheduleError("sequence lengths must be whole token counts")
    a = a.astype(np.int64)
    if (a < 1).any():
        raise ScheduleError(f"sequence lengths must be >= 1 token; found {int(a.min())}")
    return a


def round_up_to(target: np.ndarray, sizes: ArrayLike) -> np.ndarray:
    """Each target group size raised to the smallest of ``sizes`` holding it (the largest when none does).

    >>> round_up_to(np.array([1, 2, 8, 16]), [4, 8, 4]).tolist()
    [4, 4, 8, 8]
    """
    have = np.unique(np.asarray(sizes, dtype=np.int64))
    return have[np.minimum(np.searchsorted(have, target, side="left"), have.size - 1)]


# eq=False: the fields hold numpy arrays, whose == is elementwise; nothing compares these values.
@dataclass(frozen=True, eq=False)
class Batch:
    """One global batch as the placers see it.

    ``times[d][i]``: seconds sequence ``i`` adds to a group of ``d`` ranks whose micro-batches are
    packed (speed 1; :meth:`ScheduleContext.seq_load`, not its time alone: a packed micro-batch of
    many short sequences costs less than their times alone), for every allowed size ``d``.
    ``need[i]``: the smallest group sequence ``i`` may be placed on, its memory need
    (:func:`~flexmesh.schedule.lower_bound.min_groups`) unless a policy sets a floor of its own.
    """

    lens: np.ndarray
    times: dict[int, np.ndarray]
    need: np.ndarray

    @classmethod
    def of(cls, lengths: ArrayLike, ctx: ScheduleContext) -> Batch:
        """Checked lengths, their memory needs and their times on ``ctx`` (raises ScheduleError)."""
        lens = check_lengths(lengths)
        need = min_groups(lens, ctx)  # first: it names a sequence that fits nowhere
        return cls(lens=lens, times=seq_loads(lens, ctx), need=need)


@dataclass(frozen=True, eq=False)
class Placement:
    """Whole sequences placed on groups of ranks, before packing.

    ``slots[g]`` is group ``g``'s ranks and ``speeds[g]`` its speed factor (:func:`slot_speeds`);
    ``members[g]`` the ids of its sequences in placement order; ``loads[g]`` its estimated seconds
    (its members' loads, :attr:`Batch.times`, divided by the speed); ``target[i]`` the smallest group size sequence
    ``i`` was placed for. Lists given for the tuples are frozen on construction.
    """

    slots: Sequence[Slot]  # a tuple once built (as speeds and members)
    speeds: Sequence[float]
    members: Sequence[Sequence[int]]
    loads: np.ndarray
    target: np.ndarray

    def __post_init__(self) -> None:
        # Builders hand in the lists they filled; freeze them so a Placement is a value.
        object.__setattr__(self, "slots", tuple(self.slots))
        object.__setattr__(self, "speeds", tuple(self.speeds))
        object.__setattr__(self, "members", tuple(tuple(int(i) for i in m) for m in self.members))

    @property
    def sizes(self) -> list[int]:
        """Ranks per group."""
        return [s.size for s in self.slots]

    @property
    def makespan(self) -> float:
        """Estimated seconds of the slowest group."""
        return float(self.loads.max())

    def member_lists(self) -> list[list[int]]:
        """Fresh, editable copies of ``members``."""
        return [list(m) for m in self.members]


def slot_speeds(ctx: ScheduleContext, slots: Sequence[Slot], lengths: ArrayLike) -> tuple[float, ...]:
    """Each group's speed factor on a batch of ``lengths`` (1.0 without speed factors): its slowest
    member's, or, where groups run their own micro-batch counts, the factor at which it runs its loads.

    A slow device stretches compute but not exposed communication (:meth:`ScheduleContext.at_speed`),
    so a group at speed ``s`` whose loads on its size hold a share ``c`` of communication
    (:meth:`ScheduleContext.comm_share`) runs them at ``1 / ((1 - c) / s + c)``; dividing its loads by
    ``s`` alone would overcharge it, and it would finish early. In lockstep
    (:attr:`ScheduleContext.in_lockstep`) every group runs the step's largest micro-batch count and
    communicates for all of them, whatever its own load: there the communication a group adds by
    taking more work is not its own time but everyone's (one more micro-batch in lockstep), and the
    slowest member's factor stays (on bench/stragglers.py's ZeRO-3 cases the load-based factor
    cost up to 1% of throughput; on its pipelines with their own counts it gained 0.5-0.8%).

    >>> round(1.0 / ((1 - 0.2) / 0.5 + 0.2), 3)  # speed 0.5 with 20% exposed communication
    0.556
    """
    raw = [slot_speed(ctx, s) for s in slots]
    if not ctx.speed or ctx.in_lockstep:
        return tuple(raw)
    share = {d: ctx.comm_share(d, lengths) for d in {s.size for s in slots}}
    return tuple(1.0 / ((1.0 - share[s.size]) / v + share[s.size]) for s, v in zip(slots, raw, strict=True))


def pack_groups(placement: Placement, lens: np.ndarray, ctx: ScheduleContext) -> list[list[list[Piece]]]:
    """Each group's members in best-fit-decreasing micro-batches under ``ctx.pack_tokens``.

    A member longer than that budget (it fits memory, or it would not be here) rides in a
    micro-batch of its own length.
    """
    ll = lens.tolist()
    return [[pieces_of(mb, ll) for mb in best_fit_decreasing(m, ll, max(ctx.pack_tokens(s.size),
                                                                        max(ll[i] for i in m)))] if m else []
            for s, m in zip(placement.slots, placement.members, strict=True)]
