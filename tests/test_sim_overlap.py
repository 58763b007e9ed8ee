"""The per-step scheduler and the simulator price a plan's own overlap options."""

from __future__ import annotations

from dataclasses import replace

from flexmesh.cost import CostModel
from flexmesh.layout.overlap import NO_OVERLAP, RUNTIME
from flexmesh.layout.plan import Plan, StagePlan
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.schedule.registry import make_schedule
from flexmesh.schedule.scheduler import Scheduler, schedule_context
from flexmesh.search.space import FASTEST
from flexmesh.sim.predict import simulated_scheduler
from flexmesh.sim.simulation import SimulationConfig, simulation_context
from flexmesh.sim.timeline import simulate_step
from flexmesh.spec import parse_cluster, parse_model

SPEC = parse_model("llama2-7b")
LENGTHS = [4096] * 8 + [1024] * 16


def _plan(overlap):
    st = StagePlan(0, 32, (LayerStrategy.parse("tp2-dp4z3"),) * 32)
    return Plan.uniform("llama2-7b", "8xH100", 8, 1, "1f1b", 1, 4096, 8, (st,), overlap=overlap)


def test_scheduler_context_carries_the_plans_overlap():
    for overlap in (NO_OVERLAP, RUNTIME, FASTEST):
        assert schedule_context(_plan(overlap), SPEC, 4096).cost.step_overlap == overlap


def test_tp_overlap_makes_the_simulated_step_faster_where_tp_comm_is_exposed():
    times = {}
    for name, overlap in (("none", NO_OVERLAP), ("fastest", FASTEST)):
        sched = simulated_scheduler(Scheduler(_plan(overlap), SPEC, "balanced", 4096))
        phases = sched.context.cost.microbatch_phases(sched.context.group_strategy(1), 4096.0, 4096.0**2)
        times[name] = (sched(LENGTHS).predicted_step_time, float(phases.comm_fwd + phases.comm_bwd))
    assert times["none"][1] > 0  # tp2: the sequence-parallel collectives are exposed without overlap
    assert times["fastest"][1] < times["none"][1]
    assert times["fastest"][0] < times["none"][0]


def test_simulation_config_prices_its_overlap():
    base = CostModel(SPEC, parse_cluster("8xH100"))
    cfg = SimulationConfig(policies=("balanced",), context=4096, tp=2, zero=3)
    steps = {}
    for overlap in (NO_OVERLAP, FASTEST):
        ctx, _ = simulation_context(base, replace(cfg, overlap=overlap))
        steps[overlap] = simulate_step(ctx, make_schedule("balanced", LENGTHS, ctx)).step_time
    assert steps[FASTEST] < steps[NO_OVERLAP]
    assert base.step_overlap == NO_OVERLAP  # the base model is left as it was
