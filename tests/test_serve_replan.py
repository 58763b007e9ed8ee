"""The fast re-plan judged by the simulator: a bucket the replicas left miss conceded on replicas of its own, and a
judgement of bounded cost."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flexmesh.data.requests import at_rate, load_trace, window
from flexmesh.serve.layout.routing import RoutingPolicy
from flexmesh.serve.layout.slo import SLO
from flexmesh.serve.plan import replan
from flexmesh.serve.plan.planner import PlanInputs, Planner
from flexmesh.serve.plan.replan import fast_replan, held_devices
from flexmesh.serve.plan.score import score
from flexmesh.serve.plan.workload import buckets_from_trace
from flexmesh.spec.prices import gpu_prices

PRICES = {k: v.usd_per_hour for k, v in gpu_prices().items()}


@pytest.fixture(scope="module")
def a100s():
    """Llama-3-8B on A100-40GBs for the Azure conversation trace (its first 2000 requests, a chatbot SLO: a TTFT of
    0.22 s, the tightest of DistServe's kind that still makes the planner give the longest prompts a tp4 replica):
    fifteen tp1 replicas of 2048 batched tokens for the short prompts, one tp2 and one tp4 of 8192 for the long
    ones (the planner's plan for this trace), routed by the MILP."""
    base = window(load_trace("azure-conv"), first=2000)
    inputs = PlanInputs(("llama3.1-8b",), "3x8xA100-40GB", buckets_from_trace(base), SLO(ttft_s=0.22, tpot_s=0.1),
                        PRICES, budget=60.0)
    planner = Planner(inputs)
    k = {(c.tp, c.knobs.max_batched_tokens): i for i, c in enumerate(planner.configs) if c.role == "aggregated"}
    built = planner.plan_counts({k[1, 2048]: 15, k[2, 8192]: 1, k[4, 8192]: 1})
    assert built is not None
    return planner, built[0], lambda r: at_rate(base, r)


@pytest.mark.slow
def test_fast_replan_concedes_the_long_bucket_the_survivors_miss_and_keeps_90pc_of_a_fresh_plan(a100s):
    """The tp4 replica (most of the long prompts') lost: the tp1 and tp2 replicas left serve the longest prompts
    within the TTFT bound in the MILP's capacities but miss most of them in the simulator, and the candidates that
    serve that bucket in full or in part hold the short requests' replicas to it (about half a fresh plan's goodput).
    Conceded on replicas that take nothing else, the rest of the fleet meets the SLO: >= 90% of the goodput of a
    fresh plan on the devices left (which may move weights: tp1 replicas merged into a tp4)."""
    planner, before, workload_at = a100s
    lost = [i for i, g in enumerate(before.groups) if g.tp == 4]
    fast = fast_replan(planner, before, lost, workload_at=workload_at)
    assert "conceded" in fast.candidate, fast.candidate
    long = len(planner.inputs.buckets) - 1  # the longest prompts
    takers = [g for g in fast.plan.groups if g.entry[long] > 0]
    assert takers and all(sum(g.entry) == g.entry[long] for g in takers)
    assert all(g.entry[long] == 0 for g in fast.plan.groups if g not in takers)
    assert all(g.shape != before.groups[lost[0]].shape for g in fast.plan.groups)  # only what survives
    got = score(fast.plan, workload_at, fast.plan.predicted["rate"], planner.overhead).goodput
    held = held_devices(before, lost)
    budget = sum(n * PRICES[g.device.name] for n, g in zip(held, planner.cluster.groups))
    cols = planner.columns()
    fresh = planner.to_plan(cols, planner.solve(cols, budget=budget + 1e-6, available=held))
    best = max(score(replace(fresh, routing=p), workload_at, fresh.predicted["rate"], planner.overhead).goodput
               for p in RoutingPolicy)
    assert got >= 0.9 * best, (fast.plan.layout, got, fresh.layout, best)


def test_fast_replan_judges_with_at_most_its_simulations_and_takes_the_nearest_when_none_meets(a100s, monkeypatch):
    """Whatever the candidates, the judgement runs at most JUDGE_SIMULATIONS simulations (each ~0.1 s: the fast path
    stays within a second); where none of them meets the target, the candidate nearest it is taken, not the MILP's
    pick."""
    planner, before, workload_at = a100s
    runs: list[tuple[str, str, float]] = []
    marks = iter([0.5, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1] + [0.0] * 50)

    def simulated(plan, workload, rate, overhead=None):  # noqa: ANN001, ANN202
        runs.append((plan.layout, plan.routing, rate))
        return next(marks), None

    monkeypatch.setattr(replan, "attainment_at", simulated)
    lost = [i for i, g in enumerate(before.groups) if g.tp == 2]
    fast = fast_replan(planner, before, lost, workload_at=workload_at)
    assert 1 < len(runs) <= replan.JUDGE_SIMULATIONS
    assert (fast.plan.layout, fast.plan.routing) == runs[1][:2]  # the nearest the target (0.8)
    runs.clear()
    marks = iter([0.0] * 50)
    fast_replan(planner, before, lost, rate=60.0, workload_at=workload_at)
    assert 1 < len(runs) <= replan.JUDGE_SIMULATIONS and {r for _, _, r in runs} == {60.0}
