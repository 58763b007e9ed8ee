"""One plan type: replica groups (layout/plan.py), version-3 files read as groups (layout/legacy.py),
the uniform plan as the special case, and checkpoints of older plan files still matching."""

from __future__ import annotations

import json

import pytest

from flexmesh.cli import main
from flexmesh.cost.training.mixed import MixedCosts, evaluate_groups
from flexmesh.cost.training.model import CostModel
from flexmesh.errors import PlanError
from flexmesh.layout.legacy import legacy_dict
from flexmesh.layout.mesh import layout_from_plan, rank_coords, replica_groups
from flexmesh.layout.overlap import FASTEST
from flexmesh.layout.plan import Plan, ReplicaGroup, StagePlan, load_plan
from flexmesh.layout.stack import Stack
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.cluster import parse_mixed_cluster
from flexmesh.spec.model import parse_model


def _v3_dict() -> dict:
    return {"version": 3, "model": "tiny", "cluster": "2xH100+2xA100-40GB", "world_size": 5,
            "seq_len": 512, "global_batch": 12, "pipeline_schedule": "1f1b",
            "replicas": [{"batch": 8, "num_microbatches": 4,
                          "stages": [{"layers": [0, 4], "devices": [0, 1]}]},
                         {"batch": 4, "num_microbatches": 2,
                          "stages": [{"layers": [0, 1], "devices": [2], "recompute": "full"},
                                     {"layers": [1, 4], "devices": [3]}]}],
            "unused": [4]}


def test_a_version_3_file_reads_as_groups_and_saves_as_version_5(tmp_path):
    old = tmp_path / "v3.json"
    old.write_text(json.dumps(_v3_dict()))
    p = load_plan(old)
    assert [g.pp for g in p.groups] == [1, 2] and p.unused == (4,) and p.version == 3
    assert [g.share for g in p.groups] == [8, 4] and p.groups[1].microbatch_size == 2
    assert p.groups[0].blocks == ((0, 1),) and p.groups[1].blocks == ((2,), (3,))
    assert [str(s.strategies[0]) for s in p.groups[1].stages] == ["tp1-dp1z0-ac", "tp1-dp1z0"]
    assert [g.stage_of_layer(2) for g in p.groups] == [0, 1] and p.groups[0].stage_tp(0) == 2
    assert not p.in_rank_order and "ranks 0-1 b8" in p.layout and "[1,4) 3x tp1-dp1z0" in p.layout
    new = tmp_path / "v4.json"
    p.save(new)
    assert json.loads(new.read_text())["version"] == 5
    assert load_plan(new) == p
    # the form version 3 wrote comes back, so checkpoints hashed under it match (runtime.checkpoint.plan_hash)
    back = legacy_dict(p.to_dict(), p.version)
    assert back is not None and back["replicas"][1]["stages"][0] == {"layers": [0, 1], "devices": [2],
                                                                       "recompute": "full"}
    assert Plan.from_dict(back) == p


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["replicas"][0].update(batch=4), "add up to 8"),
    (lambda d: d.update(unused=[]), r"not placed: \[4\]"),
    (lambda d: d.update(unused=[4, 5]), r"beyond the world: \[5\]"),
    (lambda d: d["replicas"][1]["stages"][1].update(devices=[0]), "rank 0 is in replica group 0 pipeline rank 0 "
                                                                   "and in replica group 1 pipeline rank 1"),
    (lambda d: d["replicas"][1]["stages"][1].update(layers=[2, 4]), "not contiguous"),
    (lambda d: d["replicas"][1]["stages"][1].update(layers=[1, 3]), "different numbers of layers"),
    (lambda d: d["replicas"][0].update(num_microbatches=3), "not divisible into 3"),
    (lambda d: d["replicas"][0]["stages"][0].update(recompute="some"), "recompute must be one of"),
    (lambda d: d["replicas"][0]["stages"][0].update(devices=[]), "has no devices"),
    (lambda d: d["replicas"][0]["stages"][0].update(devices=[1, 1]), "names a device twice"),
    (lambda d: d["replicas"][0]["stages"][0].update(device=[1]), "unknown field"),
    (lambda d: d.update(pipeline_schedule="interleaved"), "pipeline schedule must be one of"),
    (lambda d: d.update(replicas=[]), "at least one replica group"),
    (lambda d: d["replicas"][0].update(batch=-1), "replica 0"),
])
def test_bad_version_3_plans_name_the_fault(edit, message):
    d = _v3_dict()
    edit(d)
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(json.loads(json.dumps(d)))


def _v4_dict() -> dict:
    d = Plan.from_dict(_v3_dict()).to_dict()
    return json.loads(json.dumps(d))


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["groups"][0].update(ranks=["0-x"]), r"cannot read '0-x'"),
    (lambda d: d["groups"][0].update(ranks=["3-1"]), "not a run of ranks"),
    (lambda d: d["groups"][0].update(share=4, num_microbatches=2), "add up to 8"),
    (lambda d: d["groups"][0].update(share=5), "share of 5 sequences .* not divisible into 4"),
    (lambda d: d["groups"][0].update(ranks=["0-1", "2"]), "1 stages but pp x virtual_stages = 2 x 1"),
    (lambda d: d["groups"][0].update(extra=1), "unknown field"),
    (lambda d: d.update(groups=[]), "at least one replica group"),
    (lambda d: d["groups"][1]["stages"][0].update(strategies=["tp9"]), "stage 0"),
])
def test_bad_version_4_plans_name_the_fault(edit, message):
    d = _v4_dict()
    edit(d)
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(d)


def test_versions_1_and_2_read_as_one_group_in_rank_order():
    st = StagePlan(0, 2, (LayerStrategy.parse("tp1-dp2z0"),) * 2)
    uniform = Plan.uniform("tiny", "2xA100-80GB", 2, 1, "1f1b", 1, 512, 4, (st,))
    v2 = legacy_dict(uniform.to_dict(), uniform.version)
    assert v2 is not None and v2["version"] == 2 and v2["pp"] == 1
    v1 = {k: v for k, v in v2.items() if k != "pipeline_schedule"} | {"version": 1, "schedule": "1f1b"}
    for d in (v2, v1, uniform.to_dict()):
        p = Plan.from_dict(d)
        assert p == uniform and p.in_rank_order and p.group.blocks == ((0, 1),)
    with pytest.raises(PlanError, match="this plan has 2 replica groups"):
        _ = Plan.from_dict(_v3_dict()).pp


def test_checkpoints_of_an_old_plan_file_match_it_upgraded(tmp_path):
    """A checkpoint hashes the plan's older form: the old file and the same plan saved as version 5 agree."""
    pytest.importorskip("torch")
    from flexmesh.runtime.state.checkpoint import plan_hash

    st = tuple(StagePlan(i, i + 2, (LayerStrategy.parse("tp2-dp1z3"),) * 2) for i in (0, 2))
    uniform = Plan.uniform("tiny", "4xA100-80GB", 4, 2, "1f1b", 4, 512, 8, st)
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(legacy_dict(uniform.to_dict(), uniform.version)))
    load_plan(old).save(new)
    assert plan_hash(load_plan(old)) == plan_hash(load_plan(new)) == plan_hash(uniform)
    v3 = tmp_path / "v3.json"
    v3.write_text(json.dumps(_v3_dict()))
    load_plan(v3).save(new)
    assert plan_hash(load_plan(v3)) == plan_hash(load_plan(new))
    assert plan_hash(load_plan(new)) != plan_hash(uniform)
    # groups neither version 2 nor 3 describes: hashed in version 4's form (no microbatch_tokens), as before
    st2 = (StagePlan(0, 4, (LayerStrategy.parse("tp1-dp2z0"),) * 4),)
    two = Plan("tiny", "4xA100-80GB", 4, 512, 8, "1f1b", (ReplicaGroup(((0, 1),), st2, 2, 4),
                                                          ReplicaGroup(((2, 3),), st2, 2, 4)))
    v4 = legacy_dict(two.to_dict(), two.version)
    assert v4["version"] == 4 and all("microbatch_tokens" not in g for g in v4["groups"])
    assert {k: v for k, v in two.to_dict().items() if k not in ("version", "groups")} == \
        {k: v for k, v in v4.items() if k not in ("version", "groups")}
    old.write_text(json.dumps(v4))
    load_plan(old).save(new)
    assert json.loads(new.read_text())["groups"][0]["microbatch_tokens"] == 2 * 512 // 2
    assert plan_hash(load_plan(old)) == plan_hash(load_plan(new)) == plan_hash(two)


def test_replica_groups_of_a_uniform_plan_follow_the_rank_order():
    """Group r, stage p holds exactly the ranks the uniform rank order gives (dp r, pp p)."""
    strat = LayerStrategy.parse("tp2-dp2z1")
    plan = Plan.uniform("tiny", "8xA100-80GB", 8, 2, "1f1b", 4, 512, 16,
                        (StagePlan(0, 1, (strat,)), StagePlan(1, 4, (LayerStrategy.parse("tp2-dp2z1-ac"),) * 3)))
    h = replica_groups(plan)
    layout_from_plan(plan)
    assert len(h.groups) == 2 and sum(g.share for g in h.groups) == 16
    for r, g in enumerate(h.groups):
        assert [(s.start, s.end) for s in g.stages] == [(0, 1), (1, 4)]
        for p, block in enumerate(g.blocks):
            for rank in block:
                c = rank_coords(rank, 2, 2, 1, 2)
                assert (c["dp"], c["pp"]) == (r, p)
    assert [str(s.strategies[0].recompute) for s in h.groups[0].stages] == ["none", "full"]
    with pytest.raises(PlanError, match="context parallelism"):
        cp = StagePlan(0, 2, (LayerStrategy.parse("tp1-u2-dp1z0"),) * 2)
        replica_groups(Plan.uniform("tiny", "2xA100-80GB", 2, 1, "1f1b", 1, 512, 4, (cp,)))


def test_direct_construction_validates():
    st = (StagePlan(0, 2, (LayerStrategy(),) * 2),)
    with pytest.raises(PlanError, match="at least one pipeline stage"):
        ReplicaGroup((), st, 1, 1)
    with pytest.raises(PlanError, match="empty or reversed"):
        StagePlan(2, 1, ())
    with pytest.raises(PlanError, match="not divisible into 2"):
        ReplicaGroup(((0,),), st, 2, 3)
    with pytest.raises(PlanError, match="rank 0 is in replica group 0 pipeline rank 0 and in replica group 1"):
        Plan("tiny", "cpu", 1, 64, 2, "1f1b", (ReplicaGroup(((0,),), st, 1, 1), ReplicaGroup(((0,),), st, 1, 1)))


def test_a_new_global_batch_scales_the_shares():
    p = Plan.from_dict(_v3_dict())
    q = p.with_global_batch(24)
    assert [g.share for g in q.groups] == [16, 8] and q.global_batch == 24
    assert all(g.share % g.num_microbatches == 0 for g in q.groups)


# ---- plan --check: every plan, one group or several, by the same rules and the same stack flags ----------
def _two_groups(second: list[tuple[int, int, tuple[int, ...]]]) -> Plan:
    """llama2-7b on 1x4xH100+1x4xA100-40GB: an H100 group of tp 4, and ``second``'s stages (start, end,
    devices) on the A100s, every layer of tp ``len(devices)`` recomputed in full."""
    def group(stages, share):
        return ReplicaGroup(tuple(d for _, _, d in stages),
                            tuple(StagePlan(a, b, (LayerStrategy.parse(f"tp{len(d)}-dp1z0-ac"),) * (b - a))
                                  for a, b, d in stages), 4, share)
    return Plan("llama2-7b", "1x4xH100+1x4xA100-40GB", 8, 2048, 16, "1f1b",
                (group([(0, 32, (0, 1, 2, 3))], 8), group(second, 8)), overlap=FASTEST)


def test_check_prices_a_plan_of_several_groups_with_the_stack_flags(tmp_path, capsys):
    path = tmp_path / "groups.json"
    _two_groups([(0, 16, (4, 5)), (16, 32, (6, 7))]).save(path)

    def checked(*flags: str) -> dict:
        assert main(["plan", "--check", str(path), "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    runtime, unfused, dropout = checked(), checked("--attention", "unfused"), checked("--dropout")
    assert unfused["step_time_s"] > runtime["step_time_s"]  # separate kernels over the whole s x s scores
    peak = [r["peak_memory_gib"] for r in runtime["replicas"]]
    assert all(d > r for d, r in zip((r["peak_memory_gib"] for r in dropout["replicas"]), peak))  # the masks kept
    # the same job as a plan of one group is priced by: each device group's cost model assembled alike
    from flexmesh.cost.training.mixed import MixedCosts
    from flexmesh.cost.training.parts import Parts
    from flexmesh.search.check import check_groups

    model, cluster = parse_model("llama2-7b"), parse_mixed_cluster("1x4xH100+1x4xA100-40GB")
    unfused_parts = Parts(stack=Stack(attention="unfused"))
    costs = MixedCosts(model, cluster, groups=[CostModel(model, g, parts=unfused_parts) for g in cluster.groups])
    # exact: the same plan priced by the same code
    assert check_groups(load_plan(path), model, cluster, costs).step_time == unfused["step_time_s"]


def test_a_middle_stage_of_no_layers_is_priced_as_a_relay_and_the_runtime_refuses_it(tmp_path):
    """AMP's published plans (2210.07297) hold a pipeline rank of no transformer layer between two others: plan
    --check prices it (its sends, no compute); the runtime, which trains no such rank, says so before it starts."""
    from flexmesh.report.plan_tables import group_compact
    from flexmesh.runtime.train.groups import check_runnable

    tp1 = ["tp1-dp1z0"] * 2
    plan = {"version": 5, "model": "tiny", "cluster": "1x4xH100+1x4xA100-40GB", "world_size": 8, "seq_len": 512,
            "global_batch": 8, "pipeline_schedule": "1f1b", "unused": [7],
            "groups": [{"ranks": ["0-3"], "share": 4, "num_microbatches": 1,
                        "stages": [{"layers": [0, 4], "strategies": ["tp1-dp4z0"] * 4}]},
                       # three pipeline ranks, the middle one holding no layer
                       {"ranks": ["4", "5", "6"], "share": 4, "num_microbatches": 2,
                        "stages": [{"layers": [0, 2], "strategies": tp1}, {"layers": [2, 2], "strategies": []},
                                   {"layers": [2, 4], "strategies": tp1}]}]}
    path = tmp_path / "groups.json"
    path.write_text(json.dumps(plan))
    assert main(["plan", "--check", str(path)]) == 0
    assert group_compact(load_plan(path).groups[1]) == "b4 m2 | [0,2) tp1 | [2,2) relay | [2,4) tp1"
    model, cluster = parse_model("tiny"), parse_mixed_cluster(plan["cluster"])
    ev = evaluate_groups(load_plan(path), MixedCosts(model, cluster))
    first, relay, last = ev.replicas[1].stages
    assert 0 < relay.time < min(first.time, last.time)  # its sends alone
    assert relay.memory["states"] == 0 and relay.memory["activations"] == 0
    with pytest.raises(PlanError, match="chunk 1 holds no layers between two others"):
        check_runnable(load_plan(path), model)
    # with a layer in it, the runtime takes the plan
    plan["groups"][1]["stages"][1:] = [{"layers": [2, 3], "strategies": tp1[:1]},
                                       {"layers": [3, 4], "strategies": tp1[:1]}]
    path.write_text(json.dumps(plan))
    check_runnable(load_plan(path), model)
    # a plan of one group the same
    st = LayerStrategy.parse("tp1-dp1z0")
    one = Plan.uniform("tiny", "3xA100-80GB", 3, 3, "1f1b", 1, 512, 3,
                       (StagePlan(0, 2, (st,) * 2), StagePlan(2, 2, ()), StagePlan(2, 4, (st,) * 2)))
    assert "[2,2) relay" in one.layout
    with pytest.raises(PlanError, match="chunk 1 holds no layers"):
        check_runnable(one, model)


def test_check_takes_a_group_whose_data_parallel_ranks_span_nodes():
    """A group of one device type over two nodes (dp across them, each TP group inside one node), as the
    mixed search's one-group-per-type plans are, is valid; a TP group across nodes is not."""
    from flexmesh.search.check import check_groups

    model, cluster = parse_model("llama2-7b"), parse_mixed_cluster("1x8xH100+2x8xA100-40GB")

    def group(ranks, strategy):
        return ReplicaGroup((tuple(ranks),), (StagePlan(0, 32, (LayerStrategy.parse(strategy),) * 32),), 4, 32)

    ok = Plan("llama2-7b", cluster.label, 24, 4096, 64, "1f1b", (group(range(8), "tp1-dp8z1"),
                                                                  group(range(8, 24), "tp2-dp8z2")))
    assert check_groups(ok, model, cluster).step_time > 0
    across = Plan("llama2-7b", cluster.label, 24, 4096, 64, "1f1b",
                  (group(range(8), "tp1-dp8z1"), group([*range(8, 15), *range(16, 23), 15, 23], "tp2-dp8z2")))
    with pytest.raises(PlanError, match=r"TP group on devices \[14, 16\] spans nodes \[1, 2\]"):
        check_groups(across, model, cluster)


def test_a_rank_named_twice_in_one_stage_and_a_bad_share_are_said_once():
    st = (StagePlan(0, 2, (LayerStrategy(dp=2),) * 2),)
    with pytest.raises(PlanError, match="rank 0 is twice in replica group 0 pipeline rank 0"):
        Plan("tiny", "cpu", 2, 64, 2, "1f1b", (ReplicaGroup(((0, 0),), st, 1, 2),))
    with pytest.raises(PlanError) as e:  # the group's name once, not "replica group 0: replica group 0 share"
        ReplicaGroup.from_dict({"ranks": [[0]], "share": 0,
                                "stages": [{"layers": [0, 2], "strategies": ["tp1-dp1z1"] * 2}]}, "replica group 0", 64)
    assert str(e.value).count("replica group 0") == 1, e.value
