"""`flexmesh plan` ends with the policy recommendation `simulate --plan` prints for the plan it writes, and
gives it as the `recommendation` object of `--json` (docs/cli.md, docs/simulate-output.md)."""

from __future__ import annotations

import json

import pytest

from flexmesh.cli import main

CASES = {
    # one device type: simulate's default --policies against the baselines (steps of seconds, so no policy's
    # scheduler is slower than the step, which would leave it out on a loaded machine)
    "uniform": (["--model", "llama2-7b", "--cluster", "8xA100-80GB", "--seq-len", "4096", "--global-batch", "32"],
                []),
    # a mixed cluster: the planned shares against each step dispatched by the policies train chooses among
    "groups": (["--model", "tiny", "--cluster", "1xH100+2xA100-40GB", "--seq-len", "2048", "--global-batch", "16"],
               ["--policies", "balanced,hdp"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_plan_recommends_what_simulate_recommends_for_the_written_plan(capsys, tmp_path, case):
    flags, policies = CASES[case]
    out_file = tmp_path / "plan.json"
    assert main(["plan", *flags, "--json", "--out", str(out_file)]) == 0
    planned = json.loads(capsys.readouterr().out)["recommendation"]
    assert main(["simulate", "--plan", str(out_file), "--steps", "4", "--seed", "0", *policies, "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out)["recommendation"]
    computed_on = planned.pop("computed_on")
    assert planned == simulated  # exact: the same simulation of the same plan and batches
    assert computed_on.startswith("on 4 steps of wikipedia lengths up to ") and "--steps 4" in computed_on
    assert main(["plan", *flags]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("recommended: ")] == [f"{planned['line']} ({computed_on})"]


def test_plan_recommends_on_the_lengths_it_planned_for(capsys):
    flags = ["plan", "--model", "llama2-7b", "--cluster", "8xA100-80GB", "--seq-len", "4096", "--global-batch", "32",
             "--lengths", "prolong", "--json"]
    assert main(flags) == 0
    rec = json.loads(capsys.readouterr().out)["recommendation"]
    assert rec["computed_on"].startswith("on 4 steps of prolong lengths up to 4096 tokens")
    assert rec["against"] == "fixed" and rec["line"].startswith("recommended: ")


def test_plan_recommends_unasked_only_on_steps_of_few_sequences(capsys, monkeypatch):
    """A step of more sequences than plan.RECOMMEND_SEQUENCES is not simulated unless --recommend asks; the
    line says so and how to ask; --no-recommend leaves out even a small step's; the last line times the
    phases."""
    from flexmesh.commands import plan as plan_command

    monkeypatch.setattr(plan_command, "RECOMMEND_SEQUENCES", 16)  # the tiny model's 32 sequences a step are many
    flags = ["plan", "--model", "tiny", "--cluster", "2xA100-80GB", "--seq-len", "1024", "--global-batch", "32"]
    assert main(flags) == 0
    lines = capsys.readouterr().out.splitlines()
    skipped = [ln for ln in lines if ln.startswith("policy not recommended")]
    assert len(skipped) == 1 and "--recommend computes it" in skipped[0] and "sequences" in skipped[0]
    assert not any(ln.startswith("recommended: ") for ln in lines)
    assert lines[-1].startswith("took ") and "search " in lines[-1] and "recommendation" not in lines[-1]
    assert main([*flags, "--recommend"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(ln.startswith("recommended: ") for ln in lines) == 1 and "recommendation " in lines[-1]
    monkeypatch.setattr(plan_command, "RECOMMEND_SEQUENCES", 512)
    assert main([*flags, "--no-recommend", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommendation"] is None and out["recommendation_seconds"] == 0.0
