"""Pipeline schedules as a dependency simulation over (stage, micro-batch, pass).

Each pipeline rank runs its passes in a fixed order (the schedule); a pass starts when its rank is
free and its input has arrived: forward ``(stage, j)`` needs forward ``(stage - 1, j)``, backward
``(stage, j)`` needs backward ``(stage + 1, j)`` (the last stage needs its own forward). Micro-batches
may differ in duration, which is why this is simulated rather than taken from the closed form
:func:`flexmesh.cost.pipeline_time` (that form holds for equal micro-batches and is what the tests
check this against).

With interleaving, rank ``r`` holds ``v`` model chunks; chunk ``c`` of rank ``r`` is virtual stage
``c * pp + r`` (Megatron-LM's placement, as in :meth:`flexmesh.search.Plan.chunks_of_rank`).

Orders, for ``pp = 2``, ``m = 3`` (F = forward, B = backward, digits = micro-batch)::

    gpipe  rank 0: F0 F1 F2 B0 B1 B2       1f1b  rank 0: F0 F1 B0 F2 B1 B2
           rank 1: F0 F1 F2 B0 B1 B2             rank 1: F0 B0 F1 B1 F2 B2
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from flexmesh.errors import PlanError
from flexmesh.layout.pipeline_order import pipeline_order
from flexmesh.layout.plan import PIPELINE_SCHEDULES


@dataclass(frozen=True)
class Pass:
    """One pass of one micro-batch through one model chunk on a pipeline rank."""

    backward: bool
    chunk: int
    mb: int


def rank_order(schedule: str, pp: int, rank: int, m: int, v: int = 1) -> list[Pass]:
    """The order in which pipeline rank ``rank`` runs its passes.

    >>> [("B" if p.backward else "F") + str(p.mb) for p in rank_order("1f1b", 4, 1, 4)]
    ['F0', 'F1', 'F2', 'B0', 'F3', 'B1', 'B2', 'B3']
    """
    return list(_rank_order(schedule, pp, rank, m, v))


@lru_cache(maxsize=4096)
def _rank_order(schedule: str, pp: int, rank: int, m: int, v: int) -> tuple[Pass, ...]:
    """:func:`rank_order`, kept: the simulator asks for the same few orders at every step it prices."""
    if schedule not in PIPELINE_SCHEDULES:
        raise PlanError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(PIPELINE_SCHEDULES)}")
    if schedule != "interleaved" and v != 1:
        raise PlanError(f"{v} model chunks per rank need the 'interleaved' schedule")
    if schedule == "gpipe":
        return tuple([Pass(False, 0, j) for j in range(m)] + [Pass(True, 0, j) for j in range(m)])
    if schedule == "1f1b":
        fwd = [Pass(False, 0, j) for j in range(m)]
        bwd = [Pass(True, 0, j) for j in range(m)]
        warmup = min(pp - rank - 1, m)
    else:
        fwd, bwd = _interleaved_sequences(pp, m, v)
        warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, m * v)
    order = fwd[:warmup]
    for k in range(len(fwd) - warmup):  # steady state: one forward, then one backward
        order += [fwd[warmup + k], bwd[k]]
    return tuple(order + bwd[len(fwd) - warmup:])


def _interleaved_sequences(pp: int, m: int, v: int) -> tuple[list[Pass], list[Pass]]:
    """Megatron-LM's interleaved order: micro-batches in blocks of ``pp``, each block through chunk
    0, 1, ... v-1 forward and v-1, ..., 0 backward. A last block shorter than ``pp`` (``m`` not a
    multiple of ``pp``) keeps the same pattern; the simulation reports it if that would deadlock."""
    fwd: list[Pass] = []
    bwd: list[Pass] = []
    for b0 in range(0, m, pp):
        block = range(b0, min(b0 + pp, m))
        fwd += [Pass(False, c, j) for c in range(v) for j in block]
        bwd += [Pass(True, c, j) for c in reversed(range(v)) for j in block]
    return fwd, bwd


@dataclass(frozen=True)
class PipelineRun:
    """Start and end of every pass: arrays indexed ``[backward, virtual_stage, micro_batch]``."""

    start: np.ndarray
    end: np.ndarray
    orders: tuple[tuple[Pass, ...], ...]  # per pipeline rank

    @property
    def finish(self) -> np.ndarray:
        """When each pipeline rank ends its last pass."""
        pp = len(self.orders)
        ends = self.end.tolist()  # single entries: lists read faster than the array
        return np.array([max(ends[int(p.backward)][p.chunk * pp + r][p.mb] for p in self.orders[r])
                         for r in range(pp)])


def run_pipeline(schedule: str, fwd: np.ndarray, bwd: np.ndarray, v: int = 1,
                 units: Sequence[Sequence[int]] | None = None) -> PipelineRun:
    """Simulate one pipeline: ``fwd[vs, j]`` / ``bwd[vs, j]`` are the durations (s) of micro-batch ``j``
    on virtual stage ``vs`` (``pp * v`` virtual stages, chunk ``c`` of rank ``r`` at ``c * pp + r``).

    ``units``: micro-batches linked by cut documents (flexmesh.layout.pipeline_order.chain_plan). Where
    one holds more than one micro-batch the step runs the runtime's unit order instead of
    ``schedule`` (forwards in order, backwards reversed, a backward waiting for the next slice's).

    >>> float(run_pipeline("1f1b", np.ones((2, 3)), 2 * np.ones((2, 3))).end.max())  # (m + pp - 1) * 3
    12.0
    """
    fwd = np.asarray(fwd, dtype=float)
    bwd = np.asarray(bwd, dtype=float)
    if fwd.ndim != 2 or fwd.shape != bwd.shape or fwd.shape[0] % v:
        raise PlanError(f"pass durations must be two equal (pp * v, m) arrays, got {fwd.shape} and {bwd.shape}")
    n_vs, m = fwd.shape
    pp = n_vs // v
    dur = np.stack([fwd, bwd])
    later = {a: b for u in units or () for a, b in zip(u, u[1:])}
    if later:
        assert units is not None
        sliced = pipeline_order(units, n_vs, pp, duration=lambda a: float(dur[int(a.kind == "B"), a.stage, a.mb]))
        orders = tuple(tuple(Pass(a.kind == "B", a.stage // pp, a.mb) for a in acts) for acts in sliced)
    else:
        orders = tuple(_rank_order(schedule, pp, r, m, v) for r in range(pp))
    # The walk reads and writes single entries: Python lists of floats (NaN: not yet run) rather than
    # numpy arrays, whose per-element access costs several times more; the same float64 sums and maxima.
    # Each pass is looked up once: where it writes (its pass, virtual stage and micro-batch) and the
    # entry it waits for (None: the first forward, ready at 0), plus a cut document's next slice.
    nan = float("nan")
    durs = dur.tolist()
    starts = [[[nan] * m for _ in range(n_vs)] for _ in range(2)]
    ends = [[[nan] * m for _ in range(n_vs)] for _ in range(2)]
    fwd_end, bwd_end = ends
    steps = []
    for r, order in enumerate(orders):
        row = []
        for p in order:
            vs = p.chunk * pp + r
            if not p.backward:
                needs = None if vs == 0 else fwd_end[vs - 1]
            else:
                needs = fwd_end[vs] if vs == n_vs - 1 else bwd_end[vs + 1]
            nxt = later.get(p.mb) if p.backward else None
            b = int(p.backward)
            row.append((needs, p.mb, nxt, bwd_end[vs], starts[b][vs], ends[b][vs], durs[b][vs][p.mb]))
        steps.append(row)
    pos = [0] * pp
    free = [0.0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            row, k, t = steps[r], pos[r], free[r]
            while k < len(row):
                needs, mb, nxt, own_bwd, start_at, end_at, d = row[k]
                ready = 0.0 if needs is None else needs[mb]
                if nxt is not None:  # the next slice's backward hands this one its keys' gradient
                    after = own_bwd[nxt]
                    # as np.fmax: NaN while the next slice's has not run, else the larger of the two that ran
                    ready = nan if after != after else (after if ready != ready else max(ready, after))
                if ready != ready:  # NaN: its input is not ready yet
                    break
                s = max(t, ready)
                start_at[mb] = s
                end_at[mb] = t = s + d
                k += 1
            if k > pos[r]:
                remaining -= k - pos[r]
                pos[r], free[r] = k, t
                progressed = True
        if not progressed:
            raise PlanError(
                f"the {schedule} schedule deadlocks with {m} micro-batches on {pp} stages x {v} chunks; "
                f"use a number of micro-batches that is a multiple of pp, or the 1f1b schedule"
            )
    start = np.array(starts, dtype=float).reshape(dur.shape)
    end = np.array(ends, dtype=float).reshape(dur.shape)
    return PipelineRun(start=start, end=end, orders=orders)
