"""How many layers each micro-batch recomputes on each pipeline stage, under the stage's memory.

A pipelined step with cut documents holds a unit's micro-batches in flight until their backwards
(flexmesh.layout.pipeline_order); what a stage holds at once is known from its order. Recomputing
``r`` of a stage's ``L`` layers for micro-batch ``j`` (activation checkpointing per layer) keeps
``(L - r) * act[j] + r * ckpt[j]`` bytes instead of ``L * act[j]`` and costs ``r * fwd[j]`` seconds
more in backward. The choice (InfiniPipe's chunk-level recomputation, 2509.21275):

    minimise    sum_j,s  r[j, s] * fwd[j, s]
    subject to  sum_{j in S} (L_s - r[j, s]) * act[j, s] + r[j, s] * ckpt[j, s] <= budget[s]
                    for every set S of micro-batches in flight together on stage s,
                0 <= r[j, s] <= L_s, integer,

solved by SciPy's HiGHS MILP under a time limit; where it finds nothing in time, a greedy pass (the
micro-batch whose next recomputed layer frees the most bytes per second, until every set fits)
answers, and the result says which ran. A stage that cannot fit even with every layer recomputed
is refused with the bytes it lacks.

>>> sets = in_flight_sets([[Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1), Action("B", 0, 0)]], 1)
>>> sets
[[frozenset({0}), frozenset({0, 1})]]
>>> c = choose_recompute(act=np.array([[10.0], [10.0]]), ckpt=np.array([[1.0], [1.0]]),
...                      fwd=np.array([[1.0], [3.0]]), layers=[4], budget=[62.0], sets=sets)
>>> c.layers.ravel().tolist(), c.added_s, c.solver
([2, 0], 2.0, 'milp')
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flexmesh.errors import ScheduleError
from flexmesh.layout.pipeline_order import Action


def in_flight_sets(order: Sequence[Sequence[Action]], num_stages: int) -> list[list[frozenset[int]]]:
    """Per stage, the micro-batches in flight together right after each of its forwards (the sets
    whose activations the stage holds at once: each is largest just after a forward)."""
    sets: list[list[frozenset[int]]] = [[] for _ in range(num_stages)]
    live: list[set[int]] = [set() for _ in range(num_stages)]
    for rank in order:
        for a in rank:
            if a.kind == "F":
                live[a.stage].add(a.mb)
                sets[a.stage].append(frozenset(live[a.stage]))
            else:
                live[a.stage].discard(a.mb)
    return sets


@dataclass(frozen=True)
class RecomputeChoice:
    layers: np.ndarray  # (micro-batches, stages): layers recomputed
    added_s: float  # recompute seconds added, summed over micro-batches and stages
    solver: str  # "milp", or "greedy" where the MILP found nothing in time
    seconds: float  # time spent choosing
    gap: float  # the MILP's relative gap to its bound (0: optimal); nan for greedy


def choose_recompute(act: np.ndarray, ckpt: np.ndarray, fwd: np.ndarray, layers: Sequence[int],
                     budget: Sequence[float], sets: Sequence[Sequence[frozenset[int]]],
                     time_limit: float = 0.1) -> RecomputeChoice:
    """The recomputation of least added time that fits every stage (module doc); ``act``, ``ckpt``
    (bytes per layer) and ``fwd`` (seconds per layer) have shape (micro-batches, stages)."""
    import scipy.optimize  # noqa: F401 - loaded before the clock starts: the first import takes ~0.2 s

    t0 = time.perf_counter()
    act, ckpt, fwd = (np.asarray(x, dtype=float) for x in (act, ckpt, fwd))
    m, n_st = act.shape
    L = np.asarray(layers, dtype=float)
    _check_fits(act, ckpt, L, budget, sets)
    rows = [(s, sorted(S)) for s in range(n_st) for S in set(sets[s])]
    milp = _milp(act, ckpt, fwd, L, budget, rows, time_limit)
    if milp is not None:
        r, gap = milp
        return RecomputeChoice(r, float((r * fwd).sum()), "milp", time.perf_counter() - t0, gap)
    r = greedy_recompute(act, ckpt, fwd, L, budget, rows)
    return RecomputeChoice(r, float((r * fwd).sum()), "greedy", time.perf_counter() - t0, float("nan"))


def _check_fits(act: np.ndarray, ckpt: np.ndarray, L: np.ndarray, budget: Sequence[float],
                sets: Sequence[Sequence[frozenset[int]]]) -> None:
    for s, stage_sets in enumerate(sets):
        for S in stage_sets:
            least = float(sum(L[s] * ckpt[j, s] for j in S))
            if least > budget[s]:
                raise ScheduleError(f"stage {s} holds micro-batches {sorted(S)} at once: {least / 2**30:.2f} GiB "
                                    f"of activations with every layer recomputed, over its {budget[s] / 2**30:.2f} "
                                    "GiB; cut documents into smaller slices or use more stages")


def _milp(act, ckpt, fwd, L, budget, rows, time_limit) -> tuple[np.ndarray, float] | None:  # noqa: ANN001
    from scipy.optimize import Bounds, LinearConstraint, milp

    m, n_st = act.shape
    if not rows:
        return np.zeros((m, n_st), dtype=int), 0.0
    # variable k = j * n_st + s; a set's bytes: sum L*act - r * (act - ckpt) <= budget
    a = np.zeros((len(rows), m * n_st))
    ub = np.zeros(len(rows))
    for q, (s, S) in enumerate(rows):
        for j in S:
            a[q, j * n_st + s] = -(act[j, s] - ckpt[j, s])
        ub[q] = budget[s] - sum(L[s] * act[j, s] for j in S)
    res = milp(c=fwd.ravel(), constraints=LinearConstraint(a, -np.inf, ub),
               integrality=np.ones(m * n_st), bounds=Bounds(0, np.tile(L, m)),
               options={"time_limit": time_limit, "mip_rel_gap": 1e-6})
    if res.x is None:
        return None
    r = np.rint(res.x).astype(int).reshape(m, n_st)
    gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
    return r, gap


def greedy_recompute(act: np.ndarray, ckpt: np.ndarray, fwd: np.ndarray, L: np.ndarray,
                     budget: Sequence[float], rows: Sequence[tuple[int, list[int]]]) -> np.ndarray:
    """Recompute one more layer of the micro-batch freeing the most bytes per second in the most
    overfull set, until every set fits (the answer when the MILP runs out of time)."""
    m, n_st = act.shape
    r = np.zeros((m, n_st), dtype=int)
    saving = act - ckpt
    while True:
        over: list[tuple[float, int, list[int]]] = [
            (float(sum((L[s] - r[j, s]) * act[j, s] + r[j, s] * ckpt[j, s] for j in S)) - budget[s], s, S)
            for s, S in rows]
        excess, s, S = max(over, default=(0.0, 0, []), key=lambda x: x[0])
        if excess <= 0:
            return r
        j = max((j for j in S if r[j, s] < L[s]), key=lambda j: saving[j, s] / max(fwd[j, s], 1e-12))
        r[j, s] += 1
