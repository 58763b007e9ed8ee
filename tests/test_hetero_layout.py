"""The heterogeneous plan format (layout/hetero.py): validation, JSON round trip, the uniform case."""

from __future__ import annotations

import json

import pytest

from flexmesh.errors import PlanError
from flexmesh.layout.hetero import HeteroPlan, Replica, ReplicaStage, load_plan, plan_from_dict
from flexmesh.layout.mesh import layout_from_plan, rank_coords
from flexmesh.layout.plan import Plan, StagePlan
from flexmesh.layout.strategy import LayerStrategy


def _plan_dict() -> dict:
    return {"version": 3, "model": "tiny", "cluster": "2xH100+2xA100-40GB", "world_size": 5,
            "seq_len": 512, "global_batch": 12, "pipeline_schedule": "1f1b",
            "replicas": [{"batch": 8, "num_microbatches": 4,
                          "stages": [{"layers": [0, 4], "devices": [0, 1]}]},
                         {"batch": 4, "num_microbatches": 2,
                          "stages": [{"layers": [0, 1], "devices": [2], "recompute": "full"},
                                     {"layers": [1, 4], "devices": [3]}]}],
            "unused": [4]}


def test_round_trip_and_views(tmp_path):
    p = HeteroPlan.from_dict(_plan_dict())
    path = tmp_path / "p.json"
    p.save(path)
    q = load_plan(path)
    assert q == p and isinstance(q, HeteroPlan)
    assert [r.pp for r in p.replicas] == [1, 2]
    assert p.used_devices == 4 and p.replicas[1].microbatch_size == 2
    assert p.holders(0) == [(0, 0), (1, 0)] and p.holders(2) == [(0, 0), (1, 1)]
    assert str(p.replicas[1].stages[0].recompute) == "full"
    assert "tp2" in p.layout and "[1,4) tp1" in p.layout


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["replicas"][0].update(batch=4), "sum to 8"),
    (lambda d: d.update(unused=[]), r"not placed: \[4\]"),
    (lambda d: d.update(unused=[4, 5]), r"beyond the world: \[5\]"),
    (lambda d: d["replicas"][1]["stages"][1].update(devices=[0]), "device 0 is in replica"),
    (lambda d: d["replicas"][1]["stages"][1].update(layers=[2, 4]), "not contiguous"),
    (lambda d: d["replicas"][1]["stages"][1].update(layers=[1, 3]), "different numbers of layers"),
    (lambda d: d["replicas"][0].update(num_microbatches=3), "not divisible into 3"),
    (lambda d: d["replicas"][0]["stages"][0].update(recompute="some"), "recompute must be one of"),
    (lambda d: d["replicas"][0]["stages"][0].update(devices=[]), "has no devices"),
    (lambda d: d["replicas"][0]["stages"][0].update(devices=[1, 1]), "names a device twice"),
    (lambda d: d["replicas"][0]["stages"][0].update(device=[1]), "unknown field"),
    (lambda d: d.update(pipeline_schedule="interleaved"), "pipeline schedule must be one of"),
    (lambda d: d.update(replicas=[]), "at least one replica"),
    (lambda d: d["replicas"][0].update(batch=-1), "replica 0"),
])
def test_bad_plans_name_the_fault(edit, message):
    d = _plan_dict()
    edit(d)
    with pytest.raises(PlanError, match=message):
        plan_from_dict(json.loads(json.dumps(d)))


def test_versions_dispatch():
    assert isinstance(plan_from_dict(_plan_dict()), HeteroPlan)
    st = StagePlan(0, 2, (LayerStrategy.parse("tp1-dp2z0"),) * 2)
    uniform = Plan("tiny", "2xA100-80GB", 2, 1, "1f1b", 1, 512, 4, (st,))
    assert plan_from_dict(uniform.to_dict()) == uniform


def test_uniform_plan_is_the_special_case():
    """Replica r, stage p holds exactly the ranks the uniform rank order gives (dp r, pp p)."""
    strat = LayerStrategy.parse("tp2-dp2z1")
    plan = Plan("tiny", "8xA100-80GB", 8, 2, "1f1b", 4, 512, 16,
                (StagePlan(0, 1, (strat,)), StagePlan(1, 4, (LayerStrategy.parse("tp2-dp2z1-ac"),) * 3)))
    h = HeteroPlan.from_uniform(plan)
    layout_from_plan(plan)
    assert len(h.replicas) == 2 and sum(r.batch for r in h.replicas) == 16
    for r, rep in enumerate(h.replicas):
        assert [(s.start, s.end) for s in rep.stages] == [(0, 1), (1, 4)]
        for p, stage in enumerate(rep.stages):
            for rank in stage.devices:
                c = rank_coords(rank, 2, 2, 1, 2)
                assert (c["dp"], c["pp"]) == (r, p)
    assert [str(s.recompute) for s in h.replicas[0].stages] == ["none", "full"]
    with pytest.raises(PlanError, match="context parallelism"):
        cp = StagePlan(0, 2, (LayerStrategy.parse("tp1-u2-dp1z0"),) * 2)
        HeteroPlan.from_uniform(Plan("tiny", "2xA100-80GB", 2, 1, "1f1b", 1, 512, 4, (cp,)))


def test_direct_construction_validates():
    with pytest.raises(PlanError, match="start at layer 0"):
        Replica((ReplicaStage(1, 2, (0,)),), 2, 1)
    with pytest.raises(PlanError, match="empty or reversed"):
        ReplicaStage(2, 2, (0,))
