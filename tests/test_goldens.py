"""Goldens of what the planner predicts, the step scheduler schedules and the simulator simulates, for
every kind of plan: uniform layouts (data, ZeRO-3, pipelines, interleaving, context parallelism) and
mixed-device plans. Recorded before the change that gives both kinds one plan type (tests/golden/, by
``python tests/golden/record.py``, at the commit named in each file): a refactoring of the plan types may move
code, not numbers.

What they promise on every machine: every decision (layouts, plans, each schedule's pieces, groups and
micro-batches, integers and names) exactly; every float (seconds, bytes, rates) within :data:`helpers.REL` of the
recorded one. The floats are sums and products of numpy arrays too, whose order of work follows the host's SIMD
path (another machine's last bit is not this one's); the decisions are compared bit for bit, so a float that
moved enough to change one shows there. The schedules are kept as a digest of their decisions and the floats
of each step.

The functions below compute each golden with the code of the day; they change with the API, the
JSON files do not.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_matches

GOLDEN = Path(__file__).resolve().parent / "golden"

# ---- (a) predictions --------------------------------------------------------------------------------------
SEARCH_CASES = [  # bench/search.py's cases: (label, model, cluster, seq len, global batch)
    ("a", "llama2-7b", "8xA100-80GB", 2048, 64),
    ("c", "llama2-13b", "8x8xA100-40GB", 32768, 64),
]
MIXED_CASES = [  # bench/mixed_plan.py's cases (a) and (c)
    ("a", "llama2-13b", "1x8xH100+2x8xA100-40GB", 4096, 256),
    ("c", "llama3-8b", "1x8xH200+1x8xH100+2x8xA100-40GB", 8192, 128),
]


def _plain(x):
    """``x`` as JSON would give it back (floats exactly: json writes their repr)."""
    return json.loads(json.dumps(x))


def uniform_plans() -> dict:
    """Hand-written uniform plans of the test suite, by name: the layout matrix of the runtime tests."""
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    def plan(world, strategy, pp=1, schedule="1f1b", v=1, m=1, seq=256, gb=8, cluster=None, model="tiny"):
        s = LayerStrategy.parse(strategy)
        layers = 4
        chunks = pp * v
        per = layers // chunks
        stages = tuple(StagePlan(i * per, (i + 1) * per, (s,) * per) for i in range(chunks))
        return Plan.uniform(model=model, cluster=cluster or f"{world}xA100-80GB", world_size=world, pp=pp,
                    pipeline_schedule=schedule, virtual_stages=v, num_microbatches=m, seq_len=seq, global_batch=gb,
                    stages=stages)

    return {
        "dp4-z0": plan(4, "tp1-dp4z0"), "dp4-z3": plan(4, "tp1-dp4z3"), "tp2-dp2-z2": plan(4, "tp2-dp2z2"),
        "ulysses2-dp2": plan(4, "tp1-u2-dp2z2"), "ring2-dp2-ac": plan(4, "tp1-r2-dp2z0-ac"),
        "pp2-dp2-1f1b": plan(4, "tp1-dp2z2", pp=2, m=4), "pp2-gpipe": plan(2, "tp1-dp1z0", pp=2, schedule="gpipe", m=2),
        "pp2-interleaved": plan(2, "tp1-dp1z0", pp=2, schedule="interleaved", v=2, m=4),
        "tp4-ac": plan(4, "tp4-dp1z0-ac", m=2),
    }


def mixed_plan_dicts() -> dict:
    """test_groups_runtime.py's five version-3 plans, by name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("groups_rt", Path(__file__).with_name("test_groups_runtime.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {name: mod.plan_dict(name, model="tiny") for name in mod.PLANS}


def compute_predictions() -> dict:
    from flexmesh.cost import CostModel
    from flexmesh.cost.training.mixed import MixedCosts, evaluate_groups
    from flexmesh.layout.legacy import legacy_dict
    from flexmesh.layout.plan import Plan
    from flexmesh.search import SearchRequest, best_plans
    from flexmesh.search.mixed import plan_mixed
    from flexmesh.spec import parse_cluster, parse_model
    from flexmesh.spec.cluster import parse_mixed_cluster

    out: dict = {"search": {}, "uniform": {}, "mixed_search": {}, "mixed": {}}
    for label, model, cluster, seq, gb in SEARCH_CASES:
        spec, c = parse_model(model), parse_cluster(cluster)
        r = best_plans(SearchRequest(spec, c, seq, gb, cost=CostModel(spec, c), top=1))
        best = r.best
        out["search"][label] = {"layout": best.plan.layout, "step_time": best.evaluation.step_time,
                                "tokens_per_s": best.evaluation.tokens_per_s, "memory": _plain(best.evaluation.memory)}
    tiny = parse_model("tiny")
    for name, p in uniform_plans().items():
        ev = CostModel(tiny, parse_cluster(p.cluster)).evaluate(p)
        out["uniform"][name] = {"step_time": ev.step_time, "tokens_per_s": ev.tokens_per_s,
                                "memory": _plain(ev.memory)}
    for label, model, cluster, seq, gb in MIXED_CASES:
        spec, mc = parse_model(model), parse_mixed_cluster(cluster)
        result = plan_mixed(spec, mc, seq, gb, MixedCosts(spec, mc))
        predicted = _plain(result.evaluation.to_dict())
        predicted.pop("search_seconds", None)  # how long the search took is no result of it
        # the plan as version 3 wrote it (replica groups of one pipeline each) where it can, else as now;
        # its predictions aside
        plan_dict = legacy_dict(result.plan.to_dict(), result.plan.version)
        out["mixed_search"][label] = {"plan": _plain(plan_dict | {"predicted": {}}), "predicted": predicted}
    mc = parse_mixed_cluster("2xH100-80GB+2xA100-40GB")
    for name, d in mixed_plan_dicts().items():
        plan = Plan.from_dict(dict(d, cluster="2xH100-80GB+2xA100-40GB", world_size=4,
                                         unused=[x for x in range(4) if x not in
                                                 {dev for r in d["replicas"] for s in r["stages"]
                                                  for dev in s["devices"]}]))
        out["mixed"][name] = _plain(evaluate_groups(plan, MixedCosts(tiny, mc)).to_dict())
    return out


# ---- (b) step schedules -------------------------------------------------------------------------------------
BATCHES = 20
SCHEDULE_PLANS = {  # the runtime's scheduler over these plans: (world, strategy, pp, pipeline schedule, v, m)
    "zero3-pp1": (8, "tp1-dp8z3", 1, "1f1b", 1, 8),
    "1f1b-pp2": (8, "tp1-dp4z2", 2, "1f1b", 1, 8),
    "interleaved-pp2": (8, "tp1-dp4z2", 2, "interleaved", 2, 8),
}


def schedule_plan(name: str):
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    world, strategy, pp, sched, v, m = SCHEDULE_PLANS[name]
    s = LayerStrategy.parse(strategy)
    chunks = pp * v
    per = 32 // chunks
    stages = tuple(StagePlan(i * per, (i + 1) * per, (s,) * per) for i in range(chunks))
    return Plan.uniform(model="llama2-7b", cluster=f"{world}xA100-80GB", world_size=world, pp=pp,
                        pipeline_schedule=sched,
                        virtual_stages=v, num_microbatches=m, seq_len=4096, global_batch=64, stages=stages)


def _split(value, floats: list):
    """``value`` with its floats moved, in order, to ``floats`` (``None`` left in their place)."""
    if isinstance(value, float):
        floats.append(value)
        return None
    if isinstance(value, dict):
        return {k: _split(value[k], floats) for k in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [_split(v, floats) for v in value]
    if hasattr(value, "tolist"):
        return _split(value.tolist(), floats)
    return value if value is None or isinstance(value, (bool, int, str)) else str(value)


class ScheduleDigest:
    """Step schedules as a digest of their decisions (everything but floats, as sorted JSON) and their floats
    (predicted times, lower bounds) in order."""

    def __init__(self):
        self.decisions, self.seconds = hashlib.sha256(), []

    def add(self, schedule) -> None:
        from dataclasses import asdict

        d = asdict(schedule)
        d.pop("scheduler_seconds")  # how long the scheduler took is no result of it
        self.decisions.update(json.dumps(_split(d, self.seconds), sort_keys=True).encode())

    def result(self) -> dict:
        return {"decisions": self.decisions.hexdigest(), "seconds": self.seconds}


def compute_schedules() -> dict:
    from flexmesh.data.lengths import load_lengths
    from flexmesh.layout.plan import Plan
    from flexmesh.schedule.registry import RUNTIME_POLICIES
    from flexmesh.schedule.scheduler import Scheduler
    from flexmesh.spec.model import parse_model

    lengths = load_lengths("wikipedia")
    rng = np.random.default_rng(0)
    batches = [np.clip(rng.choice(lengths, size=64), 2, 4096) for _ in range(BATCHES)]
    spec = parse_model("llama2-7b")
    out: dict = {"uniform": {}, "mixed": {}}
    for name in SCHEDULE_PLANS:
        plan = schedule_plan(name)
        for policy in (p for p in RUNTIME_POLICIES if p != "shares"):  # shares: the mixed plans' below
            fn = Scheduler(plan, spec, policy, 4096, 0)
            digest = ScheduleDigest()
            for lens in batches:
                digest.add(fn(lens))
            out["uniform"][f"{name}/{policy}"] = digest.result()
    for name, d in mixed_plan_dicts().items():
        fn = Scheduler(Plan.from_dict(d), parse_model("tiny"), "shares", 64)  # the runtime's fixed shares
        digest = ScheduleDigest()
        for lens in batches:
            # recorded under the policy name these schedules had then: "hetero" (the micro-batches are compared)
            digest.add(replace(fn(np.minimum(lens[:d["global_batch"]], 64)), policy="hetero"))
        out["mixed"][name] = digest.result()
    return out


# ---- (c) simulate --json -----------------------------------------------------------------------------------
SIMULATE_ARGS = {
    "llama2-7b-64xa100": ["--model", "llama2-7b", "--cluster", "8x8xA100-40GB", "--context", "65536",
                          "--policies", "hdp,milp,chunked", "--steps", "3", "--global-batch", "256"],
    "slow-rank-pp2": ["--model", "llama2-7b", "--cluster", "2x8xA100-80GB", "--context", "16384", "--pp", "2",
                      "--policies", "hdp", "--steps", "3", "--global-batch", "128", "--slow", "3=0.5"],
}


def compute_simulate() -> dict:
    import argparse

    from flexmesh.commands import simulate as sim

    out = {}
    for name, argv in SIMULATE_ARGS.items():
        parser = argparse.ArgumentParser()
        sim.add_parser(parser.add_subparsers())
        d = sim.simulate(parser.parse_args(["simulate", *argv, "--json"])).to_dict()
        # the recommendation leaves out a policy whose scheduler is slower than the step on this machine
        # (flexmesh.sim.compare.recommendation): it rests on the scheduler's timings too
        d.pop("recommendation")
        for run in d["policies"]:  # timings of the scheduler itself are not results
            for key in ("scheduler_ms_per_step", "scheduler_ms_p95"):
                run.pop(key, None)
            run["per_step"].pop("scheduler_s", None)
        out[name] = _plain(d)
    return out


COMPUTE = {"predictions": compute_predictions, "schedules": compute_schedules, "simulate": compute_simulate}


def test_matching_is_exact_for_decisions_and_close_for_floats():
    want = {"plan": ["tp2", 4], "t": [0.1 + 0.2]}
    assert_matches({"plan": ["tp2", 4], "t": [0.3]}, want, "x")  # one ulp apart: a reordered sum
    for wrong in ({"plan": ["tp2", 5], "t": [0.3]}, {"plan": ["tp4", 4], "t": [0.3]}, {"plan": ["tp2", 4], "t": [0.31]},
                  {"plan": ["tp2", 4.0], "t": [0.3]}, {"plan": ["tp2", 4], "t": [0.3, 0.3]}):
        with pytest.raises(AssertionError):
            assert_matches(wrong, want, "x")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPUTE))
def test_goldens_hold(name):
    recorded = json.loads((GOLDEN / f"{name}.json").read_text())
    got = _plain(COMPUTE[name]())
    assert set(got) == set(recorded["values"])
    for key, want in recorded["values"].items():
        assert_matches(got[key], want, f"{name}/{key} (recorded at {recorded['commit']})")
