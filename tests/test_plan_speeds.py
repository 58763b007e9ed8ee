"""`flexmesh plan` on a cluster file with `speed_factors`: the plan and every baseline priced on the
cluster as given, speeds included (one layout over all devices at its slowest device's pace)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from flexmesh.cli import main
from flexmesh.search import SearchRequest, best_plans
from flexmesh.spec import parse_cluster, parse_model

# The plans these tests check, not the policy `plan` recommends for them (its simulated steps: tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_recommendation")

ARGS = ["plan", "--model", "llama2-7b", "--seq-len", "2048", "--global-batch", "16", "--json"]


def _plan_json(capsys, tmp_path, name: str, speeds: list[float] | None) -> dict:
    f = tmp_path / f"{name}.json"
    d: dict = {"nodes": 1, "devices_per_node": 8, "device": "A100-80GB"}
    if speeds is not None:
        d["speed_factors"] = speeds
    f.write_text(json.dumps(d))
    assert main(ARGS + ["--cluster", str(f)]) == 0
    return json.loads(capsys.readouterr().out)


def test_one_slow_device_slows_every_baseline_and_the_plan_beats_them(capsys, tmp_path):
    healthy = _plan_json(capsys, tmp_path, "healthy", None)
    slow = _plan_json(capsys, tmp_path, "slow", [1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0])
    # Healthy: the uniform planner, its best plan at least as fast as its own baselines.
    fastest_healthy = healthy["best"]["tokens_per_s"]
    assert all(b["tokens_per_s"] <= fastest_healthy for b in healthy["baselines"].values())
    # One device at half speed: planned as replica groups, every baseline slower than on the healthy
    # cluster (a layout over all eight waits for the slow one), the plan no slower than any of them.
    assert set(slow["baselines"]) == {"uniform", "proportional", "sum_of_parts"}
    for name, b in slow["baselines"].items():
        assert b["tokens_per_s"] < fastest_healthy, name
        assert slow["ratios"][name] >= 1.0, name
    # the uniform baseline: one layout over all eight, so at half speed (compute: most of the step)
    assert slow["baselines"]["uniform"]["tokens_per_s"] < 0.6 * fastest_healthy


def test_devices_all_at_one_speed_are_priced_at_it(capsys, tmp_path):
    """A one-type cluster whose devices share one speed factor stays with the uniform planner, every
    plan and baseline priced at that speed (compute stretched, communication not)."""
    healthy = _plan_json(capsys, tmp_path, "healthy", None)
    half = _plan_json(capsys, tmp_path, "half", [0.5] * 8)
    assert set(half["baselines"]) == {"megatron-3d", "zero3-ulysses"}
    for name, b in half["baselines"].items():
        nominal = healthy["baselines"][name]["step_time_s"]
        assert nominal < b["step_time_s"] <= 2 * nominal
    assert healthy["best"]["step_time_s"] < half["best"]["step_time_s"] <= 2 * healthy["best"]["step_time_s"]


@pytest.mark.parametrize("slowest", [1.0, 0.5, 0.25])
def test_the_search_estimate_is_the_paced_evaluation(slowest):
    """The search's own figure equals the cost model's step at the cluster's pace."""
    cluster = replace(parse_cluster("4xA100-80GB"), speed_factors=(1.0, slowest, 1.0, 1.0))
    r = best_plans(SearchRequest(parse_model("llama2-7b"), cluster, 2048, 8, top=3))
    assert cluster.pace == slowest
    for c in r.plans:
        if c.origin == "search":
            assert c.estimate == pytest.approx(c.evaluation.step_time, rel=1e-9)
