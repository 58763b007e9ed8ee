"""Replica mixes for LoRA tasks (flexmesh.search.replicas): dispatch places every sequence once, on a
replica that holds it; the LP-ranked search finds what pricing every mix finds on a small cluster;
`flexmesh plan --tasks --replicas` prints a mix that fills the cluster."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import flexmesh_here


@pytest.fixture(scope="module")
def cost():
    from flexmesh.cost import CostModel
    from flexmesh.cost.training.finetune import AdapterCostModel
    from flexmesh.spec import parse_cluster, parse_model
    from flexmesh.spec.tasks import Task, TaskSet

    tasks = TaskSet((Task(name="a", rank=16, alpha=32, targets=("q_proj", "v_proj")),))
    return AdapterCostModel(CostModel(parse_model("llama2-7b"), parse_cluster("1x4xA100-40GB")), tasks)


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


def test_plan_replicas_cli(tmp_path):
    job = tmp_path / "jobs.toml"
    job.write_text('[[task]]\nname = "chat"\nlengths = "wikipedia"\nrank = 8\nalpha = 16\ntargets = ["q_proj"]\n'
                   'batch = 16\n\n[[task]]\nname = "long"\nlengths = "prolong"\nrank = 8\nalpha = 16\n'
                   'targets = ["q_proj"]\nbatch = 8\n')
    proc = flexmesh_here("plan", "--model", "llama2-7b", "--cluster", "4xA100-40GB", "--tasks", str(job), "--replicas",
                         "--seq-len", "8192", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert sum(r["devices"] * r["replicas"] for r in out["mix"]) == 4
    assert max(r["max_tokens"] for r in out["mix"]) >= 8192
    assert out["single"] and out["step_s"] > 0
    proc = flexmesh_here("plan", "--model", "llama2-7b", "--cluster", "4xA100-40GB", "--replicas")
    assert proc.returncode != 0 and "give --tasks" in proc.stderr
