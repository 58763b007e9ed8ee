"""Plan files from the search: JSON round trip, atomic write, and --check on hand-edited plans."""

from __future__ import annotations

import json

import pytest

from flexmesh.cli import main
from flexmesh.cost.training.model import CostModel
from flexmesh.errors import PlanError
from flexmesh.layout.plan import Plan, StagePlan
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.search import SearchRequest, best_plans
from flexmesh.search.check import check_plan
from flexmesh.spec import MODEL_PRESETS, parse_cluster

MODEL, CLUSTER = MODEL_PRESETS["tiny"], parse_cluster("8xA100-80GB")


@pytest.fixture(scope="module")
def best() -> Plan:
    return best_plans(SearchRequest(MODEL, CLUSTER, 2048, 16, top=1, mode="fast")).best.plan


def test_round_trip_keeps_layout_and_prediction(best, tmp_path):
    f = tmp_path / "sub" / "plan.json"
    best.save(f)
    back = Plan.load(f)
    assert back == best and back.layout == best.layout  # exact: JSON keeps every float
    assert back.predicted["step_time_s"] == best.predicted["step_time_s"]  # exact: JSON keeps every float
    assert back.cost_source.startswith("preset:")
    assert not [p for p in f.parent.iterdir() if p.name.startswith(".")]  # no temporary file left behind
    ev = check_plan(back, MODEL, CLUSTER)
    assert ev.step_time == pytest.approx(best.predicted["step_time_s"], rel=1e-12)


def edited(plan: Plan, fn) -> dict:
    d = plan.to_dict()
    fn(d)
    return d


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["groups"][0]["stages"][-1].update(layers=[d["groups"][0]["stages"][-1]["layers"][0], 99]),
     "layers"),
    (lambda d: d.update(world_size=16), "devices"),
    (lambda d: d["groups"][0]["stages"][0].update(
        strategies=["tp3-dp1z0"] + d["groups"][0]["stages"][0]["strategies"][1:]), r"tp\*cp\*dp"),
])
def test_check_rejects_hand_edits_with_a_reason(best, edit, message):
    d = edited(best, edit)
    with pytest.raises(PlanError, match=message):
        plan = Plan.from_dict(d)
        check_plan(plan, MODEL, CLUSTER)


def test_check_names_wrong_device_count_per_layer(best):
    d = edited(best, lambda d: None)
    n = len(d["groups"][0]["stages"][0]["strategies"])
    d["groups"][0]["stages"][0]["strategies"] = ["tp1-dp1z0"] * n
    if best.stage_devices == 1:
        pytest.skip("best plan already uses one device per stage")
    with pytest.raises(PlanError, match="tp\\*cp\\*dp"):
        check_plan(Plan.from_dict(d), MODEL, CLUSTER)


def test_check_reports_memory_with_the_change_to_make(tmp_path):
    model, cluster = MODEL_PRESETS["llama2-13b"], parse_cluster("8xA100-40GB")
    strategies = ["tp1-dp8z0"] * model.num_layers  # 13B replicated 8 ways: ~18 B/param on every GPU
    d = {"version": 1, "model": model.name, "cluster": cluster.label, "world_size": 8, "pp": 1, "schedule": "1f1b",
         "num_microbatches": 1, "seq_len": 4096, "global_batch": 8,
         "stages": [{"layers": [0, model.num_layers], "strategies": strategies}]}
    f = tmp_path / "big.json"
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=r"plan needs [\d.]+ GiB on stage 0 but the device has [\d.]+ GiB.*raise pp"):
        check_plan(Plan.load(f), model, cluster, CostModel(model, cluster))
    assert main(["plan", "--check", str(f), "--model", "llama2-13b", "--cluster", "8xA100-40GB"]) == 2


def test_ulysses_needs_heads_to_split():
    model = MODEL_PRESETS["tiny"].__class__.from_dict({**MODEL_PRESETS["tiny"].to_dict(), "name": "h12",
                                                        "num_heads": 12, "num_kv_heads": 4, "hidden": 384})
    d = {"version": 1, "model": "h12", "cluster": CLUSTER.label, "world_size": 8, "pp": 1, "schedule": "1f1b",
         "num_microbatches": 1, "seq_len": 1024, "global_batch": 8,
         "stages": [{"layers": [0, model.num_layers], "strategies": ["tp1-u8-dp1z0"] * model.num_layers}]}
    with pytest.raises(PlanError, match="Ulysses needs the 12 heads"):
        check_plan(Plan.from_dict(d), model, CLUSTER)


def test_version_1_files_are_read_and_saved_as_version_5(tmp_path):
    """Version 2 renamed "schedule" to "pipeline_schedule", version 4 made the layout a list of replica
    groups, version 5 shows each group's micro-batch token budget; a version 1 file still loads unchanged."""
    layers = MODEL.num_layers
    old = {"version": 1, "model": MODEL.name, "cluster": CLUSTER.label, "world_size": 8, "pp": 2,
           "schedule": "interleaved", "virtual_stages": 2, "num_microbatches": 4, "seq_len": 1024, "global_batch": 8,
           "stages": [{"layers": [i, i + 1], "strategies": ["tp1-dp4z1"]} for i in range(layers)]}
    plan = Plan.from_dict(old)
    assert plan.pipeline_schedule == "interleaved" and plan.virtual_stages == 2 and plan.version == 1
    plan.save(tmp_path / "plan.json")
    new = json.loads((tmp_path / "plan.json").read_text())
    assert new["version"] == 5 and new["pipeline_schedule"] == "interleaved" and "schedule" not in new
    assert new["groups"][0]["virtual_stages"] == 2 and new["groups"][0]["ranks"] == ["0-3", "4-7"]
    assert new["groups"][0]["microbatch_tokens"] == 2 * 1024 // 4  # 8 / 4 sequences of 1024 over dp 4
    assert Plan.load(tmp_path / "plan.json") == plan
    with pytest.raises(PlanError, match="pipeline_schedule"):
        Plan.from_dict({k: v for k, v in new.items() if k != "pipeline_schedule"})
    with pytest.raises(PlanError, match="version 6 is not supported"):
        Plan.from_dict({**new, "version": 6})


def test_the_file_shows_the_token_budget_and_refuses_one_its_fields_do_not_give(best):
    """``microbatch_tokens`` is what the runtime packs to: written per group, checked when read, left out
    by version 4 (read as derived)."""
    d = best.to_dict()
    group = d["groups"][0]
    assert group["microbatch_tokens"] == best.microbatch_tokens == best.group.microbatch_tokens(best.seq_len)
    v4 = {**d, "version": 4, "groups": [{k: v for k, v in group.items() if k != "microbatch_tokens"}]}
    assert Plan.from_dict(v4) == best and Plan.from_dict(v4).version == 4  # exact: JSON keeps every float
    bad = {**d, "groups": [{**group, "microbatch_tokens": group["microbatch_tokens"] + 1}]}
    with pytest.raises(PlanError, match=r"replica group 0: microbatch_tokens \d+ is not the budget its fields give.*"
                                        "change num_microbatches, or drop microbatch_tokens"):
        Plan.from_dict(bad)
    # a hand edit of the micro-batch count without the budget is refused; with the budget dropped it is derived
    st = StagePlan(0, MODEL.num_layers, (LayerStrategy.parse("tp1-dp2z0"),) * MODEL.num_layers)
    two = Plan.uniform(MODEL.name, "2xA100-80GB", 2, 1, "1f1b", 2, 1024, 8, (st,)).to_dict()
    assert two["groups"][0]["microbatch_tokens"] == 8 // 2 * 1024 // 2
    edited = {**two, "groups": [{**two["groups"][0], "num_microbatches": 4}]}
    with pytest.raises(PlanError, match="microbatch_tokens 2048 is not the budget its fields give: 2 sequences per "
                                        "micro-batch .* of 1024 tokens over 2 data ranks, 1024"):
        Plan.from_dict(edited)
    edited["groups"][0].pop("microbatch_tokens")
    assert Plan.from_dict(edited).to_dict()["groups"][0]["microbatch_tokens"] == 1024
