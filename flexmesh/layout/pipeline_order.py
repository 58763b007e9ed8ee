"""The order of forwards and backwards on each pipeline rank when documents are cut into slices.

A document cut into slices that run in consecutive micro-batches (flexmesh.layout.step, the
``chunked`` policy) forms a *unit*: micro-batches linked by a cut document. A later slice attends to
the keys and values of the earlier ones, so its backward must run before theirs and hand them the
gradient of those keys and values (flexmesh.runtime.model.carry). On every stage a unit therefore runs its
forwards in order and its backwards in reverse; units follow one another as the micro-batches of
1F1B do (InfiniPipe, 2509.21275; TeraPipe, 2102.07988). A micro-batch no document links to another
is a unit of one, so a step without cut documents gets plain 1F1B.

:func:`pipeline_order` builds the per-rank lists by list scheduling (each rank, whenever it is free,
starts the first ready action: a backward, else a forward of a unit it has started, or of a new one
while fewer than ``num_stages - stage`` units are in flight on that stage: a unit acts as one
micro-batch of 1F1B).
Actions are taken in the time order of a simulation, so the lists can never deadlock; stage ``s``
runs on pipeline rank ``s % pp`` (interleaved chunks). :func:`check_order` checks any given lists:
every action once, dependencies respected (stage to stage, slice order within a unit, forwards in
micro-batch order on a stage), no deadlock, and reports the peak in flight per stage.
The simulator times a step in this order (flexmesh.sim.pipeline.run_pipeline with ``units``).

Written by hand: torch.distributed.pipelining runs a given per-rank list
(``_PipelineScheduleRuntime``), but has no generator for this order.

>>> order = pipeline_order([[0, 1], [2]], num_stages=2, pp=2)
>>> [" ".join(str(a) for a in rank) for rank in order]
['F0.0 F0.1 F0.2 B0.1 B0.0 B0.2', 'F1.0 F1.1 B1.1 B1.0 F1.2 B1.2']
>>> check_order(order, [[0, 1], [2]], num_stages=2).peak_in_flight
(3, 2)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flexmesh.errors import ScheduleError
from flexmesh.layout.step import Group, merge_pieces


@dataclass(frozen=True, order=True)
class Action:
    """``kind`` "F" (forward) or "B" (full backward) of micro-batch ``mb`` on stage ``stage``."""

    kind: str
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


def units_from_ends(ends: Sequence[bool]) -> list[list[int]]:
    """Micro-batch units from per-micro-batch "a chain ends here" flags (flexmesh.runtime.model.carry.chain_ends).

    >>> units_from_ends([False, True, True, False, False, True])
    [[0, 1], [2], [3, 4, 5]]
    """
    units: list[list[int]] = [[]]
    for i, end in enumerate(ends):
        units[-1].append(i)
        if end and i < len(ends) - 1:
            units.append([])
    return [u for u in units if u]


def chain_plan(group: Group) -> tuple[list[frozenset[tuple[int, int]]], list[bool]]:
    """Per micro-batch of ``group``: the segments (seq_id, start) a later segment continues, and
    whether a chain ends there (no document continues into a later micro-batch).

    Segments are the micro-batch's pieces with adjacent ones of one document merged
    (flexmesh.layout.step.merge_pieces), as the packed row holds them.

    >>> from flexmesh.layout.step import Piece
    >>> g = Group((0,), ((Piece(0, 0, 4), Piece(1, 0, 3)), (Piece(0, 4, 9),), (Piece(2, 0, 5),)))
    >>> keep, ends = chain_plan(g)
    >>> [sorted(k) for k in keep], ends
    ([[(0, 0)], [], []], [False, True, True])
    """
    rows = [merge_pieces(list(mb)) for mb in group.microbatches]
    last: dict[int, tuple[int, int]] = {}  # seq_id -> (micro-batch, start) of its latest segment
    keep: list[set[tuple[int, int]]] = [set() for _ in rows]
    reach = [-1] * len(rows)  # the latest micro-batch continuing a document seen in this one
    for i, row in enumerate(rows):
        for p in row:
            if p.start > 0 and p.seq_id in last:
                j, start = last[p.seq_id]
                keep[j].add((p.seq_id, start))
                reach[j] = max(reach[j], i)
            last[p.seq_id] = (i, p.start)
    ends, furthest = [], -1
    for i in range(len(rows)):
        furthest = max(furthest, reach[i])
        ends.append(furthest <= i)
    return [frozenset(k) for k in keep], ends


def chain_ends(groups: Sequence[Group], count: int) -> list[bool]:
    """For micro-batches ``0 .. count - 1``: whether a chain ends there in every one of ``groups``.

    The trainer runs the backward of a chain's summed loss at its end. Ranks that must pair their
    collectives micro-batch by micro-batch (ZeRO-3 gathers, flexmesh.layout.mesh.runs_in_lockstep)
    pass every group of the step, so they all run backward at the same micro-batches; others pass
    their own group. Micro-batches past a group's own (empty padding) end chains there.

    >>> from flexmesh.layout.step import Piece
    >>> a = Group((0,), ((Piece(0, 0, 4),), (Piece(0, 4, 9),), (Piece(1, 0, 3),)))
    >>> b = Group((1,), ((Piece(2, 0, 5),), (Piece(3, 0, 2),), (Piece(3, 2, 6),)))
    >>> chain_ends([a], 3), chain_ends([a, b], 4)
    ([False, True, True], [False, False, True, True])
    """
    ends = [True] * count
    for g in groups:
        for i, end in enumerate(chain_plan(g)[1][:count]):
            ends[i] = ends[i] and end
    return ends


def _check_units(units: Sequence[Sequence[int]]) -> int:
    flat = [i for u in units for i in u]
    if flat != list(range(len(flat))) or any(not u for u in units):
        raise ScheduleError(f"units {[list(u) for u in units]} must split micro-batches 0..{len(flat) - 1} "
                            "into consecutive, non-empty runs")
    return len(flat)


def _backward_sequence(units: Sequence[Sequence[int]]) -> list[int]:
    return [i for u in units for i in reversed(list(u))]


@dataclass(frozen=True)
class Timeline:
    """Start and end of every action (same order as the per-rank lists) and the step's span."""

    spans: tuple[tuple[tuple[Action, float, float], ...], ...]  # per rank
    makespan: float

    def busy(self, rank: int) -> float:
        return sum(e - s for _, s, e in self.spans[rank])

    def bubble(self) -> float:
        """Idle share of the ranks over the step: 1 - busy / (ranks x makespan)."""
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(len(self.spans))) / (len(self.spans) * self.makespan)


Durations = Callable[[Action], float]


def _unit_time(a: Action) -> float:
    return 1.0 if a.kind == "F" else 2.0


def pipeline_order(units: Sequence[Sequence[int]], num_stages: int, pp: int,
                   duration: Durations = _unit_time) -> list[list[Action]]:
    """Per pipeline rank, the actions it runs in order (module doc); ``duration`` only steers the
    interleaving (default: a backward takes twice a forward)."""
    return list(timed_order(units, num_stages, pp, duration)[0])


def timed_order(units: Sequence[Sequence[int]], num_stages: int, pp: int,
                duration: Durations) -> tuple[list[list[Action]], Timeline]:
    """:func:`pipeline_order` with the timeline of its list scheduling (each action as soon as its
    rank is free and its inputs are done): the step's span in that order."""
    m = _check_units(units)
    if num_stages < 1 or pp < 1 or num_stages % pp:
        raise ScheduleError(f"{num_stages} stages cannot be spread evenly over {pp} pipeline ranks")
    unit_end = {i: max(u) for u in units for i in u}  # the forward a unit's first backward waits for
    unit_of = {i: k for k, u in enumerate(units) for i in u}
    bseq = _backward_sequence(units)
    f_next = [0] * num_stages  # next forward's micro-batch per stage
    b_next = [0] * num_stages  # position in bseq per stage
    f_done: dict[tuple[int, int], float] = {}  # (stage, mb) -> end time
    b_done: dict[tuple[int, int], float] = {}
    free_at = [0.0] * pp
    order: list[list[Action]] = [[] for _ in range(pp)]
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]
    remaining = 2 * m * num_stages
    now = 0.0
    while remaining:
        started = False
        for r in range(pp):
            if free_at[r] > now:
                continue
            act = _pick(r, now, pp, num_stages, m, f_next, b_next, bseq, unit_end, unit_of, f_done, b_done)
            if act is None:
                continue
            end = now + float(duration(act))
            (f_done if act.kind == "F" else b_done)[(act.stage, act.mb)] = end
            if act.kind == "F":
                f_next[act.stage] += 1
            else:
                b_next[act.stage] += 1
            free_at[r] = end
            order[r].append(act)
            spans[r].append((act, now, end))
            remaining -= 1
            started = True
        if remaining and not started:
            later = [t for t in free_at if t > now] + [t for t in (*f_done.values(), *b_done.values()) if t > now]
            if not later:
                raise ScheduleError("pipeline order stalled: no action can start (a bug in the generator)")
            now = min(later)
    makespan = max(free_at) if m else 0.0
    return order, Timeline(tuple(tuple(s) for s in spans), makespan)


def _pick(r: int, now: float, pp: int, num_stages: int, m: int, f_next: list[int], b_next: list[int],
          bseq: list[int], unit_end: dict[int, int], unit_of: dict[int, int], f_done: dict,
          b_done: dict) -> Action | None:
    """The action rank ``r`` starts at ``now``: a ready backward (latest stage first), else a ready
    forward the in-flight rule allows (earliest micro-batch, then latest stage: depth first).

    In flight is counted in units: a unit acts as one micro-batch of 1F1B would, so a stage starts
    a new unit while fewer than ``num_stages - stage`` are in flight there, and runs on with one it
    has started (its backwards wait for its last forward)."""
    stages = range(r, num_stages, pp)
    for s in sorted(stages, reverse=True):
        if b_next[s] < m:
            i = bseq[b_next[s]]
            if (f_done.get((s, i), now + 1) <= now
                    and (s == num_stages - 1 or b_done.get((s + 1, i), now + 1) <= now)):
                return Action("B", s, i)
    best: Action | None = None
    for s in stages:
        i = f_next[s]
        if i >= m or (s > 0 and f_done.get((s - 1, i), now + 1) > now):
            continue
        started = i > 0 and unit_of[i - 1] == unit_of[i]
        in_flight = unit_of[i] - unit_of[bseq[b_next[s]]] if b_next[s] < m else 0
        needed = b_next[s] < m and i <= unit_end[bseq[b_next[s]]]
        if started or in_flight < num_stages - s or needed:
            cand = Action("F", s, i)
            if best is None or (i, -s) < (best.mb, -best.stage):
                best = cand
    return best


def _later_slices(units: Sequence[Sequence[int]]) -> dict[int, int]:
    """micro-batch -> the next one of its unit, whose backward must run before its own."""
    return {a: b for u in units for a, b in zip(u, u[1:])}


def _deps(a: Action, num_stages: int, later_slice: dict[int, int]) -> list[Action]:
    """What must finish before ``a`` starts: the previous stage's forward; for a backward its own
    forward, the next stage's backward and the backward of the unit's next slice."""
    if a.kind == "F":
        return [Action("F", a.stage - 1, a.mb)] if a.stage else []
    deps = [Action("F", a.stage, a.mb)]
    if a.stage < num_stages - 1:
        deps.append(Action("B", a.stage + 1, a.mb))
    if a.mb in later_slice:
        deps.append(Action("B", a.stage, later_slice[a.mb]))
    return deps


@dataclass(frozen=True)
class OrderCheck:
    peak_in_flight: tuple[int, ...]  # per stage: most micro-batches forwarded and not yet backwarded


def check_order(order: Sequence[Sequence[Action]], units: Sequence[Sequence[int]], num_stages: int) -> OrderCheck:
    """Raise ScheduleError unless the per-rank lists run every action once without deadlock and in
    a legal order (module doc); returns the peak in flight per stage."""
    m = _check_units(units)
    pp = len(order)
    want = {Action(k, s, i) for k in "FB" for s in range(num_stages) for i in range(m)}
    seen = [a for rank in order for a in rank]
    if len(seen) != len(set(seen)) or set(seen) != want:
        missing = sorted(want - set(seen))[:3]
        raise ScheduleError(f"the order must run each forward and backward once; missing {missing or 'none'}, "
                            f"{len(seen) - len(set(seen))} repeated")
    for r, rank in enumerate(order):
        wrong = [a for a in rank if a.stage % pp != r]
        if wrong:
            raise ScheduleError(f"{wrong[0]} is on pipeline rank {r}, but stage {wrong[0].stage} runs on rank "
                                f"{wrong[0].stage % pp}")
    later_slice = _later_slices(units)
    done: set[Action] = set()
    pos = [0] * pp
    in_flight = [0] * num_stages
    peak = [0] * num_stages
    f_count = [0] * num_stages
    while len(done) < len(want):
        progressed = False
        for r in range(pp):
            while pos[r] < len(order[r]):
                a = order[r][pos[r]]
                if a.kind == "F" and a.mb != f_count[a.stage]:
                    raise ScheduleError(f"stage {a.stage} runs forward {a.mb} before forward {f_count[a.stage]}; "
                                        "a stage runs its forwards in micro-batch order")
                if any(d not in done for d in _deps(a, num_stages, later_slice)):
                    break
                done.add(a)
                pos[r] += 1
                progressed = True
                if a.kind == "F":
                    f_count[a.stage] += 1
                    in_flight[a.stage] += 1
                    peak[a.stage] = max(peak[a.stage], in_flight[a.stage])
                else:
                    in_flight[a.stage] -= 1
        if not progressed:
            stuck = {r: str(order[r][pos[r]]) for r in range(pp) if pos[r] < len(order[r])}
            raise ScheduleError(f"the pipeline order deadlocks: each rank waits at {stuck}")
    return OrderCheck(tuple(peak))
