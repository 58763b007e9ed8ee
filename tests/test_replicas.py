"""Replica mixes for LoRA tasks (flexmesh.search.replicas): dispatch places every sequence once, on a
replica that holds it; the LP-ranked search finds what pricing every mix finds on a small cluster; a mix
is a plan of replica groups that the check accepts and the scheduler runs with the adapters' cost
model; `flexmesh plan --tasks --replicas --out` writes a mix that fills the cluster."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import flexmesh_here


@pytest.fixture(scope="module")
def cost():
    from flexmesh.cost import CostModel
    from flexmesh.cost.training.parts import Parts
    from flexmesh.spec import parse_cluster, parse_model
    from flexmesh.spec.tasks import Task, TaskSet

    tasks = TaskSet((Task(name="a", rank=16, alpha=32, targets=("q_proj", "v_proj")),))
    return CostModel(parse_model("llama2-7b"), parse_cluster("1x4xA100-40GB"), parts=Parts(tasks=tasks))


def _steps(n: int, seed: int) -> list[np.ndarray]:
    from flexmesh.data.lengths import load_lengths

    lengths = np.minimum(load_lengths("prolong"), 16384)
    rng = np.random.default_rng(seed)
    return [rng.choice(lengths, 24).astype(int) for _ in range(n)]


def test_dispatch_places_every_sequence_once_where_it_fits(cost):
    from flexmesh.search.replicas import Pricer, dispatch, replica_types

    types = replica_types(cost, 4)
    small = min(types, key=lambda t: t.capacity)
    big = max(types, key=lambda t: t.capacity)
    replicas = [small, big] if small.devices + big.devices <= 4 else [big]
    lengths = _steps(1, 0)[0]
    parts = dispatch(lengths, replicas, Pricer(cost))
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    for t, idx in zip(replicas, parts):
        assert all(lengths[i] <= t.capacity for i in idx)
    from flexmesh.errors import PlanError

    with pytest.raises(PlanError, match="fits no replica"):
        dispatch([small.capacity + 1], [small], Pricer(cost))


def test_ranked_search_finds_the_best_mix_of_all(cost):
    """On 4 devices, pricing every mix in full (keep=all) and the LP-ranked search agree."""
    from flexmesh.search.replicas import mixes, plan_mix, replica_types

    sample = _steps(2, 1)
    types = replica_types(cost, 4)
    every = sum(1 for c in mixes(types, 4, 3) if max(t.capacity for t, _ in c) >= max(map(max, sample)))
    best, tried = plan_mix(cost, 4, sample, keep=every)
    assert len(tried) == every and best.devices == 4
    ranked, _ = plan_mix(cost, 4, sample)
    assert ranked.step_s == pytest.approx(best.step_s)


def test_a_mix_is_a_plan_of_replica_groups(cost):
    """Two TP1 replicas for the short sequences and one CP2 replica for the long: two groups, their
    replicas the groups' data-parallel pipelines, their shares the global batch; the file reads back,
    passes the check priced for the adapters, and every step's tokens are scheduled once on it."""
    from flexmesh.cost.training.mixed import MixedCosts
    from flexmesh.layout.plan import Plan
    from flexmesh.schedule.scheduler import Scheduler
    from flexmesh.search.check import check_groups
    from flexmesh.search.replicas import GroupMemory, Mix, mix_plan, replica_types
    from flexmesh.spec.cluster import MixedCluster

    types = replica_types(cost, 4, pp_options=(1,), prune=False)
    small = max((t for t in types if (t.tp, t.cp) == (1, 1)), key=lambda t: t.capacity)
    big = max((t for t in types if (t.tp, t.cp) == (1, 2)), key=lambda t: t.capacity)
    seq = (small.capacity + min(big.capacity, 2 * small.capacity)) // 2  # more than one TP1 replica holds
    mix = Mix(((small, 2), (big, 1)), 0.0)
    assert GroupMemory(cost, seq).holds(mix.counts) and not GroupMemory(cost, big.capacity + 1).holds(mix.counts)
    steps = [np.minimum(s, seq) for s in _steps(3, 2)]
    plan = mix_plan(mix, cost, steps, seq, 24)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    # exact: JSON keeps every float
    assert again == plan and again.global_batch == sum(g.share for g in again.groups) == 24
    strategies = [g.layer_strategies()[0] for g in again.groups]
    assert [(s.tp, s.cp, s.dp, s.zero) for s in strategies] == [(1, 2, 1, 0), (1, 1, 2, 0)]  # largest replicas first
    assert [g.ranks for g in again.groups] == [(0, 1), (2, 3)]
    assert again.predicted["lengths"]["step_time_s"] > 0
    costs = MixedCosts(cost.model, MixedCluster((cost.cluster,)), groups=[cost])
    assert check_groups(again, cost.model, MixedCluster((cost.cluster,)), costs).fits
    schedule = Scheduler(again, cost.model, "balanced", seq, cost=cost)(steps[0])
    schedule.validate(4)
    assert schedule.extra["dispatch"][0] and schedule.extra["dispatch"][1]
    long_ = int(np.argmax(steps[0]))
    if steps[0][long_] > small.capacity:  # only the CP2 group holds it
        assert any(p.seq_id == long_ for g in schedule.groups if g.ranks[0] < 2 for mb in g.microbatches for p in mb)


def test_a_written_mix_holds_the_longest_sequence(cost):
    from flexmesh.search.replicas import plan_mix, replica_types

    sample = _steps(2, 3)
    types = replica_types(cost, 4, pp_options=(1,))
    best, tried = plan_mix(cost, 4, sample, types=types, seq_len=16384)
    from flexmesh.search.replicas import GroupMemory

    assert all(GroupMemory(cost, 16384).holds(m.counts) for m in tried) and best.devices == 4


def test_plan_replicas_cli(tmp_path):
    job = tmp_path / "jobs.toml"
    job.write_text('[[task]]\nname = "chat"\nlengths = "wikipedia"\nrank = 8\nalpha = 16\ntargets = ["q_proj"]\n'
                   'batch = 16\n\n[[task]]\nname = "long"\nlengths = "prolong"\nrank = 8\nalpha = 16\n'
                   'targets = ["q_proj"]\nbatch = 8\n')
    plan = tmp_path / "plan.json"
    proc = flexmesh_here("plan", "--model", "llama2-7b", "--cluster", "4xA100-40GB", "--tasks", str(job), "--replicas",
                         "--seq-len", "8192", "--json", "--out", str(plan))
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert sum(r["devices"] * r["replicas"] for r in out["mix"]) == 4
    assert max(r["max_tokens"] for r in out["mix"]) >= 8192
    assert out["single"] and out["step_s"] > 0
    from flexmesh.layout.plan import PLAN_VERSION

    written = json.loads(plan.read_text())
    # exact: JSON keeps every float
    assert written == out["plan"] and written["version"] == PLAN_VERSION and len(written["groups"]) == len(out["mix"])
    assert all(g["microbatch_tokens"] > 0 for g in written["groups"])  # each group's token budget shown
    assert flexmesh_here("plan", "--check", str(plan), "--tasks", str(job)).returncode == 0
    full = flexmesh_here("plan", "--check", str(plan))  # the same layouts training every weight do not fit
    assert full.returncode == 2 and "GiB" in full.stderr
    proc = flexmesh_here("plan", "--model", "llama2-7b", "--cluster", "4xA100-40GB", "--replicas")
    assert proc.returncode != 0 and "give --tasks" in proc.stderr
