"""Step schedules over replica groups (flexmesh.schedule.groups): fixed shares as the runtime ran them,
per-step dispatch that places every token once where memory holds it, and a lower bound no schedule
beats (flexmesh.sim.predict.simulate_groups prices them)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexmesh.cost.training.mixed import MixedCosts
from flexmesh.layout.plan import Plan
from flexmesh.schedule.groups import (
    GroupsContext,
    dispatch_sequences,
    groups_context,
    groups_lower_bound,
    groups_schedule,
    shares_schedule,
)
from flexmesh.schedule.testing import tiny_context
from flexmesh.sim.predict import simulate_groups
from flexmesh.spec.cluster import parse_mixed_cluster
from flexmesh.spec.model import parse_model


def _gctx(speed=()):
    """Three groups of the tiny model: 2 data ranks, 1 rank, and a pipeline of 2 stages."""
    ctx = (tiny_context(num_ranks=2, model="tiny"), tiny_context(num_ranks=1, model="tiny"),
           tiny_context(num_ranks=1, model="tiny", pp=2))
    g = GroupsContext(ctx, (6, 3, 3), (3, 3, 3))
    return g.with_speed((speed[0], speed[0], speed[1], speed[2])) if speed else g


def test_shares_are_the_runtimes_fixed_shares():
    """The runtime's ``shares`` (a plan on a cluster that prices nothing) is the groups' fixed shares."""
    from flexmesh.schedule.scheduler import Scheduler

    d = {"version": 3, "model": "tiny", "cluster": "cpu", "world_size": 3, "seq_len": 64, "global_batch": 8,
         "replicas": [{"batch": 6, "num_microbatches": 3, "stages": [{"layers": [0, 4], "devices": [0]}]},
                      {"batch": 2, "num_microbatches": 2, "stages": [{"layers": [0, 2], "devices": [1]},
                                                                     {"layers": [2, 4], "devices": [2]}]}]}
    plan = Plan.from_dict(d)
    lens = [5, 9, 3, 30, 7, 12, 4, 8]
    g = GroupsContext((tiny_context(num_ranks=1, model="tiny"), tiny_context(num_ranks=1, model="tiny", pp=2)),
                      (6, 2), (3, 2))
    runtime = Scheduler(plan, parse_model("tiny"), "shares", 64)
    assert runtime.groups is None and runtime(lens).groups == shares_schedule(lens, g).groups
    assert [[[p.seq_id for p in mb] for mb in grp.microbatches] for grp in runtime(lens).groups] == \
        [[[0, 1], [2, 3], [4, 5]], [[6], [7]]]
    # data ranks of a group take its micro-batches in turn
    s = shares_schedule(list(range(2, 14)), _gctx())
    assert [len(grp.microbatches) for grp in s.groups] == [2, 1, 3, 3]
    s.validate(4)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(2, 3000), min_size=3, max_size=40), st.sampled_from(["fixed", "balanced", "hdp"]),
       st.sampled_from([(), (1.0, 0.5, 1.0), (0.25, 1.0, 1.0)]))
def test_dispatch_places_every_token_once_where_memory_holds_it(lens, policy, speed):
    g = _gctx(speed)
    parts = dispatch_sequences(lens, g)
    assert sorted(int(i) for p in parts for i in p) == list(range(len(lens)))
    assert all(p.size for p in parts)  # every group steps
    for ctx, part in zip(g.contexts, parts):
        assert all(lens[i] <= ctx.max_tokens(ctx.group_sizes[-1]) for i in part)
    s = groups_schedule(policy, lens, g)
    s.validate(g.num_ranks)
    bound = groups_lower_bound(lens, g)
    assert 0 < bound <= simulate_groups(g, s) * (1 + 1e-9)
    assert bound <= simulate_groups(g, shares_schedule(lens, _shares_for(g, len(lens))))


def _shares_for(g: GroupsContext, n: int) -> GroupsContext:
    """The same groups with shares of ``n`` sequences (one micro-batch per sequence)."""
    from dataclasses import replace

    cut = [n // 3, n // 3, n - 2 * (n // 3)]
    return replace(g, shares=tuple(cut), microbatches=tuple(cut))


def test_a_slow_group_gets_less_and_dispatch_beats_fixed_shares_on_uneven_lengths():
    g = _gctx(speed=(1.0, 0.25, 1.0))
    rng = np.random.default_rng(0)
    lens = np.clip(rng.lognormal(5, 1.3, size=12).astype(int), 2, 3000)
    parts = dispatch_sequences(lens, g)
    tokens = [int(lens[p].sum()) for p in parts]
    assert tokens[1] < tokens[2]  # the slow rank against a rank of nominal speed
    shares = simulate_groups(g, shares_schedule(lens, g))
    dispatched = simulate_groups(g, groups_schedule("balanced", lens, g))
    assert dispatched < shares


def test_a_document_no_group_holds_is_named():
    g = _gctx()
    too_long = max(c.max_tokens(c.group_sizes[-1]) for c in g.contexts) + 1
    with pytest.raises(Exception, match=f"a sequence of {too_long} tokens fits in no replica group"):
        dispatch_sequences([10, too_long, 20], g)


def test_groups_context_prices_each_group_on_its_device():
    spec, cluster = parse_model("llama2-7b"), parse_mixed_cluster("1x4xH100+1x4xA100-40GB")
    d = {"version": 3, "model": "llama2-7b", "cluster": cluster.label, "world_size": 8, "seq_len": 2048,
         "global_batch": 32, "replicas": [
             {"batch": 20, "num_microbatches": 10, "stages": [{"layers": [0, 32], "devices": [0, 1, 2, 3]}]},
             {"batch": 12, "num_microbatches": 6, "stages": [{"layers": [0, 32], "devices": [4, 5, 6, 7],
                                                              "recompute": "full"}]}]}
    g = groups_context(Plan.from_dict(d), spec, MixedCosts(spec, cluster))
    assert [c.cost.cluster.device.name for c in g.contexts] == ["H100-80GB", "A100-40GB"]
    assert [c.num_ranks for c in g.contexts] == [1, 1] and g.shares == (20, 12) and g.cross_sync_s > 0
    lens = [2048] * 32
    h100, a100 = (c.seq_time(1, [2048])[0] for c in g.contexts)
    assert h100 < a100
    assert simulate_groups(g, groups_schedule("balanced", lens, g)) <= simulate_groups(g, shares_schedule(lens, g))


def test_scheduler_refuses_what_a_plan_cannot_run():
    """`shares` names the groups' planned shares, which a plan of one group does not have; a static
    context-parallel group larger than a replica group's data ranks fits nowhere."""
    from flexmesh.errors import ScheduleError
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.schedule.scheduler import Scheduler

    spec = parse_model("tiny")
    one = Plan.uniform("tiny", "2xA100-80GB", 2, 1, "1f1b", 1, 256, 4,
                       (StagePlan(0, spec.num_layers, (LayerStrategy.parse("tp1-dp2z2"),) * spec.num_layers),))
    with pytest.raises(ScheduleError, match="this plan has one group"):
        Scheduler(one, spec, "shares", 256)
    with pytest.raises(ScheduleError, match="give --cp at most 2"):
        Scheduler(one, spec, "fixed", 256, cp=4)
    assert Scheduler(one, spec, "fixed", 256, cp=2).options == [{"cp": 2}]


def test_simulate_plan_compares_fixed_shares_with_dispatch(tmp_path, capsys):
    """`flexmesh simulate --plan` on a plan of several groups: every way of scheduling over the same
    steps, each no faster than its lower bound, the dispatch no slower than the plan's fixed shares."""
    import json

    from flexmesh.cli import main

    cluster = parse_mixed_cluster("1x4xH100+1x4xA100-40GB")
    d = {"version": 3, "model": "llama2-7b", "cluster": cluster.label, "world_size": 8, "seq_len": 4096,
         "global_batch": 32, "replicas": [
             {"batch": 20, "num_microbatches": 10, "stages": [{"layers": [0, 32], "devices": [0, 1, 2, 3]}]},
             {"batch": 12, "num_microbatches": 6, "stages": [{"layers": [0, 32], "devices": [4, 5, 6, 7],
                                                              "recompute": "full"}]}]}
    path = tmp_path / "plan.json"
    Plan.from_dict(d).save(path)
    assert main(["simulate", "--plan", str(path), "--context", "4096", "--steps", "2", "--policies", "balanced",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    runs = {r["schedule"]: r for r in out["schedules"]}
    assert set(runs) == {"shares", "shares+balanced", "dispatch+balanced"} and out["setup"]["groups"] == 2
    assert all(r["ratio_to_lower_bound"] >= 1.0 - 1e-9 for r in runs.values())
    assert runs["dispatch+balanced"]["tokens_per_s"] >= runs["shares"]["tokens_per_s"]
