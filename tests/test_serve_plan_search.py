"""The planner's search around the MILP: which knob variants it shows the MILP, how the simulator scores its
candidates (every routing policy), and the MILP solver kept quiet."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

from flexmesh.data.requests import at_rate, load_trace, window
from flexmesh.serve.layout.plan import ServingPlan
from flexmesh.serve.layout.roles import Role
from flexmesh.serve.layout.routing import RoutingPolicy
from flexmesh.serve.layout.slo import SLO
from flexmesh.serve.plan import milp
from flexmesh.serve.plan.baselines import melange, single_type
from flexmesh.serve.plan.capacity import CAPACITY_TOL
from flexmesh.serve.plan.planner import PlanCandidate, PlanInputs, Planner
from flexmesh.serve.plan.score import Score
from flexmesh.serve.plan.search import _better, best_of, candidates, plan
from flexmesh.serve.plan.workload import buckets_from_trace, parse_buckets
from flexmesh.spec.prices import gpu_prices

PRICES = {k: v.usd_per_hour for k, v in gpu_prices().items()}


def test_decode_variants_the_capacities_cannot_tell_apart_keep_the_larger_max_seqs():
    """Decode replicas of one shape differing in max_seqs: where their capacities are within CAPACITY_TOL of each
    other the smaller max_seqs is dominated and the larger shown to the MILP; where the larger serves clearly
    less, both are kept."""
    buckets = parse_buckets("300:150=0.6,3000:200=0.4")
    planner = Planner(PlanInputs(("llama3.1-8b",), "2xH100+4xL4", buckets, SLO(ttft_s=1.0, tpot_s=0.1), PRICES,
                                 budget=20.0))
    by_shape: dict[tuple, list[int]] = {}
    for k, c in enumerate(planner.configs):
        if c.role == "decode":
            by_shape.setdefault(c.shape, []).append(k)
    close = kept = 0
    for ks in by_shape.values():
        ks = sorted(ks, key=lambda k: planner.configs[k].knobs.max_seqs)
        for small, large in zip(ks, ks[1:]):
            cs, cl = planner.capacity[small], planner.capacity[large]
            if (cl >= cs * (1 - CAPACITY_TOL)).all():
                assert small in planner.dominated, (planner.configs[small], cs, cl)
                if (cl < cs).any():  # the smaller a hair ahead somewhere: no longer kept for that
                    close += 1
                    assert large not in planner.dominated, (planner.configs[large], cs, cl)
            else:
                kept += 1
                assert small not in planner.dominated, (planner.configs[small], cs, cl)
    assert close > 0 and kept > 0


@pytest.mark.slow
def test_every_candidate_is_scored_with_both_routing_policies_and_the_best_is_taken():
    base = window(load_trace("azure-conv"), first=300)
    buckets = buckets_from_trace(base)
    inputs = PlanInputs(("llama3.1-8b",), "2xH100+4xL4", buckets, SLO(ttft_s=0.5, tpot_s=0.1), PRICES, budget=20.0)
    res = plan(inputs, lambda r: at_rate(base, r), repair=0)
    by_plan: dict[tuple, set[str]] = {}
    for c in res.candidates:
        assert c.score is not None
        by_plan.setdefault(c.plan.groups, set()).add(c.plan.routing)
        if c.name.endswith(" routing"):  # the worse of the two policies, named for its policy
            twin = next(d for d in res.candidates if d.plan.groups == c.plan.groups and d is not c)
            assert twin.score is not None and not _better(c.score, twin.score, None)
    assert all(policies == set(RoutingPolicy) for policies in by_plan.values())
    assert res.score is not None
    assert not any(_better(c.score, res.score, None) for c in res.candidates if c.score is not None)


def test_the_melange_and_single_type_baselines_plan_as_priced_and_as_calibrated():
    """A calibration that misleads the MILP (the H100s made to look 20x slower than priced) does not cost the
    Mélange-style baseline the plan its profiles would give: it solves the MILP on both capacities, simulates
    each plan and keeps the better. A device type's own plan, unchanged by a calibration that scales the whole
    type, is simulated once."""
    base = window(load_trace("azure-conv"), first=200)
    inputs = PlanInputs(("llama3.1-8b",), "2xH100+4xL4", buckets_from_trace(base), SLO(ttft_s=1.0, tpot_s=0.1),
                        PRICES, budget=20.0)
    planner = Planner(inputs)
    misled = planner.calibrated({0: 0.05})
    assert misled.uncalibrated().capacity is planner.capacity and planner.uncalibrated().capacity is planner.capacity
    aggregated = {"aggregated": (Role.AGGREGATED,)}
    priced, calibrated = (candidates(p, aggregated)[0].plan.layout for p in (planner, misled))
    assert priced != calibrated

    def workload_at(r: float):  # noqa: ANN202
        return at_rate(base, r)

    b = melange(misled, workload_at)
    assert b.best is not None and b.best.score is not None
    assert {c.plan.layout for c in b.tried} == {priced, calibrated}
    assert not any(_better(c.score, b.best.score, None) for c in b.tried if c.score is not None)
    assert melange(planner, workload_at).tried[0].plan.layout == priced
    one = single_type(misled, workload_at)
    assert len(one.tried) == len(RoutingPolicy) * len(planner.cluster.groups)


def _scored(name: str, goodput: float, usd: float) -> PlanCandidate:
    return PlanCandidate(name, ServingPlan.__new__(ServingPlan), None, Score(goodput, True, usd, (), 0.0))


def test_a_budget_per_dollar_keeps_the_candidate_whose_goodput_costs_least():
    """With a budget, whole replicas leave some plans dollars unspent: a device type's own plan (10.61 req/s at
    $55.04/h) beside a mix that fills the budget with slower devices (11.06 at $59.02; the 8B Mooncake case). The
    most goodput takes the mix; per $/h the single type, and never a plan below another candidate per $/h."""
    one, mix = _scored("H100 only", 10.61, 55.04), _scored("mix", 11.06, 59.02)
    assert best_of([mix, one], None) is mix
    assert best_of([mix, one], None, per_dollar=True) is one
    assert best_of([one, mix], None, per_dollar=True) is one
    # equal goodput per $/h: the more goodput
    double = _scored("twice", 2 * 10.61, 2 * 55.04)
    assert best_of([one, double], None, per_dollar=True) is double
    # a target rate ignores per_dollar: meeting it, then the cheapest
    assert best_of([mix, one], 10.0, per_dollar=True) is one and best_of([mix, one], 11.0, per_dollar=True) is mix
    rng = np.random.default_rng(0)
    for _ in range(50):
        pool = [_scored(str(k), float(g), float(u)) for k, (g, u) in enumerate(rng.uniform(1, 10, (6, 2)))]
        best = best_of(pool, None, per_dollar=True)
        assert all(best.score.per_dollar >= c.score.per_dollar for c in pool)
        assert not any(_better(c.score, best.score, None, True) for c in pool)


def test_without_the_simulator_per_dollar_keeps_the_milps_cheapest_goodput():
    """The MILP's candidates alone (no simulator): the most predicted goodput, or per $/h the candidate whose
    predicted goodput costs least (8B on Mooncake's first 2000 requests, $100/h on six device types). Here the
    mixed plan predicts both; a per-$/h choice that differs from the most goodput is checked on scored candidates
    in test_a_budget_per_dollar_keeps_the_candidate_whose_goodput_costs_least."""
    base = window(load_trace("mooncake"), first=2000)
    inputs = PlanInputs(("llama3.1-8b",), "2x8xH100+3x8xA100-80GB+3x8xA100-40GB+4x8xL40S+8x8xA10G+10x8xL4",
                        buckets_from_trace(base), SLO(ttft_s=15.0, tpot_s=0.15), PRICES, budget=100.0)
    res = plan(inputs)
    rate = {c.plan.layout: c.solution.rate for c in res.candidates}
    per = {c.plan.layout: c.solution.rate / c.solution.cost for c in res.candidates}
    assert len(rate) > 1 and res.plan.layout == max(rate, key=rate.get)
    cheap = plan(replace(inputs, per_dollar=True), planner=res.planner)
    assert cheap.plan.layout == max(per, key=per.get)


def test_the_milp_solver_prints_nothing(monkeypatch, capfd):
    """HiGHS prints some debug lines from C, past SciPy's disp option: whatever the solver writes to the process's
    standard output while it runs goes nowhere, and what the process prints before and after is kept."""
    real = milp.milp

    def chatty(*args, **kwargs):
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
        return real(*args, **kwargs)

    monkeypatch.setattr(milp, "milp", chatty)
    cols = milp.Columns(model=[0, 0], group=[0, 1], devices=[1, 1], role=["aggregated"] * 2)
    problem = milp.Problem(cols, np.array([[5.0, 1.0], [20.0, 2.0]]), demand=np.array([[0.5, 0.5]]),
                           available=[10, 10], price=[1.01, 3.67], rate=4.0)
    print("before")
    s = milp.solve(problem)
    print("after")
    assert s.counts.sum() > 0
    assert capfd.readouterr().out == "before\nafter\n"
