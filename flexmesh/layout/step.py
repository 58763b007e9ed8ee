"""StepSchedule: how one global batch is split, packed and assigned for one step.

Ranks here are *data ranks*: the plan's data-parallel and context-parallel axes merged into one
axis (ByteScale's hybrid data parallelism). With tensor parallel degree tp and pipeline degree pp,
data rank ``r`` is the replica slice ``r`` of ``world / (tp * pp)`` slices. A group is a run of
consecutive data ranks that shards its sequences ``cp = len(ranks)`` ways; every rank of a group runs
the same micro-batches.

A piece ``(seq_id, start, end)`` is tokens ``[start, end)`` of sequence ``seq_id``; a sequence may be
cut into pieces in different micro-batches (pipeline chunking). Every token of the batch, less the
sequences deferred to a later step, appears in exactly one piece.

Cut sequences (:meth:`StepSchedule.check_cuts`, :func:`carries_pieces`): the runtime trains a cut
sequence exactly as the whole one by carrying the keys and values of its earlier pieces to the later
ones. It can do so only between micro-batches of one group, in run order (under a pipeline the
schedule runs their backwards in reverse, flexmesh.layout.pipeline_order), and not with dynamic
RoPE scaling; a policy cuts only where its context allows (``ScheduleContext.cut_documents``).

Example: four data ranks, a 6000-token sequence on a group of 2, two short ones packed on rank 2,
rank 3 takes the fourth::

    StepSchedule(lengths=(6000, 300, 500, 900), policy="hdp", groups=(
        Group(ranks=(0, 1), microbatches=((Piece(0, 0, 6000),),)),
        Group(ranks=(2,), microbatches=((Piece(1, 0, 300), Piece(2, 0, 500)),)),
        Group(ranks=(3,), microbatches=((Piece(3, 0, 900),),)),
    ))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from flexmesh.errors import ScheduleError


def carries_pieces(dynamic_rope: bool = False) -> bool:
    """Whether the runtime keeps a sequence cut over micro-batches exact.

    With any pipeline depth: without pipelining the trainer runs the forwards of a chain of
    micro-batches linked by a cut sequence before their one backward; under a pipeline each
    micro-batch runs its own backward, a unit's in reverse, the later pieces handing the earlier
    ones the gradient of their keys and values (flexmesh.runtime.model.carry,
    flexmesh.layout.pipeline_order). Not with dynamic RoPE scaling, whose angles depend on the length
    of the sequence in the forward pass, which a piece does not know. The one place this rule is
    written; schedulers and the trainer ask it.

    >>> carries_pieces(), carries_pieces(dynamic_rope=True)
    (True, False)
    """
    return not dynamic_rope


def merge_pieces(pieces: Sequence[Piece]) -> list[Piece]:
    """Join consecutive pieces that continue one another in the same document.

    Two such pieces in one micro-batch form one attention segment: the second must see the first.
    """
    merged: list[Piece] = []
    for p in pieces:
        if merged and merged[-1].seq_id == p.seq_id and merged[-1].end == p.start:
            merged[-1] = Piece(p.seq_id, merged[-1].start, p.end)
        else:
            merged.append(p)
    return merged


def _one_segment(spots: list[tuple[int, int, int, Piece]]) -> bool:
    """Whether a sequence's pieces (group, micro-batch, position, piece), in run order, sit side by
    side in one micro-batch: one segment of the packed row, nothing carried."""
    return len({mi for _, mi, _, _ in spots}) == 1 and \
        [pi for _, _, pi, _ in spots] == list(range(spots[0][2], spots[0][2] + len(spots)))


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

    def cut_sequences(self) -> list[int]:
        """Sequences whose pieces do not form one run of adjacent pieces in one micro-batch: those the
        runtime carries keys and values for (flexmesh.runtime.model.carry).

        >>> mb = (Piece(0, 0, 4), Piece(0, 4, 6), Piece(1, 0, 3))
        >>> StepSchedule((6, 5), (Group((0,), (mb, (Piece(1, 3, 5),))),), "t").cut_sequences()
        [1]
        """
        return sorted(sid for sid, spots in self._spots().items() if not _one_segment(spots))

    def _spots(self) -> dict[int, list[tuple[int, int, int, Piece]]]:
        """seq_id -> its pieces as (group, micro-batch, position, piece), in run order."""
        where: dict[int, list[tuple[int, int, int, Piece]]] = {}
        for gi, g in enumerate(self.groups):
            for mi, mb in enumerate(g.microbatches):
                for pi, p in enumerate(mb):
                    where.setdefault(p.seq_id, []).append((gi, mi, pi, p))
        for spots in where.values():
            spots.sort(key=lambda s: (s[1], s[2]))
        return where

    def check_cuts(self, dynamic_rope: bool = False) -> None:
        """Raise ScheduleError, naming the sequence, unless the runtime can train every cut one exactly.

        A sequence is cut when its pieces do not form one run of adjacent pieces in one micro-batch.
        Its pieces must then all lie on one group and run in order (micro-batch by micro-batch, left
        to right within one), and the run must be able to carry them (:func:`carries_pieces`).
        """
        for sid, spots in self._spots().items():
            if len(spots) == 1:
                continue
            groups = sorted({gi for gi, _, _, _ in spots})
            if len(groups) > 1:
                names = " and ".join(str(list(self.groups[gi].ranks)) for gi in groups)
                raise ScheduleError(
                    f"sequence {sid} is cut over the groups of data ranks {names}; the runtime carries a cut "
                    "sequence's keys and values only between micro-batches of one group: keep its pieces on one group")
            for (_, ma, _, a), (_, mb_, _, b) in zip(spots, spots[1:]):
                if b.start < a.end:
                    raise ScheduleError(
                        f"sequence {sid}: piece [{b.start}, {b.end}) in micro-batch {mb_} runs after piece "
                        f"[{a.start}, {a.end}) in micro-batch {ma}; run a cut sequence's pieces in order")
            if not _one_segment(spots) and not carries_pieces(dynamic_rope):
                raise ScheduleError(
                    f"sequence {sid} is cut over micro-batches {sorted({mi for _, mi, _, _ in spots})} of a model "
                    "with dynamic RoPE scaling, whose angles depend on the whole length: schedule it whole")
