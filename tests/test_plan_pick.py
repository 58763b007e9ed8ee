"""`flexmesh plan` echoes the model it parsed, and `--pick N` writes and explains the N-th plan of its list."""

from __future__ import annotations

import json

import pytest

from flexmesh.cli import main
from flexmesh.layout.plan import load_plan

BASE = ["plan", "--model", "llama2-7b", "--cluster", "8xA100-80GB", "--seq-len", "4096", "--global-batch", "64"]


@pytest.fixture
def recommendation_off(monkeypatch):
    """Call to leave out plan's policy recommendation (its simulated steps: half of a plan's time here) from
    the calls after a test's first, which runs it; tests/test_plan_recommendation.py checks what it says."""
    from flexmesh.commands import plan as plan_command

    return lambda: monkeypatch.setattr(plan_command, "_recommended",
                                       lambda plan, job, work, asked: plan_command.Recommended(None, ""))


@pytest.fixture
def search_once(monkeypatch):
    """plan's search (flexmesh.search.best_plans: deterministic, its result never changed after) run once per
    request within a test: the test's later commands, which differ in what they do with the list (pick,
    write, show), reuse the list the first one searched."""
    from dataclasses import replace

    from flexmesh.commands import plan as plan_command

    found: dict = {}
    real = plan_command.best_plans

    def best_plans(request, **kw):
        key = replace(request, cost=None)  # a fresh cost model per command, built from the same job
        if key not in found:
            found[key] = real(request, **kw)
        return found[key]

    monkeypatch.setattr(plan_command, "best_plans", best_plans)


@pytest.mark.slow
def test_pick_writes_the_nth_plan_of_the_list(capsys, tmp_path, recommendation_off, search_once):
    assert main(BASE + ["--top", "3", "--json"]) == 0
    listed = [row["layout"] for row in json.loads(capsys.readouterr().out)["plans"]]
    recommendation_off()
    assert len(set(listed)) == 3
    for n in (1, 3):
        out = tmp_path / f"p{n}.json"
        assert main(BASE + ["--top", "3", "--pick", str(n), "--out", str(out), "--explain"]) == 0
        text = capsys.readouterr().out
        assert load_plan(out).layout == listed[n - 1]
        assert ("wrote the best plan" if n == 1 else "wrote plan 3 of the list") in " ".join(text.split())
    assert main(BASE + ["--top", "2", "--pick", "3", "--json"]) == 0  # the list grows to hold the pick
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["plans"]) == 3 and doc["picked"]["rank"] == 3 and doc["picked"]["layout"] == listed[2]
    assert doc["best"]["layout"] == listed[0]


def test_a_pick_past_the_plans_that_fit_is_one_line(capsys):
    argv = ["plan", "--model", "tiny", "--cluster", "1xH100", "--seq-len", "1024", "--global-batch", "2",
            "--pick", "5000"]
    assert main(argv) == 2
    assert "--pick 5000: the search found" in capsys.readouterr().err


def test_plan_echoes_the_model_it_parsed(capsys, no_recommendation):
    assert main(BASE + ["--top", "1"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "llama2-7b: 6.74B parameters, 32 layers, hidden 4096, 32 heads (32 KV), vocab 32,000, untied" in text


@pytest.mark.parametrize("name", ["8xh100", "8XH100", "8xH100-sxm"])
def test_plan_takes_device_names_in_any_case(capsys, name, no_recommendation):
    assert main(["plan", "--model", "tiny", "--cluster", name, "--seq-len", "1024", "--top", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["best"]["plan"]["cluster"] == "8xH100-80GB"


@pytest.mark.slow
def test_a_baseline_the_runtime_cannot_run_is_shown_never_ranked(capsys, recommendation_off, search_once):
    argv = ["plan", "--model", "mixtral-8x7b", "--cluster", "2x8xH100", "--seq-len", "4096", "--global-batch", "64",
            "--top", "20"]
    assert main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    recommendation_off()
    assert doc["baselines"]["megatron-3d"] is not None  # priced, and shown
    assert all(row["origin"] != "megatron-3d" for row in doc["plans"])  # never what plan writes or train runs
    assert main(argv) == 0
    assert "megatron-3d (whole experts over expert-parallel ranks" in " ".join(capsys.readouterr().out.split())
