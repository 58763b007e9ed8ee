"""The lower level of the mixed-cluster search, solved exactly: the layer partition of one pipeline
and the batch split across pipelines.

Layer partition (:func:`partition`): a pipeline's stages run on TP groups of possibly different
device types and speeds. Stage ``j`` holding ``n`` layers under recomputation mode ``r`` takes
``n * tau[j, r] + e[j, r]`` seconds per micro-batch and ``n * beta[j, r] + gamma[j, r]`` bytes (each
from the stage's own CostModel: :meth:`CostModel.layer` and :meth:`CostModel.ends`, speed-scaled;
the same figures :func:`flexmesh.cost.training.mixed.evaluate_group` sums, since a stage's cost is
its layers' costs added). Both are increasing in ``n``, so for a bound ``T`` each stage holds at
most ``c_j(T) = max_r min(floor((T - e)/tau), floor((budget - gamma)/beta))`` layers, and a partition
with max stage time <= T exists iff every ``c_j(T) >= 1`` and ``sum_j c_j(T) >= L``. The smallest
such ``T`` among the finitely many values ``n * tau + e`` is found by bisection: the exact min-max.

Batch split (:func:`split_batch`): replicas of one class (same stages, devices of the same speeds)
are identical; a class of ``N`` replicas sharing ``M`` micro-batches of ``mu`` sequences is best
split as evenly as possible, so its slowest replica runs ``u = ceil(M / N)`` micro-batches and takes
``a + c * u`` seconds (1F1B/GPipe: the sum of stage times less the largest, plus ``u`` times the
largest, :func:`flexmesh.cost.pipeline_time`). The integer program

    minimise t  s.t.  sum_k M_k = B / mu,  N_k <= M_k <= N_k * u_k,  t >= a_k + c_k * u_k,  M_k, u_k integer

is solved with SciPy's HiGHS MILP (``scipy.optimize.milp``); it is exact for this model
(tests/test_mixed_plan.py checks it against brute force).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from flexmesh.layout.strategy import LayerStrategy, Recompute

# Relative slack when comparing a stage time with a bound made of the same products (float rounding).
_EPS = 1e-9


@dataclass(frozen=True)
class StageLine:
    """A stage's time and memory as lines in its layer count, one entry per recomputation mode."""

    modes: tuple[Recompute, ...]
    tau: tuple[float, ...]  # seconds per layer per micro-batch
    e: tuple[float, ...]  # fixed seconds (embedding, head, pipeline sends)
    beta: tuple[float, ...]  # bytes per layer (states + activations in flight)
    gamma: tuple[float, ...]  # fixed bytes (ends' states and activations, transient, logits)
    budget: float

    def capacity(self, bound: float) -> int:
        """Most layers this stage holds within ``bound`` seconds and its memory."""
        best = 0
        for t, e, b, g in zip(self.tau, self.e, self.beta, self.gamma):
            by_mem = math.floor((self.budget - g) / b) if self.budget >= g else 0
            if bound != np.inf:
                by_mem = min(by_mem, math.floor((bound - e) / t * (1 + _EPS) + _EPS) if bound >= e else 0)
            best = max(best, by_mem)
        return best

    def fastest(self, n: int) -> tuple[int, float] | None:
        """(mode index, seconds) of the fastest mode holding ``n`` layers in memory, or None."""
        fits = [(n * t + e, i) for i, (t, e, b, g) in enumerate(zip(self.tau, self.e, self.beta, self.gamma))
                if n * b + g <= self.budget]
        if not fits:
            return None
        t, i = min(fits)
        return i, t


@dataclass(frozen=True)
class Partition:
    sizes: tuple[int, ...]
    recompute: tuple[Recompute, ...]
    times: tuple[float, ...]  # per stage, one micro-batch

    @property
    def max_time(self) -> float:
        return max(self.times)


def partition(stages: Sequence[StageLine], layers: int) -> Partition | None:
    """The layer split minimising the slowest stage's time within every stage's memory (None: no fit).

    >>> fast = StageLine((Recompute.NONE,), (1.0,), (0.0,), (1.0,), (0.0,), budget=100.0)
    >>> slow = StageLine((Recompute.NONE,), (2.0,), (0.0,), (1.0,), (0.0,), budget=100.0)
    >>> partition([fast, slow], 9).sizes  # 6 layers at 1 s and 3 at 2 s: both 6 s
    (6, 3)
    >>> small = StageLine((Recompute.NONE,), (1.0,), (0.0,), (1.0,), (0.0,), budget=2.0)
    >>> partition([fast, small], 9).sizes, partition([small, small], 9)  # memory caps the second stage
    ((7, 2), None)
    """
    pp = len(stages)
    if pp > layers or any(s.capacity(np.inf) < 1 for s in stages) or sum(
            min(s.capacity(np.inf), layers) for s in stages) < layers:
        return None
    values = np.unique(np.concatenate([np.arange(1, layers + 1) * t + e for s in stages
                                       for t, e in zip(s.tau, s.e)]))
    lo, hi = 0, len(values) - 1
    while lo < hi:  # the smallest candidate bound at which the capacities cover the layers
        mid = (lo + hi) // 2
        caps = [s.capacity(values[mid]) for s in stages]
        if min(caps) >= 1 and sum(caps) >= layers:
            hi = mid
        else:
            lo = mid + 1
    caps = [min(s.capacity(values[lo]), layers) for s in stages]
    sizes = list(caps)
    # Drop surplus layers from the stages slowest per layer (the fill and drain add every stage's time).
    order = sorted(range(pp), key=lambda j: -min(stages[j].tau))
    surplus = sum(sizes) - layers
    for j in order:
        take = min(surplus, sizes[j] - 1)
        sizes[j] -= take
        surplus -= take
    chosen = [stages[j].fastest(n) for j, n in enumerate(sizes)]
    if any(c is None for c in chosen):  # cannot happen: capacity counted only fitting modes
        return None
    modes = tuple(stages[j].modes[c[0]] for j, c in enumerate(chosen) if c is not None)
    times = tuple(c[1] for c in chosen if c is not None)
    return Partition(tuple(sizes), modes, times)


@dataclass(frozen=True)
class ReplicaClass:
    """``count`` identical replicas whose step with ``u`` micro-batches takes ``a + c * u`` seconds."""

    count: int
    a: float
    c: float


def split_batch(classes: Sequence[ReplicaClass], microbatches: int) -> tuple[float, list[list[int]]] | None:
    """(slowest replica's pipeline seconds, micro-batches of each replica per class) minimising the
    slowest replica with every replica running at least one; None when there are fewer micro-batches
    than replicas. Exact (HiGHS MILP, see the module docstring).

    >>> t, m = split_batch([ReplicaClass(1, 0.0, 1.0), ReplicaClass(2, 0.0, 3.0)], 10)
    >>> t, m  # the fast replica runs 6 micro-batches (6 s), each slow one 2 (6 s)
    (6.0, [[6], [2, 2]])
    """
    n = len(classes)
    if sum(k.count for k in classes) > microbatches:
        return None
    # Variables: M_0..M_{n-1}, u_0..u_{n-1}, t.
    c = np.zeros(2 * n + 1)
    c[-1] = 1.0
    rows: list[np.ndarray] = []
    lo: list[float] = []
    hi: list[float] = []
    total = np.zeros(2 * n + 1)
    total[:n] = 1.0
    rows.append(total)
    lo.append(microbatches)
    hi.append(microbatches)
    for k, cl in enumerate(classes):
        spread = np.zeros(2 * n + 1)  # M_k - N_k u_k <= 0
        spread[k], spread[n + k] = 1.0, -cl.count
        rows.append(spread)
        lo.append(-np.inf)
        hi.append(0.0)
        bound = np.zeros(2 * n + 1)  # t - c_k u_k >= a_k
        bound[-1], bound[n + k] = 1.0, -cl.c
        rows.append(bound)
        lo.append(cl.a)
        hi.append(np.inf)
    lower = np.array([k.count for k in classes] + [1] * n + [0.0], dtype=float)
    upper = np.array([microbatches] * (2 * n) + [np.inf], dtype=float)
    integrality = np.array([1] * (2 * n) + [0])
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
               bounds=Bounds(lower, upper), options={"presolve": True})
    if res.x is None:
        return None
    totals = [int(round(x)) for x in res.x[:n]]
    per_replica = []
    for cl, total_k in zip(classes, totals):
        q, r = divmod(total_k, cl.count)
        per_replica.append([q + 1] * r + [q] * (cl.count - r))
    slowest = max(cl.a + cl.c * max(ms) for cl, ms in zip(classes, per_replica))
    return float(slowest), per_replica


def relaxed_split(classes: Sequence[ReplicaClass], microbatches: int) -> float:
    """A lower bound on :func:`split_batch`'s time: micro-batch counts allowed fractional (>= 1 each).

    The class of ``N`` replicas holds ``N * max(1, (t - a) / c)`` micro-batches within ``t`` seconds,
    increasing in ``t``; the bound is the ``t`` at which the classes hold them all, and at least the time
    of one micro-batch on every replica, ``t0 = max(a + c)``. From ``t0`` on every class is past its
    ``max``, so the count held is linear in ``t`` and the crossing is solved directly.

    >>> round(relaxed_split([ReplicaClass(1, 0.0, 1.0), ReplicaClass(2, 0.0, 3.0)], 10), 6)
    6.0
    """
    if sum(k.count for k in classes) > microbatches:
        return float(np.inf)
    t0 = max(k.a + k.c for k in classes)
    rate = sum(k.count / k.c for k in classes)
    return max(t0, (microbatches + sum(k.count * k.a / k.c for k in classes)) / rate)


def strategy(tp: int, mode: Recompute) -> LayerStrategy:
    """A stage's layer strategy inside a replica: its TP degree, no data parallelism, no ZeRO."""
    return LayerStrategy(tp=tp, dp=1, zero=0, recompute=mode)
