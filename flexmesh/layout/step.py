"""StepSchedule: how one global batch is split, packed and assigned for one step.

Ranks here are *data ranks*: the plan's data-parallel and context-parallel axes merged into one
axis (ByteScale's hybrid data parallelism). With tensor parallel degree tp and pipeline degree pp,
data rank ``r`` is the replica slice ``r`` of ``world / (tp * pp)`` slices. A group is a run of
consecutive data ranks that shards its sequences ``cp = len(ranks)`` ways; every rank of a group runs
the same micro-batches.

A piece ``(seq_id, start, end)`` is tokens ``[start, end)`` of sequence ``seq_id``; a sequence may be
cut into pieces in different micro-batches (pipeline chunking). Every token of the batch, less the
sequences deferred to a later step, appears in exactly one piece.

Example: four data ranks, a 6000-token sequence on a group of 2, two short ones packed on rank 2,
rank 3 takes the fourth::

    StepSchedule(lengths=(6000, 300, 500, 900), policy="hdp", groups=(
        Group(ranks=(0, 1), microbatches=((Piece(0, 0, 6000),),)),
        Group(ranks=(2,), microbatches=((Piece(1, 0, 300), Piece(2, 0, 500)),)),
        Group(ranks=(3,), microbatches=((Piece(3, 0, 900),),)),
    ))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flexmesh.errors import ScheduleError


@dataclass(frozen=True)
class Piece:
    seq_id: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


MicroBatch = tuple[Piece, ...]


@dataclass(frozen=True)
class Group:
    ranks: tuple[int, ...]
    microbatches: tuple[MicroBatch, ...]
    predicted_time: float = 0.0  # seconds, from the cost model

    @property
    def cp(self) -> int:
        return len(self.ranks)

    @property
    def tokens(self) -> int:
        return sum(p.length for mb in self.microbatches for p in mb)


@dataclass(frozen=True)
class StepSchedule:
    """One step's schedule. ``policy`` made it; ``requested_policy`` is the policy the run asked for
    (empty: the same), ``fallback`` whether it was replaced because it came late; the runtime reports
    all three. ``extra`` holds the scheduler's diagnostics (imbalance, padding, ratio to the lower
    bound, ...), which nothing executes."""

    lengths: tuple[int, ...]
    groups: tuple[Group, ...]
    policy: str
    predicted_step_time: float = 0.0
    lower_bound: float = 0.0
    deferred: tuple[int, ...] = ()
    scheduler_seconds: float = 0.0
    requested_policy: str = ""
    fallback: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def num_ranks(self) -> int:
        return sum(g.cp for g in self.groups)

    def validate(self, num_ranks: int | None = None) -> None:
        """Raise ScheduleError unless every token appears exactly once and ranks are used once each."""
        ranks = sorted(r for g in self.groups for r in g.ranks)
        if num_ranks is not None and ranks != list(range(num_ranks)):
            raise ScheduleError(f"schedule uses ranks {ranks}, expected each of 0..{num_ranks - 1} once")
        for g in self.groups:
            if list(g.ranks) != list(range(g.ranks[0], g.ranks[0] + len(g.ranks))):
                raise ScheduleError(f"group ranks {g.ranks} are not consecutive")
        pieces: dict[int, list[tuple[int, int]]] = {}
        for g in self.groups:
            for mb in g.microbatches:
                for p in mb:
                    if not (0 <= p.seq_id < len(self.lengths)) or not (0 <= p.start < p.end <= self.lengths[p.seq_id]):
                        raise ScheduleError(f"piece {p} lies outside its sequence")
                    pieces.setdefault(p.seq_id, []).append((p.start, p.end))
        deferred = set(self.deferred)
        for sid, length in enumerate(self.lengths):
            spans = sorted(pieces.get(sid, []))
            if sid in deferred:
                if spans:
                    raise ScheduleError(f"sequence {sid} is deferred but also scheduled")
                continue
            pos = 0
            for a, b in spans:
                if a != pos:
                    raise ScheduleError(f"sequence {sid}: tokens [{pos}, {a}) missing or overlapping at {a}")
                pos = b
            if pos != length:
                raise ScheduleError(f"sequence {sid}: covers {pos} of {length} tokens")
