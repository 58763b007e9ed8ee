"""The deployment planner: Mélange's example as the MILP's special case, the MILP against brute force, the plan file,
re-planning, cascades, and the simulator's tiers and length router the plans run on."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace

import numpy as np
import pytest

from flexmesh.cli import main
from flexmesh.data.requests import Request, Workload, at_rate, constant_lengths, window, with_arrivals
from flexmesh.errors import FlexmeshError, PlanError, SpecError
from flexmesh.serve.layout.knobs import default_knobs
from flexmesh.serve.layout.plan import ServingPlan, load_plan, save_plan
from flexmesh.serve.layout.quality import escalate, parse_quality
from flexmesh.serve.layout.replicas import ReplicaSpec, place
from flexmesh.serve.layout.routing import RoutingTable
from flexmesh.serve.layout.slo import SLO
from flexmesh.serve.plan import milp, replan
from flexmesh.serve.plan.capacity import Pricing, configurations
from flexmesh.serve.plan.cascade import plan_cascade, single_models, stage_slos
from flexmesh.serve.plan.check import check_plan
from flexmesh.serve.plan.planner import PlanInputs, Planner
from flexmesh.serve.plan.replan import fast_replan, held_devices, transition
from flexmesh.serve.plan.score import attainment_at
from flexmesh.serve.plan.search import candidates
from flexmesh.serve.plan.workload import buckets_from_trace, parse_buckets
from flexmesh.serve.simulator import Fleet
from flexmesh.spec import parse_model
from flexmesh.spec.cluster import parse_mixed_cluster
from flexmesh.spec.prices import gpu_prices

PRICES = {k: v.usd_per_hour for k, v in gpu_prices().items()}
M8 = parse_model("llama3.1-8b")


# ---- Mélange's ILP ------------------------------------------------------------------------------------------
MELANGE_GPUS = Columns = milp.Columns(model=[0, 0], group=[0, 1], devices=[1, 1], role=["aggregated"] * 2)
MELANGE_TPUTS = np.array([[5, 1, 10, 5], [20, 2, 50, 20]], dtype=float)  # A10G, A100 (melange-release main.py)
MELANGE_COST = [1.01, 3.67]


def _melange_brute(demand: list[float], rate: float, slices: int) -> tuple[tuple[int, int], float]:
    """Mélange's formulation solved by hand: every slice of every bucket to one GPU type, GPUs = the ceiling of
    each type's load (rate / throughput summed), the cheapest assignment."""
    loads = [[rate * d / slices / MELANGE_TPUTS[g, b] for b, d in enumerate(demand)] for g in range(2)]
    best: tuple[tuple[int, int], float] | None = None
    per_bucket = list(itertools.product(range(slices + 1), repeat=len(demand)))  # slices of each bucket on GPU 0
    for on_first in per_bucket:
        load0 = sum(n * loads[0][b] for b, n in enumerate(on_first))
        load1 = sum((slices - n) * loads[1][b] for b, n in enumerate(on_first))
        counts = (math.ceil(load0 - 1e-9), math.ceil(load1 - 1e-9))
        cost = counts[0] * MELANGE_COST[0] + counts[1] * MELANGE_COST[1]
        if best is None or cost < best[1] - 1e-9:
            best = (counts, cost)
    assert best is not None
    return best


@pytest.mark.parametrize("demand, slices, published", [
    ([0.25, 0.125, 0.375, 0.25], 1, None),  # melange/main.py as released (slice factor 1)
    ([0.25, 0.125, 0.375, 0.25], 4, None),
    ([0.25, 0.5, 0.25, 0.25], 1, ((10, 0), 10.10)),  # the earlier main.py: its README's output, 10 A10G at $10.10/h
])
def test_melange_example_is_the_milps_special_case(demand, slices, published):
    p = milp.Problem(MELANGE_GPUS, MELANGE_TPUTS, np.array([demand]), available=[10**6] * 2, price=MELANGE_COST,
                     rate=16.0, slices=slices)
    s = milp.solve(p)
    counts, cost = _melange_brute(demand, 16.0, slices)
    assert tuple(s.counts.tolist()) == counts and s.cost == pytest.approx(cost)
    if published is not None:
        assert (tuple(s.counts.tolist()), round(s.cost, 2)) == published


# ---- the MILP against brute force ---------------------------------------------------------------------------
def _tiny(seed: int) -> milp.Problem:
    """Two device groups, an aggregated, a prefill and a decode configuration on each, two buckets."""
    rng = np.random.default_rng(seed)
    roles = ["aggregated", "prefill", "decode"] * 2
    cols = milp.Columns(model=[0] * 6, group=[0, 0, 0, 1, 1, 1], devices=[1, 1, 1, 2, 2, 2], role=roles,
                        shape=[(0, 0, 1, 1)] * 3 + [(0, 1, 2, 1)] * 3)
    cap = rng.uniform(0.5, 8.0, size=(6, 2))
    cap[rng.random(size=(6, 2)) < 0.2] = 0.0
    cap[0, 0] = max(cap[0, 0], 0.5)  # something serves each bucket
    cap[3, 1] = max(cap[3, 1], 0.5)
    return milp.Problem(cols, cap, np.array([[0.6, 0.4]]), available=[3, 4], price=[1.0, 2.5], budget=7.0)


def _brute_rate(p: milp.Problem) -> float:
    best = 0.0
    ranges = [range(p.available[g] // d + 1) for g, d in zip(p.columns.group, p.columns.devices)]
    for counts in itertools.product(*ranges):
        used = [0, 0]
        for c, n in enumerate(counts):
            used[p.columns.group[c]] += n * p.columns.devices[c]
        cost = sum(n * p.price[p.columns.group[c]] * p.columns.devices[c] for c, n in enumerate(counts))
        if any(u > a for u, a in zip(used, p.available)) or cost > p.budget + 1e-9 or not any(counts):
            continue
        try:
            best = max(best, milp.solve(replace(p, counts=counts)).rate)
        except PlanError:
            continue
    return best


@pytest.mark.parametrize("seed", range(4))
def test_milp_matches_brute_force_on_tiny_instances(seed):
    p = _tiny(seed)
    exact = _brute_rate(p)
    s = milp.solve(p)
    assert s.rate <= exact * (1 + 1e-6) and s.rate >= exact * (1 - milp.MIP_GAP) - 1e-9
    assert s.cost <= p.budget + 1e-9
    quick = milp.solve_fast(p)
    assert quick.rate >= exact * (1 - milp.MIP_GAP) - 1e-9 and quick.bound >= exact - 1e-6


def test_milp_routes_every_bucket_and_balances_prefill_and_decode():
    p = _tiny(1)
    s = milp.solve(p)
    assert np.allclose(s.entry.sum(axis=0), s.rate * p.demand[0])  # each bucket enters somewhere, all of it
    roles = np.array(p.columns.role)
    assert np.allclose(s.entry[roles == "prefill"].sum(axis=0), s.decode[roles == "decode"].sum(axis=0))
    assert (s.load(p.capacity) <= 1 + 1e-6).all()


def test_milp_partial_buckets_let_a_share_of_the_rate_miss_the_slo():
    """One configuration serves bucket 1 (5% of the requests) within the SLO only slowly (0.1 req/s; 2 req/s with
    no latency bound): every bucket in full, it holds the rate down; with misses of its share it enters missing the
    SLO and the rate rises as the capacities say; with half its share, half of it does; never more than allowed."""
    cols = milp.Columns(model=[0], group=[0], devices=[1], role=["aggregated"])
    demand = np.array([[0.95, 0.05]])
    unbounded = np.array([[20.0, 2.0]])
    base = milp.Problem(cols, np.array([[10.0, 0.1]]), demand, available=[4], price=[1.0], budget=4.0)
    full = milp.solve(base)
    assert full.missed is None and math.isclose(full.rate, 4 / (0.95 / 10 + 0.05 / 0.1), rel_tol=1e-3)
    for misses, busy in ((0.05, 0.95 / 10 + 0.05 / 2), (0.025, 0.95 / 10 + 0.025 / 0.1 + 0.025 / 2)):
        for solver in (milp.solve, milp.solve_fast):
            s = solver(replace(base, misses=misses, capacity_any=unbounded))
            assert math.isclose(s.rate, 4 / busy, rel_tol=1e-3)  # (the MILP keeps 1 - 1e-4 of the best rate)
            assert s.missed is not None and s.missed.sum() <= misses * s.rate * (1 + 1e-6)
            assert math.isclose(s.missed[0, 1], misses * s.rate, rel_tol=1e-6)  # the slow bucket's, not the other
            assert np.allclose(s.entry.sum(axis=0), s.rate * demand[0])  # missed or not, all of it enters
    with pytest.raises(PlanError, match="capacity without the SLO"):
        milp.solve(replace(base, misses=0.05))


def test_planner_is_within_two_percent_of_exhaustive_enumeration():
    """A small real case (two device types, vLLM's default knobs): every count of every configuration the devices
    allow, each routed at its best rate, against the planner's MILP."""
    buckets = parse_buckets("300:150=0.6,3000:200=0.4")
    inputs = PlanInputs(("llama3.1-8b",), "2xH100+2xL4", buckets, SLO(ttft_s=1.0, tpot_s=0.1), PRICES, budget=12.0,
                        knobs={0: default_knobs(parse_mixed_cluster("2xH100").groups[0].device),
                               1: default_knobs(parse_mixed_cluster("2xL4").groups[0].device)})
    planner = Planner(inputs)
    cols = planner.columns(everything=True)
    got = planner.solve(cols, budget=12.0).rate
    best = 0.0
    ranges = [range(planner.cluster.groups[planner.configs[k].group].world_size // planner.configs[k].devices + 1)
              for k in cols]
    for counts in itertools.product(*ranges):
        chosen = {k: n for k, n in zip(cols, counts) if n}
        if not chosen or not planner.fits(chosen):
            continue
        built = planner.plan_counts(chosen)
        if built is not None:
            best = max(best, built[1].rate)
    assert best > 0 and got >= 0.98 * best and got <= best * (1 + 1e-6)


# ---- buckets, capacities ------------------------------------------------------------------------------------
def test_buckets_cover_the_trace_and_classify_as_the_router_does():
    reqs = tuple(Request(i, i * 0.1, p, o) for i, (p, o) in enumerate([(100, 20), (300, 40), (3000, 90),
                                                                        (9000, 10)] * 50))
    w = Workload(reqs, "t")
    b = buckets_from_trace(w, min_share=0.1)
    assert math.isclose(sum(x.share for x in b.buckets), 1.0)
    table = RoutingTable(b.prompt_edges, b.output_edges, ((1.0,),) * len(b))
    for r in reqs:
        k = b.of(r.prompt_tokens, r.output_tokens)
        assert k == table.of(r.prompt_tokens, r.output_tokens)
        lo, hi = b.buckets[k].prompt
        assert lo <= r.prompt_tokens and (hi is None or r.prompt_tokens < hi)
        assert r.prompt_tokens + r.output_tokens <= b.buckets[k].longest
    with pytest.raises(SpecError, match="PROMPT:OUTPUT=SHARE"):
        parse_buckets("512=0.5")


def test_capacity_is_zero_where_the_kv_cache_cannot_hold_a_bucket_and_rises_with_the_slo():
    cluster = parse_mixed_cluster("8xL4")
    cfgs = configurations((M8,), cluster, 41_000, roles=("aggregated",))
    pricing = Pricing((M8,), cluster)
    long = parse_buckets("40000:1000=1").buckets[0]
    short = parse_buckets("500:200=1").buckets[0]
    tp1 = next(c for c in cfgs if c.tp == 1)
    assert tp1.kv_tokens < long.longest and pricing.capacity(tp1, long, SLO()).rate == 0.0
    tight, loose = (pricing.capacity(tp1, short, SLO(ttft_s=1.0, tpot_s=t)).rate for t in (0.07, 0.2))
    assert 0 < tight < loose


# ---- the plan file ------------------------------------------------------------------------------------------
def _small_plan() -> tuple[Planner, ServingPlan]:
    buckets = parse_buckets("300:150=0.6,3000:200=0.4")
    inputs = PlanInputs(("llama3.1-8b",), "2xH100+4xL4", buckets, SLO(ttft_s=1.0, tpot_s=0.07), PRICES, budget=20.0)
    planner = Planner(inputs)
    return planner, candidates(planner)[0].plan


def test_plan_file_round_trips_and_its_fleet_is_what_it_says(tmp_path):
    _, p = _small_plan()
    save_plan(p, tmp_path / "plan.json")
    again = load_plan(tmp_path / "plan.json")
    assert again.to_dict() == p.to_dict() and again.layout == p.layout
    assert check_plan(again) == [] or all("routed no requests" in n for n in check_plan(again))
    fleet, table = Fleet.from_plan(again)
    assert sum(r.spec.devices for r in fleet.replicas) == sum(g.devices for g in p.groups)
    for b in range(len(p.buckets)):  # each bucket's shares, spread over the replicas, sum to 1
        assert math.isclose(sum(table.entry[b]), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(version=7), "version 7"),
    (lambda d: d.update(routing="fastest"), "routing 'fastest'"),
    (lambda d: d["groups"][0].update(group=9), "device group 9"),
    (lambda d: d["groups"][0].update(tp=16), "tp 16"),
    (lambda d: d["groups"][0].update(entry=[0.3, 0.3]), "sum to"),
    (lambda d: d["groups"][0].update(colour="red"), "unknown field"),
    (lambda d: d["groups"][0]["engine"].update(max_seqs=0), "max_seqs"),
])
def test_plan_check_refuses_bad_files_in_one_line(tmp_path, capsys, edit, message):
    _, p = _small_plan()
    d = p.to_dict()
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    assert main(["serve", "plan", "--check", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


# ---- re-planning --------------------------------------------------------------------------------------------
def test_fast_replan_moves_no_weights_and_uses_only_what_survives():
    planner, p = _small_plan()
    lost = [0]
    fast = fast_replan(planner, p, lost)
    shapes = {}
    for i, g in enumerate(p.groups):
        if i not in lost:
            shapes[g.shape] = shapes.get(g.shape, 0) + g.replicas
    for g in fast.plan.groups:
        assert g.shape in shapes
    for shape, n in shapes.items():
        assert sum(g.replicas for g in fast.plan.groups if g.shape == shape) <= n
    assert fast.plan.dollars_per_hour <= p.dollars_per_hour + 1e-9
    assert held_devices(p, lost)[p.groups[0].group] == held_devices(p)[p.groups[0].group] - p.groups[0].devices
    one = fast_replan(planner, p, {0: 1})  # one replica of the first group lost
    assert sum(g.replicas for g in one.plan.groups if g.shape == p.groups[0].shape) <= \
        sum(g.replicas for g in p.groups if g.shape == p.groups[0].shape) - 1
    with pytest.raises(PlanError, match="lost group 9"):
        fast_replan(planner, p, {9: 1})


def test_fast_replan_changes_roles_only_for_more_than_the_milps_tolerance(monkeypatch):
    """Split replicas made to look better (their capacities scaled up): without the simulator (and every bucket in
    full) the roles change only where the MILP finds that more than milp.MIP_GAP better than the replicas left in
    their roles; and they change whatever the gain where the roles left cannot serve (every decode replica lost)."""
    monkeypatch.setattr(replan, "PARTIAL_MISSES", 0.0)
    planner, _ = _small_plan()
    agg = candidates(planner, {"aggregated": ("aggregated",)})[0].plan
    assert {g.role for g in agg.groups} == {"aggregated"}
    left = {g.shape: g.replicas - (i == 0) for i, g in enumerate(agg.groups) if g.replicas - (i == 0)}
    outcomes = []
    for split in (1.0, 1.25, 1.7, 3.0):
        p = planner.calibrated({}, split)
        free = p.solve(p.columns(everything=True, keep=lambda c: c.shape in left), limits=left)
        kept = p.solve(p.columns(("aggregated",), everything=True, keep=lambda c: c.shape in left),
                       limits={(shape, "aggregated"): n for shape, n in left.items()}, by_role=True)
        fast = fast_replan(p, agg, {0: 1})
        moved = any(g.role != "aggregated" for g in fast.plan.groups)
        assert moved == (free.rate > kept.rate * (1 + milp.MIP_GAP))
        got = fast.plan.predicted["rate"]
        assert math.isclose(got, free.rate, rel_tol=1e-6) if moved else got >= kept.rate * (1 - 1e-6)
        outcomes.append((moved, free.rate > kept.rate * (1 + 1e-6)))
    assert (False, True) in outcomes and (True, True) in outcomes  # a split preferred within the tolerance, and beyond
    split = candidates(planner, {"disaggregated": ("prefill", "decode")})[0].plan
    decodes = [i for i, g in enumerate(split.groups) if g.role == "decode"]
    after = fast_replan(planner, split, decodes)
    roles = {g.role for g in after.plan.groups}
    assert after.plan.predicted["rate"] > 0 and ("prefill" in roles) == ("decode" in roles)


def test_fast_replan_takes_partial_buckets_where_the_survivors_serve_one_only_slowly(monkeypatch):
    """The H100s (long prompts' replicas) lost: the L4s left serve long prompts within the SLO only slowly, so every
    bucket in full holds the rate down to them; partial buckets (at most PARTIAL_MISSES of the attainment slack
    missing the SLO) serve more by more than the MILP's tolerance, and the fast path takes them by the MILP's rule.
    Judged by the simulator, the candidate taken meets the attainment target at a rate of its ladder."""
    buckets = parse_buckets("300:100=0.94,3000:100=0.06")
    inputs = PlanInputs(("llama3.1-8b",), "2xH100+8xL4", buckets, SLO(ttft_s=0.8, tpot_s=0.1), PRICES, budget=30.0)
    planner = Planner(inputs)
    before = candidates(planner, {"aggregated": ("aggregated",)})[0].plan
    long_on = [i for i, g in enumerate(before.groups) if g.device == "H100-80GB"]
    assert long_on and len(long_on) < len(before.groups), before.layout
    fast = fast_replan(planner, before, long_on)
    assert "partial" in fast.candidate, (before.layout, fast.candidate)
    # exact: the same planner on the same inputs
    assert fast_replan(planner, before, long_on).plan == fast.plan  # nothing depends on a clock
    with monkeypatch.context() as m:
        m.setattr(replan, "PARTIAL_MISSES", 0.0)
        whole = fast_replan(planner, before, long_on)
    assert "partial" not in whole.candidate
    assert fast.plan.predicted["rate"] > whole.plan.predicted["rate"] * (1 + milp.MIP_GAP)
    base = with_arrivals(Workload(tuple(Request(i, 0.0, 3000 if i % 16 == 0 else 300, 100) for i in range(48)),
                                  "mixed"), 1.0, n=400)

    def workload_at(rate: float) -> Workload:
        return at_rate(base, rate)

    judged = fast_replan(planner, before, long_on, workload_at=workload_at, judge_requests=300)
    assert judged.plan.dollars_per_hour <= before.dollars_per_hour + 1e-9
    short = lambda r: window(workload_at(r), first=300)  # noqa: E731
    rate = judged.plan.predicted["rate"]
    assert any(attainment_at(judged.plan, short, rate * f)[0] >= inputs.attainment for f in replan.LADDER)


def test_transition_matches_old_replicas_to_new_at_least_cost():
    planner, p = _small_plan()
    same = transition(p, p)
    assert {m.what for m in same.moves} == {"kept"} and same.weight_bytes == 0 and same.seconds == 0
    # the first L4 group of two or more replicas, half as many twice as wide (the same devices)
    widen = next(i for i, g in enumerate(p.groups) if g.device == "L4" and g.replicas >= 2)
    wider = replace(p, groups=tuple(replace(g, tp=g.tp * 2, replicas=g.replicas // 2) if i == widen else g
                                    for i, g in enumerate(p.groups)))
    t = transition(p, wider)
    assert t.weight_bytes > 0 and t.seconds > 0 and t.dollars > 0
    assert any(m.what == "reloaded" for m in t.moves)
    kept = [m for m in t.moves if m.what == "kept"]
    assert all(m.weight_bytes == 0 and m.old is not None and m.new is not None for m in kept)
    # the H100 replicas are untouched: kept in place (an L4 replica of the same tp may be re-roled instead)
    assert len(kept) >= sum(g.replicas for g in p.groups if g.device == "H100-80GB")


# ---- the simulator's tiers and the length router --------------------------------------------------------------
def test_a_fleet_of_two_models_serves_each_tier_on_its_own_replicas():
    c = parse_mixed_cluster("2xH100")
    placed = place((ReplicaSpec(0, 1, 1, "aggregated", 0), ReplicaSpec(0, 1, 1, "aggregated", 1)), c)
    fleet = Fleet((M8, parse_model("llama3-8b")), c, placed)
    base = with_arrivals(constant_lengths(500, 50), 4.0, n=40)
    w = replace(base, requests=tuple(replace(r, tier=r.id % 2) for r in base.requests))
    out = fleet.run(w)
    assert all(rec.replica == rec.id % 2 for rec in out.records)
    with pytest.raises(FlexmeshError, match="tier 2"):
        fleet.run(replace(w, requests=(replace(w.requests[0], tier=2),)))


def test_a_cascade_runs_escalated_requests_through_both_models_in_order():
    c = parse_mixed_cluster("2xH100")
    placed = place((ReplicaSpec(0, 1, 1, "aggregated", 0), ReplicaSpec(0, 1, 1, "aggregated", 1)), c)
    w = escalate(with_arrivals(constant_lengths(500, 50), 2.0, n=60), 0.5)
    alone = Fleet((M8, M8), c, placed).run(w)
    cascade = Fleet((M8, M8), c, placed, cascade=True).run(w)
    by_id = {r.id: r for r in alone.records}
    for r, req in zip(cascade.records, w.requests):
        assert r.replica == req.tier
        if req.tier == 1:  # it waited for the first model's whole answer
            assert r.ttft_s > by_id[r.id].e2e_s * 0.9
    assert sum(r.tier for r in w.requests) in range(20, 41)


def test_the_plan_router_sends_each_length_class_where_its_weights_say():
    c = parse_mixed_cluster("3xH100")
    placed = place((ReplicaSpec(0), ReplicaSpec(0), ReplicaSpec(0)), c)
    table = RoutingTable(prompt_edges=(1000,), entry=((1.0, 1.0, 0.0), (0.0, 0.0, 1.0)))
    reqs = tuple(Request(i, i * 0.05, 200 if i % 3 else 4000, 20) for i in range(90))
    for policy in ("weights", "least-work"):
        out = Fleet(M8, c, placed).run(Workload(reqs, "w"), router="plan", routing=replace(table, policy=policy))
        for rec in out.records:
            assert (rec.replica == 2) == (rec.prompt_tokens >= 1000)


# ---- cascades -----------------------------------------------------------------------------------------------
def test_cascade_plans_the_least_escalation_reaching_the_quality():
    q = parse_quality("0:0.6,0.5:0.75,1:0.8")
    assert q.fraction_for(0.75) == pytest.approx(0.5) and single_models(q, 0.75, ("a", "b")) == ["b"]
    with pytest.raises(PlanError, match="e2e"):
        stage_slos(SLO(ttft_s=1.0), 0.5)
    with pytest.raises(SpecError, match="never reaches"):
        q.fraction_for(0.9)
    buckets = parse_buckets("300:100=1")
    inputs = PlanInputs(("llama3.1-8b", "llama3.1-8b"), "4xH100", buckets, SLO(tpot_s=0.1, e2e_s=20.0), PRICES,
                        budget=30.0, tiers=(1.0, 0.0))
    res = plan_cascade(inputs, q, 0.7, None, splits=(0.5,))
    assert res.escalated == pytest.approx(q.fraction_for(0.7))
    assert res.result.plan.cascade is not None and {g.model for g in res.result.plan.groups} == {0, 1}


# ---- the command ------------------------------------------------------------------------------------------------
PLAN = ["serve", "plan", "--cluster", "2xH100+4xL4", "--trace", "azure-conv", "--requests", "400", "--slo",
        "ttft=1s,tpot=100ms", "--budget", "20"]


@pytest.mark.slow
def test_serve_plan_writes_a_plan_that_checks_and_simulates(tmp_path, capsys):
    out = tmp_path / "p"
    assert main(PLAN + ["--repair", "0", "--out", str(out), "--explain"]) == 0
    text = capsys.readouterr().out
    assert "candidates" in text and "goodput" in text and "why:" in text
    plan = load_plan(out / "plan.json")
    assert plan.predicted["goodput"] > 0 and plan.dollars_per_hour <= 20.0 + 1e-9
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goodput" in (out / "report.md").read_text()
    assert main(["serve", "plan", "--check", str(out / "plan.json")]) == 0
    assert "a valid serving plan" in " ".join(capsys.readouterr().out.split())
    assert main(["serve", "simulate", "--plan", str(out / "plan.json"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["runs"][0]["rate"] == pytest.approx(plan.predicted["goodput"])
    assert doc["dollars_per_hour"] == pytest.approx(plan.dollars_per_hour)


def test_serve_plan_without_the_simulator_and_its_one_line_errors(capsys):
    assert main(PLAN + ["--no-simulate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["score"] is None and doc["plan"]["groups"] and doc["timing"]["configurations"] > 0
    for flags, message in ((["--rate", "5"], "one objective"), (["--quality", "0:0.5,1:0.6"], "--cascade"),
                           (["--prompt-edges", "900,300"], "rising")):
        assert main(PLAN + flags + ["--no-simulate"]) == 2
        assert message in capsys.readouterr().err
    no_budget = [x for x in PLAN if x not in ("--budget", "20")]
    assert main(no_budget + ["--rate", "5", "--per-dollar", "--no-simulate"]) == 2
    assert "--per-dollar weighs goodput against a --budget" in capsys.readouterr().err


def _plan_cli(capsys, *flags: str) -> tuple[int, str, str]:
    from flexmesh.cli import main

    rc = main(["serve", "plan", "--requests", "300", *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")


def test_serve_plan_explains_its_names_and_its_mix_and_folds_routing_twins(capsys, wide):
    rc, out, _ = _plan_cli(capsys, "--cluster", "2xH100+4xL4", "--slo", "ttft=1s,tpot=100ms", "--budget", "20",
                           "--no-simulate")
    assert rc == 0
    assert out.count("(bN: N batched tokens an iteration, vLLM's --max-num-batched-tokens; sN:") == 1
    why = [line for line in out.splitlines() if line.startswith("why this mix: ")]
    assert why and all(" per req/s there" in w or "miss the SLO" in w for w in why)
    assert {w.split(" takes ")[0].removeprefix("why this mix: ") for w in why} <= {"H100-80GB", "L4"}
    rows = [line for line in out.splitlines() if line.startswith("│ ") and " on " in line and ":" in line]
    layouts = [r.split("│")[1].split(":", 1)[1].split("(")[0].strip() for r in rows if "req/s" not in r]
    assert len(layouts) == len(set(layouts))  # one row a layout, the other routing beside it


def test_serve_plan_compares_by_its_objective_and_says_when_it_equals_a_baseline(capsys, wide):
    rc, out, _ = _plan_cli(capsys, "--cluster", "2xH100", "--slo", "ttft=1s,tpot=100ms", "--budget", "20",
                           "--baselines", "--repair", "0")
    assert rc == 0 and "plan's goodput over its" in out
    assert "the plan equals the best single GPU type baseline" in out  # one type: the planner's plan is it
    assert "the plan equals the round-robin routing baseline" not in out  # the same replicas, other routing
    rc, out, _ = _plan_cli(capsys, "--cluster", "2xH100", "--slo", "ttft=1s,tpot=100ms", "--rate", "20",
                           "--baselines", "--repair", "0")
    assert rc == 0 and "its $/h over the plan's" in out


@pytest.mark.parametrize("slo,says", [("ttft=20ms,tpot=100ms", "the TTFT bound binds"),
                                      ("ttft=2s,tpot=2ms", "the TPOT bound binds")])
def test_an_slo_no_replica_meets_names_the_bound(capsys, wide, slo, says):
    rc, _, err = _plan_cli(capsys, "--cluster", "2xH100+4xL4", "--slo", slo, "--budget", "20", "--no-simulate")
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err
