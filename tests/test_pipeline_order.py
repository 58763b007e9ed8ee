"""The pipeline order of units of cut documents (flexmesh.layout.pipeline_order), and its checker.

Property-based: for random units, pipeline depths, chunks per rank and durations, the generated
per-rank lists never deadlock, run every forward and backward once, run each stage's forwards in
micro-batch order and each unit's backwards in reverse, and hold no more in flight than the rule
allows. Without cut documents the order is classic 1F1B, with its closed-form span. The checker
refuses orders that are wrong in each way it names. The simulator prices the same order.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexmesh.errors import ScheduleError
from flexmesh.layout.pipeline_order import Action, check_order, pipeline_order, timed_order, units_from_ends


@st.composite
def cases(draw):
    m = draw(st.integers(1, 12))
    ends = [draw(st.booleans()) for _ in range(m - 1)] + [True]
    pp = draw(st.integers(1, 4))
    v = draw(st.integers(1, 2))
    seed = draw(st.integers(0, 2**16))
    return units_from_ends(ends), pp, pp * v, seed


def durations(seed: int):
    rng = np.random.default_rng(seed)
    table: dict[Action, float] = {}

    def duration(a: Action) -> float:
        if a not in table:
            table[a] = float(rng.uniform(0.2, 3.0))
        return table[a]

    return duration


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_generated_orders_never_deadlock_and_keep_slice_order(case):
    units, pp, num_stages, seed = case
    order, timeline = timed_order(units, num_stages, pp, durations(seed))
    check = check_order(order, units, num_stages)  # raises on a repeat, a gap, a wrong rank, a deadlock
    for s in range(num_stages):
        acts = [a for rank in order for a in rank if a.stage == s]
        fwd = [a.mb for a in acts if a.kind == "F"]
        bwd = [a.mb for a in acts if a.kind == "B"]
        assert fwd == sorted(fwd)
        assert bwd == [i for u in units for i in reversed(u)]  # units in order, each unit's slices reversed
        # in flight: at most num_stages - s units (a unit acts as one micro-batch of 1F1B)
        assert check.peak_in_flight[s] <= (num_stages - s) * max(len(u) for u in units)
    # the timeline respects every dependency: a backward after its forward, the next stage's, the next slice's
    when = {a: (b, e) for rank in timeline.spans for a, b, e in rank}
    later = {a: b for u in units for a, b in zip(u, u[1:])}
    for a, (start, _) in when.items():
        if a.kind == "B":
            assert start >= when[Action("F", a.stage, a.mb)][1]
            if a.stage < num_stages - 1:
                assert start >= when[Action("B", a.stage + 1, a.mb)][1]
            if a.mb in later:
                assert start >= when[Action("B", a.stage, later[a.mb])][1]
        elif a.stage:
            assert start >= when[Action("F", a.stage - 1, a.mb)][1]


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 5), (4, 3), (4, 8), (3, 7)])
def test_without_cut_documents_the_order_is_1f1b(pp, m):
    from flexmesh.sim.pipeline import rank_order

    units = [[i] for i in range(m)]
    order, timeline = timed_order(units, pp, pp, lambda a: 1.0 if a.kind == "F" else 2.0)
    for r in range(pp):
        want = [("B" if p.backward else "F", p.mb) for p in rank_order("1f1b", pp, r, m)]
        assert [(a.kind, a.mb) for a in order[r]] == want
    assert timeline.makespan == pytest.approx((m + pp - 1) * 3.0)


def test_the_simulator_prices_the_same_order():
    """sim.pipeline.run_pipeline with units follows the generator's order: the same span."""
    from flexmesh.sim.pipeline import run_pipeline

    units, pp = [[0, 1, 2], [3], [4, 5]], 3
    rng = np.random.default_rng(0)
    fwd, bwd = rng.uniform(0.5, 2, (pp, 6)), rng.uniform(1, 4, (pp, 6))
    run = run_pipeline("1f1b", fwd, bwd, units=units)
    _, timeline = timed_order(units, pp, pp, lambda a: float((fwd if a.kind == "F" else bwd)[a.stage, a.mb]))
    assert float(np.nanmax(run.end)) == pytest.approx(timeline.makespan)
    assert float(np.nanmax(run_pipeline("1f1b", fwd, bwd).end)) < timeline.makespan  # linking slices costs


def _good() -> tuple[list[list[Action]], list[list[int]]]:
    units = [[0, 1], [2]]
    return pipeline_order(units, 2, 2), units


def test_check_order_refuses_backwards_of_slices_in_forward_order():
    order, units = _good()
    r0 = order[0]
    i, j = r0.index(Action("B", 0, 1)), r0.index(Action("B", 0, 0))
    r0[i], r0[j] = r0[j], r0[i]
    with pytest.raises(ScheduleError, match="deadlocks"):  # B0.0 waits for B0.1, which comes after it
        check_order(order, units, 2)


def test_check_order_refuses_a_missing_or_repeated_action():
    order, units = _good()
    order[1].remove(Action("B", 1, 2))
    with pytest.raises(ScheduleError, match=r"each forward and backward once; missing \[Action\(kind='B', stage=1"):
        check_order(order, units, 2)
    order, units = _good()
    order[0].append(Action("F", 0, 0))
    with pytest.raises(ScheduleError, match="1 repeated"):
        check_order(order, units, 2)


def test_check_order_refuses_a_forward_out_of_order_and_a_wrong_rank():
    order, units = _good()
    r0 = order[0]
    r0[0], r0[1] = r0[1], r0[0]
    with pytest.raises(ScheduleError, match="stage 0 runs forward 1 before forward 0"):
        check_order(order, units, 2)
    order, units = _good()
    order[0], order[1] = order[1], order[0]
    with pytest.raises(ScheduleError, match="is on pipeline rank 0, but stage 1 runs on rank 1"):
        check_order(order, units, 2)


def test_check_order_finds_a_deadlock_across_ranks():
    """Rank 0 waits for a backward before running the forward stage 1 needs."""
    units = [[0], [1]]
    order = [[Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
             [Action("F", 1, 0), Action("F", 1, 1), Action("B", 1, 0), Action("B", 1, 1)]]
    with pytest.raises(ScheduleError, match=r"deadlocks: each rank waits at \{0: 'B0.0', 1: 'F1.1'\}"):
        check_order(order, units, 2)


def test_units_must_split_the_micro_batches_in_order():
    with pytest.raises(ScheduleError, match="consecutive, non-empty runs"):
        pipeline_order([[0, 2], [1]], 2, 2)
    with pytest.raises(ScheduleError, match="3 stages cannot be spread evenly over 2 pipeline ranks"):
        pipeline_order([[0]], 3, 2)
