"""`flexmesh simulate`: smoke tests on a small cluster with few steps."""

from __future__ import annotations

import json

import pytest

from flexmesh.cli import main

BASE = ["simulate", "--model", "llama2-7b", "--cluster", "2x8xA100-80GB", "--context", "32768",
        "--global-batch", "48", "--steps", "2", "--seed", "1"]


@pytest.mark.slow
def test_json_output_has_every_baseline_and_speedups_are_over_the_best(capsys, tmp_path):
    assert main(BASE + ["--policies", "fixed,hdp", "--json", "--plots", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    runs = {r["policy"]: r for r in out["policies"]}
    assert list(runs) == ["fixed", "padded", "balanced", "wlb", "hdp"]  # baselines always run, first
    assert {r["kind"] for p, r in runs.items() if p != "hdp"} == {"baseline"} and runs["hdp"]["kind"] == "adaptive"
    for name in ("fixed", "padded", "balanced", "wlb"):
        assert runs[name]["label"] == f"{name} (cp={runs[name]['options']['cp']})"
    best = max((r for r in runs.values() if r["kind"] == "baseline"), key=lambda r: r["tokens_per_s"])
    assert best["speedup_vs_best_baseline"] == 1.0
    # exact: the best baseline's own figures, copied
    assert out["setup"]["best_baseline"] == {"label": best["label"], "tokens_per_s": best["tokens_per_s"],
                                             "ratio_to_lower_bound": best["ratio_to_lower_bound"]}
    assert runs["fixed"]["tokens_per_s"] >= runs["padded"]["tokens_per_s"]  # packing beats padding
    for r in runs.values():
        assert r["steps"] == 2 and r["mean_step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert r["imbalance"] >= 1.0 and 0 < r["utilisation"] <= 1
        assert r["ratio_to_lower_bound"] >= 1.0 - 1e-9
        assert r["speedup_vs_best_baseline"] == pytest.approx(r["tokens_per_s"] / best["tokens_per_s"])
    assert out["setup"]["data_ranks"] == 16
    rec = out["recommendation"]  # the line the table ends with, as an object (docs/simulate-output.md)
    fastest = max((r for r in runs.values() if r["label"] not in rec["left_out"]), key=lambda r: r["tokens_per_s"])
    assert rec["against"] == "fixed" and rec["line"].startswith("recommended: ")
    if rec["policy"] != "fixed":
        assert rec["schedule"] == fastest["label"] and rec["policy"] == fastest["policy"]
        assert rec["speedup"] == pytest.approx(fastest["tokens_per_s"] / runs["fixed"]["tokens_per_s"])
    else:
        assert rec["speedup"] == 1.0 and fastest["tokens_per_s"] <= 1.02 * runs["fixed"]["tokens_per_s"]
    for files in out["plots"].values():
        for f in files:
            assert open(f, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def hdp_runs():
    """The runs of ``BASE --policies hdp --json`` by policy, and the command's context, speeds and batches
    rebuilt through the library: the same for each baseline (the command is seeded), so made once."""
    import argparse
    import contextlib
    import io
    import itertools

    from flexmesh.commands.simulate import add_parser, build_context
    from flexmesh.data.lengths import BatchSampler, load_lengths

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(BASE + ["--policies", "hdp", "--json"]) == 0
    runs = {r["policy"]: r for r in json.loads(out.getvalue())["policies"]}
    p = argparse.ArgumentParser()
    args = add_parser(p.add_subparsers()).parse_args(BASE[1:])
    ctx, speeds = build_context(args)
    batches = list(itertools.islice(BatchSampler(load_lengths("wikipedia"), 1, seqs_per_batch=48, max_len=32768), 2))
    return runs, ctx, speeds, batches


@pytest.mark.parametrize("policy", ["fixed", "padded", "balanced", "wlb"])
def test_each_baseline_keeps_its_fastest_degree(hdp_runs, policy):
    runs, ctx, speeds, batches = hdp_runs
    best = runs[policy]
    # Re-run each degree through the library and check none beats the kept one.
    from flexmesh.sim.compare import baseline_options, run_policy

    longest = max(int(b.max()) for b in batches)
    slot = {"slot_tokens": 32768} if policy == "padded" else {}
    times = [run_policy(policy, batches, ctx, seed=1, options=o, speed=speeds, **slot).mean_step_time
             for o in baseline_options(policy, ctx, 32768, longest)]
    assert best["mean_step_time_s"] == pytest.approx(min(times))


def test_table_output_and_pipeline_flags(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert main(BASE + ["--policies", "hdp", "--pp", "2", "--pipeline-schedule", "gpipe"]) == 0
    out = capsys.readouterr().out
    assert "hdp" in out and "tokens/s" in out and "8 data ranks" in out
    assert "over the best baseline" in out and "the lower bound" in out


def test_slow_device_lowers_throughput(capsys):
    assert main(BASE + ["--policies", "hdp", "--json"]) == 0
    nominal = json.loads(capsys.readouterr().out)["policies"][0]
    assert main(BASE + ["--policies", "hdp", "--json", "--slow", "3=0.5"]) == 0
    slowed = json.loads(capsys.readouterr().out)["policies"][0]
    assert slowed["tokens_per_s"] < nominal["tokens_per_s"]


@pytest.mark.parametrize("extra,needle", [
    (["--tp", "3"], "divisible"),
    (["--slow", "99=0.5"], "--slow names rank 99, but there are ranks 0 to"),
    (["--lengths", "no-such-dist"], "unknown lengths"),
    (["--policies", "nope"], "unknown scheduling policy"),
    (["--virtual-stages", "2"], "--pp > 1"),
    # more pipeline chunks than the model has layers (priced as one layer each before)
    (["--model", "gpt:1:256:8", "--pp", "2"], "2 pipeline chunks but gpt-1x256x8 has 1 layer;"),
])
def test_bad_flags_exit_2_with_a_message(capsys, extra, needle):
    assert main(BASE + ["--policies", "hdp"] + extra) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("flags", [
    # a 1F1B pipeline, which the closed form prices as the simulation runs it (an interleaved plan's chunks
    # of unequal time, the embedding's and the head's, take the simulation ~3% past the closed form)
    ["--model", "llama2-70b", "--cluster", "4x8xA100-80GB", "--seq-len", "4096", "--global-batch", "64",
     "--pipeline-schedules", "1f1b"],
    ["--model", "llama3-8b", "--cluster", "2x8xH100", "--seq-len", "65536", "--global-batch", "32"],  # Ulysses 2
])
def test_simulate_plan_fed_its_own_length_reproduces_the_predicted_step(tmp_path, capsys, flags):
    plan = tmp_path / "plan.json"
    assert main(["plan", *flags, "--top", "1", "--out", str(plan), "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["best"]["step_time_s"]
    lengths = tmp_path / "lengths.txt"
    lengths.write_text(flags[flags.index("--seq-len") + 1] + "\n")
    assert main(["simulate", "--plan", str(plan), "--lengths", str(lengths), "--steps", "1", "--policies", "hdp",
                 "--json"]) == 0
    own = json.loads(capsys.readouterr().out)["setup"]["plan_step"]
    assert own["predicted_step_s"] == pytest.approx(predicted)
    assert own["simulated_step_s"] == pytest.approx(predicted, rel=0.01)


@pytest.mark.parametrize("schedule,v", [("1f1b", 2), ("interleaved", 8)])
def test_simulate_plan_prices_each_stage_with_its_own_layers(tmp_path, capsys, schedule, v):
    """30 layers over 4 stages: 7, 8, 8, 7 under 1F1B; interleaved, 32 chunks of one layer but the first
    and last (the embedding and the head alone). The simulation runs each chunk's own layers, not
    ceil(30 / 4) on every stage (which took it ~11% past the predicted step)."""
    from flexmesh.search import SearchRequest, SearchSpace, best_plans
    from flexmesh.spec import parse_cluster, parse_model

    model = "gpt:30:4096:32"
    space = SearchSpace(pp=(4,), pipeline_schedules=(schedule,), virtual_stages=(v,), same_mesh=True)
    best = best_plans(SearchRequest(parse_model(model), parse_cluster("2x8xA100-80GB"), 4096, 64, space=space,
                                    mode="fast", top=1), with_baselines=False).best
    assert len({st.num_layers for st in best.plan.group.stages}) > 1, best.plan.layout  # an uneven split
    plan, lengths = tmp_path / "plan.json", tmp_path / "lengths.txt"
    best.plan.save(plan)
    lengths.write_text("4096\n")
    assert main(["simulate", "--plan", str(plan), "--model", model, "--lengths", str(lengths), "--steps", "1",
                 "--policies", "hdp", "--json"]) == 0
    own = json.loads(capsys.readouterr().out)["setup"]["plan_step"]
    assert own["simulated_step_s"] == pytest.approx(best.evaluation.step_time, rel=0.01)


@pytest.mark.parametrize("flag", [["--tp", "2"], ["--no-recompute"], ["--pp", "1"]])
def test_a_layout_flag_beside_a_plan_is_refused_not_ignored(tmp_path, capsys, flag):
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "tiny", "--cluster", "8xH100", "--seq-len", "2048", "--global-batch", "16",
                 "--no-recommend", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--plan", str(plan), "--steps", "1", *flag]) == 2
    assert "with --plan the plan's layout holds: drop it, or drop --plan" in capsys.readouterr().err
