"""`flexmesh plan --lengths` and `--tokens-per-batch`: plans ranked by their expected step on the data's
length mix (the simulator's mean under the plan's default policy), which `simulate --plan` reproduces."""

from __future__ import annotations

import json

import numpy as np
import pytest

from flexmesh.cli import main
from flexmesh.commands.plan_lengths import SEED, STEPS
from flexmesh.layout.plan import load_plan


@pytest.fixture
def lengths_file(tmp_path):
    """400 document lengths, log-normal around 900 tokens; 7.5% longer than the 2048-token cap."""
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(6.5, 1.0, 400).astype(int), 1, 6000)
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(map(str, lengths)))
    return f


def _err(capsys) -> str:
    """stderr with the console's line breaks undone."""
    return " ".join(capsys.readouterr().err.split())


def _run_json(capsys, argv: list[str]) -> dict:
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _simulate(capsys, plan, lengths, gb: int) -> dict:
    args = ["simulate", "--plan", str(plan), "--context", "2048", "--lengths", str(lengths), "--global-batch", str(gb),
            "--steps", str(STEPS), "--seed", str(SEED), "--policies", "hdp"]
    return _run_json(capsys, args)


def test_the_reported_step_is_the_simulated_mean_that_simulate_plan_reproduces(capsys, tmp_path, lengths_file,
                                                                             no_recommendation):
    out = tmp_path / "plan.json"
    d = _run_json(capsys, ["plan", "--model", "llama2-7b", "--cluster", "8xA100-80GB", "--seq-len", "2048",
                           "--global-batch", "64", "--lengths", str(lengths_file), "--out", str(out)])
    best, work = d["best"], d["workload"]
    assert work["lengths"] == str(lengths_file) and work["steps"] == STEPS and work["seed"] == SEED
    assert work["mean_sequences_per_step"] == 64 and work["mean_tokens_per_step"] < 64 * 2048
    # the plans are ranked by their expected step, each beside the cost model's figure at the cap
    assert [p["step_time_s"] for p in d["plans"]] == sorted(p["step_time_s"] for p in d["plans"])
    assert best["policy"] == "fixed" and best["step_time_s"] < best["fixed_length_step_time_s"]
    plan = load_plan(out)
    recorded = plan.predicted["lengths"]
    assert recorded["step_time_s"] == best["step_time_s"] == pytest.approx(np.mean(recorded["step_times_s"]))
    # simulate --plan on the same lengths and seed: the plan's own layout as it trains (fixed packing at the
    # runtime's degree, cp=1, into the plan's micro-batches of 4096 tokens per rank: 16 sequences of 2048 per data
    # rank in 8 micro-batches) is the same schedule, simulated the same way
    sim = _simulate(capsys, out, lengths_file, 64)
    assert plan.microbatch_tokens == 4096
    assert sim["setup"]["plan_step"]["simulated_step_s"] == pytest.approx(best["step_time_s"], rel=1e-9)
    # the fixed baseline packs slots of --context (2048) tokens: twice the micro-batches, each kernel's fixed cost
    # paid twice as often
    fixed = next(r for r in sim["policies"] if r["policy"] == "fixed")
    assert fixed["mean_step_time_s"] > best["step_time_s"]


def test_a_mixed_cluster_plan_is_the_shares_row_of_simulate_plan(capsys, tmp_path, lengths_file, no_recommendation):
    out = tmp_path / "mixed.json"
    d = _run_json(capsys, ["plan", "--model", "llama2-7b", "--cluster", "1x4xH100+1x4xA100-40GB", "--seq-len",
                           "2048", "--global-batch", "32", "--lengths", str(lengths_file), "--out", str(out)])
    assert d["best"]["policy"] == "shares" and len(load_plan(out).groups) > 1
    sim = _simulate(capsys, out, lengths_file, 32)
    shares = next(r for r in sim["schedules"] if r["schedule"] == "shares")
    assert shares["mean_step_time_s"] == pytest.approx(d["best"]["step_time_s"], rel=1e-9)
    # every baseline scored on the same batches, the cost model's figure at the cap kept beside
    for name in ("uniform", "proportional"):
        b = d["baselines"][name]
        assert b["tokens_per_s"] != b["fixed_length_tokens_per_s"]
        assert d["ratios"][name] == pytest.approx(d["best"]["tokens_per_s"] / b["tokens_per_s"])
    parts = d["baselines"]["sum_of_parts"]
    assert parts["tokens_per_s"] == pytest.approx(sum(p["tokens_per_s"] for p in parts["parts"]))


def test_a_bad_lengths_file_is_refused_with_what_is_wrong(capsys, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("100\n2.5\n300\n")
    base = ["plan", "--model", "tiny", "--cluster", "8xA100-80GB", "--seq-len", "2048"]
    assert main(base + ["--lengths", str(bad)]) == 2
    err = _err(capsys)
    assert "--lengths" in err and "line 2" in err and "'2.5' is not a whole number" in err
    assert main(base + ["--lengths", str(tmp_path / "missing.txt")]) == 2
    assert "unknown lengths" in _err(capsys)
    assert main(base + ["--check", str(bad), "--lengths", "wikipedia"]) == 2
    assert "--check validates a plan file as it is" in _err(capsys)


def test_tokens_per_batch_counts_a_step_in_tokens(capsys, tmp_path, lengths_file, no_recommendation):
    base = ["plan", "--model", "tiny", "--cluster", "8xA100-80GB", "--seq-len", "2048", "--top", "1"]
    # without --lengths: as many --seq-len sequences as the tokens hold, said under the table
    out = tmp_path / "plan.json"
    assert main(base + ["--tokens-per-batch", "32768", "--out", str(out)]) == 0
    assert "planned for 32,768 tokens per step (16 sequences of 2048)" in " ".join(capsys.readouterr().out.split())
    assert load_plan(out).global_batch == 16
    # with --lengths: batches of that many tokens, the plan sized for the same tokens at the cap
    d = _run_json(capsys, base + ["--tokens-per-batch", "32768", "--lengths", str(lengths_file)])
    assert d["workload"]["tokens_per_batch"] == 32768 and d["workload"]["global_batch"] == 16
    tokens, seqs = d["workload"]["mean_tokens_per_step"], d["workload"]["mean_sequences_per_step"]
    assert 30000 < tokens <= 32768 and seqs > 16  # short documents: more of them than of --seq-len
    assert main(base + ["--tokens-per-batch", "1000"]) == 2  # not one sequence of --seq-len
    assert "holds no sequence of --seq-len 2048" in _err(capsys)
    with pytest.raises(SystemExit):  # argparse: one batch size or the other
        main(base + ["--tokens-per-batch", "32768", "--global-batch", "16"])
    capsys.readouterr()
    mixed = ["plan", "--model", "llama2-7b", "--cluster", "1x4xH100+1x4xA100-40GB", "--seq-len", "2048"]
    assert main(mixed + ["--tokens-per-batch", "65536", "--lengths", str(lengths_file)]) == 2
    assert "give --global-batch" in _err(capsys)


def test_tokens_per_batch_takes_a_count_that_data_parallelism_divides(capsys, tmp_path, no_recommendation):
    """32,512 tokens are 127 sequences of 256: prime, so no data-parallel degree above 1 splits them; the
    plan takes 128 (within 2%), which splits over all 8 devices, says so, and trains faster. --global-batch
    keeps its exact count."""
    base = ["plan", "--model", "tiny", "--cluster", "8xA100-80GB", "--seq-len", "256", "--top", "1"]
    out = tmp_path / "plan.json"
    assert main(base + ["--tokens-per-batch", "32512", "--out", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "32,512 tokens per step -> 128 sequences of 256, not 127: 128 splits over up to 8 data-parallel ranks " \
           "of the 8 devices, 127 over 1" in printed and "--global-batch 127 keeps the exact count" in printed
    assert load_plan(out).global_batch == 128
    moved = _run_json(capsys, base + ["--tokens-per-batch", "32512"])
    assert moved["workload"]["global_batch"] == 128 and moved["workload"]["exact_global_batch"] == 127
    exact = _run_json(capsys, base + ["--global-batch", "127"])
    assert exact["workload"]["global_batch"] == 127 and "exact_global_batch" not in exact["workload"]
    assert moved["best"]["tokens_per_s"] > 1.2 * exact["best"]["tokens_per_s"]
    # a count that already splits over every device stays as it is, and nothing is said
    assert main(base + ["--tokens-per-batch", str(120 * 256)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "(120 sequences of 256)" in printed and "->" not in printed


def test_a_plan_mixing_meshes_in_one_group_is_left_out_of_the_ranking():
    """The search may price layers of one group on different meshes; the runtime's scheduler cannot take
    them (flexmesh.layout.mesh.group_layout), so --lengths scores the rest instead of failing."""
    from flexmesh.commands.plan_lengths import PlanWorkload, score_plan
    from flexmesh.cost import CostModel
    from flexmesh.cost.training.mixed import MixedCosts
    from flexmesh.layout import LayerStrategy
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.spec import parse_cluster, parse_model
    from flexmesh.spec.cluster import MixedCluster

    model, cluster = parse_model("tiny"), parse_cluster("4xA100-80GB")
    cost = CostModel(model, cluster)
    costs = MixedCosts(model, MixedCluster((cluster,)), groups=[cost])
    work = PlanWorkload(512, 8, lengths="lengths.txt", batches=[np.full(8, 300)])

    def plan(*strategies: str) -> Plan:
        st = StagePlan(0, 4, tuple(LayerStrategy.parse(s) for s in strategies))
        return Plan.uniform(model="tiny", cluster="4xA100-80GB", world_size=4, pp=1, pipeline_schedule="1f1b",
                            virtual_stages=1, num_microbatches=1, seq_len=512, global_batch=8, stages=(st,))

    assert score_plan(plan(*["tp2-dp2z1"] * 4), model, costs, work) is not None
    assert score_plan(plan("tp2-dp2z1", "tp2-dp2z1", "tp1-dp4z2", "tp1-dp4z2"), model, costs, work) is None


@pytest.mark.parametrize("flag", [["--global-batch", "999"], ["--seq-len", "4096"], ["--top", "3"]])
def test_check_refuses_the_search_flags_it_would_ignore(capsys, tmp_path, flag):
    plan = tmp_path / "plan.json"
    base = ["plan", "--model", "tiny", "--cluster", "8xA100-80GB"]
    assert main([*base, "--seq-len", "2048", "--global-batch", "16", "--no-recommend", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main([*base, "--check", str(plan)]) == 0
    capsys.readouterr()
    assert main([*base, "--check", str(plan), *flag]) == 2
    assert f"{flag[0]} steers a new search: drop it" in _err(capsys)
