"""The recomputation choice per (micro-batch, stage) under each stage's memory (flexmesh.schedule.recompute).

On small random instances from real pipeline orders the MILP's added time equals brute force's
optimum; the greedy answer always fits; a stage that cannot fit is refused with its bytes.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexmesh.errors import ScheduleError
from flexmesh.layout.pipeline_order import pipeline_order, units_from_ends
from flexmesh.schedule.recompute import choose_recompute, greedy_recompute, in_flight_sets


def _fits(r, act, ckpt, L, budget, sets) -> bool:
    return all(sum((L[s] - r[j, s]) * act[j, s] + r[j, s] * ckpt[j, s] for j in S) <= budget[s] + 1e-9
               for s, stage in enumerate(sets) for S in stage)


@st.composite
def instances(draw):
    m = draw(st.integers(1, 4))
    pp = draw(st.integers(1, 2))
    ends = [draw(st.booleans()) for _ in range(m - 1)] + [True]
    units = units_from_ends(ends)
    sets = in_flight_sets(pipeline_order(units, pp, pp), pp)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    act = rng.uniform(5, 20, (m, pp))
    ckpt = act * rng.uniform(0.05, 0.3, (m, pp))
    fwd = rng.uniform(0.5, 2.0, (m, pp))
    L = [int(x) for x in rng.integers(1, 4, pp)]
    least = [max(sum(L[s] * ckpt[j, s] for j in S) for S in sets[s]) for s in range(pp)]
    most = [max(sum(L[s] * act[j, s] for j in S) for S in sets[s]) for s in range(pp)]
    budget = [lo + draw(st.floats(0, 1)) * (hi - lo) for lo, hi in zip(least, most)]
    return act, ckpt, fwd, L, budget, sets


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_the_milp_is_optimal_and_the_greedy_fits(case):
    act, ckpt, fwd, L, budget, sets = case
    m, pp = act.shape
    choice = choose_recompute(act, ckpt, fwd, L, budget, sets, time_limit=5.0)
    assert choice.solver == "milp"
    assert _fits(choice.layers, act, ckpt, L, budget, sets)
    best = min(float((np.array(r).reshape(m, pp) * fwd).sum())
               for r in itertools.product(*[range(L[s] + 1) for _ in range(m) for s in range(pp)])
               if _fits(np.array(r).reshape(m, pp), act, ckpt, L, budget, sets))
    assert choice.added_s == pytest.approx(best, rel=1e-6, abs=1e-9)
    rows = [(s, sorted(S)) for s in range(pp) for S in set(sets[s])]
    greedy = greedy_recompute(act, ckpt, fwd, np.asarray(L, dtype=float), budget, rows)
    assert _fits(greedy, act, ckpt, L, budget, sets)
    assert float((greedy * fwd).sum()) >= best - 1e-9


def test_a_stage_that_cannot_fit_is_refused_with_its_bytes():
    sets = [[frozenset({0, 1})]]
    with pytest.raises(ScheduleError, match=r"stage 0 holds micro-batches \[0, 1\] at once: 2.00 GiB .* over its 1.00"):
        choose_recompute(np.full((2, 1), 2.0 * 2**30), np.full((2, 1), 2**30 / 2), np.ones((2, 1)), [2], [2**30], sets)


def test_nothing_is_recomputed_when_everything_fits():
    sets = [[frozenset({0}), frozenset({0, 1})]]
    c = choose_recompute(np.ones((2, 1)), np.zeros((2, 1)), np.ones((2, 1)), [3], [100.0], sets)
    assert c.layers.sum() == 0 and c.added_s == 0.0
