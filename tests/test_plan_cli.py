"""`flexmesh plan`: table, --json, --explain, --out, --check and the messages for bad input."""

from __future__ import annotations

import json

import pytest

from flexmesh.cli import main
from flexmesh.layout.plan import Plan

# The plans these tests check, not the policy `plan` recommends for them (its simulated steps: tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_recommendation")

TINY = ["plan", "--model", "tiny", "--cluster", "8xA100-80GB", "--seq-len", "2048", "--global-batch", "16"]


def test_table_lists_plans_and_baselines(capsys):
    assert main(TINY + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "best plans" in out and "tokens/s" in out and "MFU" in out
    assert "baseline megatron-3d" in out and "baseline zero3-ulysses" in out


def test_a_baseline_without_a_layout_says_why(capsys):
    """127 sequences on 64 devices: no baseline layout splits them (flexmesh.search.uniform_baselines.Misses)."""
    args = ["plan", "--model", "tiny", "--cluster", "8x8xA100-80GB", "--seq-len", "256", "--global-batch", "127",
            "--top", "1"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "baseline megatron-3d: no layout of this family fits: the batch rules out" in out
    assert "baseline zero3-ulysses: no layout of this family fits: the batch rules out" in out
    assert "do not divide its 127 sequences" in out
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["baselines"] == {"megatron-3d": None, "zero3-ulysses": None}
    assert set(d["baselines_missing"]) == {"megatron-3d", "zero3-ulysses"}
    assert all(why.startswith("the batch rules out") for why in d["baselines_missing"].values())


def test_json_has_the_machine_fields(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    assert main(TINY + ["--json", "--out", str(out_file)]) == 0
    d = json.loads(capsys.readouterr().out)  # stdout is pure JSON
    assert d["search_seconds"] > 0
    best = d["best"]
    for key in ("step_time_s", "tokens_per_s", "mfu", "peak_memory_gib"):
        assert key in best
    assert len(best["peak_memory_gib"]) == len(best["plan"]["groups"][0]["ranks"])  # one per pipeline stage
    assert [p["step_time_s"] for p in d["plans"]] == sorted(p["step_time_s"] for p in d["plans"])
    saved = Plan.load(out_file)
    assert saved.layout == best["layout"]
    assert saved.predicted["step_time_s"] == pytest.approx(best["step_time_s"])


def test_explain_breaks_time_and_memory_down(capsys):
    assert main(TINY + ["--explain", "--top", "1"]) == 0
    out = capsys.readouterr().out
    for part in ("compute", "exposed communication", "pipeline bubble", "gradient sync", "states", "activations"):
        assert part in out


def test_explain_against_a_layout_compares_term_by_term(capsys, tmp_path, monkeypatch):
    from flexmesh.commands.plan_terms import plan_terms
    from flexmesh.cost import CostModel
    from flexmesh.layout.overlap import NO_OVERLAP
    from flexmesh.layout.plan import StagePlan
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.spec import parse_cluster, parse_model

    # a uniform layout with full recomputation and TP collectives exposed
    st = StagePlan(0, 4, (LayerStrategy.parse("tp2-dp4z1-ac"),) * 4)
    other = Plan.uniform("tiny", "8xA100-80GB", 8, 1, "1f1b", 2, 2048, 16, (st,), overlap=NO_OVERLAP)
    f = tmp_path / "published.json"
    other.save(f)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(TINY + ["--explain", "--top", "1", "--against", str(f)]) == 0
    out = capsys.readouterr().out
    assert "chosen plan against" in out and "speed-up of the chosen plan" in out
    terms = plan_terms(CostModel(parse_model("tiny"), parse_cluster("8xA100-80GB")), other)
    assert terms["recompute"] > 0 and terms["exposed TP/CP comm"] > 0
    row = next(line for line in out.splitlines() if line.replace("│", " ").split()[:1] == ["recompute"])
    assert f"{terms['recompute']:.4f}" in row
    assert sum(terms.values()) == pytest.approx(CostModel(parse_model("tiny"), parse_cluster("8xA100-80GB"))
                                                .evaluate(other).step_time)


def test_check_accepts_the_written_plan(capsys, tmp_path):
    f = tmp_path / "p.json"
    assert main(TINY + ["--out", str(f), "--top", "1"]) == 0
    capsys.readouterr()
    assert main(["plan", "--check", str(f), "--model", "tiny", "--cluster", "8xA100-80GB"]) == 0
    assert "valid" in capsys.readouterr().out


def test_unknown_preset_lists_the_known_ones(capsys):
    assert main(["plan", "--model", "llama9", "--cluster", "8xH100", "--seq-len", "8", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "unknown model" in err and "llama3-8b" in err and "Traceback" not in err
    assert main(["plan", "--model", "tiny", "--cluster", "8xB999", "--seq-len", "8", "--global-batch", "8"]) == 2
    assert "H100" in capsys.readouterr().err


def test_config_json_missing_a_field(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                               "intermediate_size": 128, "vocab_size": 100}))
    assert main(["plan", "--model", str(cfg), "--cluster", "8xH100", "--seq-len", "8", "--global-batch", "8"]) == 2
    assert "num_hidden_layers" in capsys.readouterr().err


def test_a_batch_no_layout_divides_names_the_nearest_that_does(capsys):
    """2 layers on 3 devices: no 3-stage pipeline, tp must divide the 8 heads, so dp is 3, which splits no batch
    of 8: the batch binds (memory is no question for this model), and 9 is the nearest count that splits."""
    assert main(["plan", "--model", "gpt:2:256:8", "--cluster", "3xA100-80GB", "--seq-len", "128",
                 "--global-batch", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("error: global batch 8 divides over no data-parallel degree that 3 devices leave")
    assert err.endswith("try --global-batch 9") and "memory" not in err
    assert main(["plan", "--model", "gpt:2:256:8", "--cluster", "3xA100-80GB", "--seq-len", "128",
                 "--global-batch", "9", "--top", "1"]) == 0  # what the error says fits


def test_no_plan_fits_says_what_would(capsys):
    args = ["plan", "--model", "llama2-7b", "--cluster", "8xA100-40GB", "--seq-len", "65536", "--global-batch", "8",
            "--no-recompute"]
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: no plan of llama2-7b fits on 8xA100-40GB at seq len 65536, global batch 8: memory "
                          "rules out")
    assert "smallest change that fits: enable recomputation" in err


def test_where_memory_binds_the_error_leads_with_it(capsys):
    """A 70B model on two 40 GB devices: every layout is over memory, the batch rules none out; no batch is
    suggested and the least peak is named against the usable memory."""
    assert main(["plan", "--model", "llama2-70b", "--cluster", "2xA100-40GB", "--seq-len", "4096",
                 "--global-batch", "8"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: no plan of llama2-70b fits on 2xA100-40GB at seq len 4096, global batch 8: memory "
                          "rules out")
    assert "GiB usable per A100-40GB (40 GiB)" in err and "the batch" not in err and "--global-batch" not in err
    assert "use a larger device or a smaller model" in err


def test_built_in_defaults_plan_llama3_8b_on_8_h100(capsys):
    assert main(["plan", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = out["best"]
    assert best["plan"]["model"] == "llama3-8b" and best["plan"]["world_size"] == 8
    assert best["plan"]["seq_len"] == 8192 and best["plan"]["global_batch"] == 128


def test_explain_names_the_framework_terms_a_model_profile_measured():
    from helpers import flat_model_profile

    from flexmesh.commands.plan_output import framework_terms
    from flexmesh.cost import CostModel
    from flexmesh.profile import ProfiledTiming
    from flexmesh.spec import MODEL_PRESETS, parse_cluster

    mp = flat_model_profile(whole_model={"forward": 1.25, "forward_fixed_s": 0.004, "backward": 1.1,
                                         "backward_fixed_s": 0.0065}, name="m.json")
    profiled = CostModel(MODEL_PRESETS["tiny"], parse_cluster("2xA100-80GB"), timing=ProfiledTiming(mp))
    line = framework_terms(profiled)
    assert "forward 1.25x its layers + 4.00 ms, backward 1.10x + 6.50 ms per micro-batch" in line
    assert "no fixed cost per pipeline stage (the profile predates its measurement" in line
    mp.pipeline = {"stages": [1, 2, 4], "stage_fixed_s": 0.0009}
    assert "; 0.90 ms per pipeline chunk per micro-batch" in framework_terms(profiled)
    assert "no fixed cost" in framework_terms(CostModel(MODEL_PRESETS["tiny"], parse_cluster("2xA100-80GB")))


def test_virtual_stages_set_the_chunks_per_rank_tried(capsys):
    # tiny's 4 layers over pp 2 in 3 chunks per rank: 6 chunks, the first and last the embedding and head alone
    base = ["plan", "--model", "tiny", "--cluster", "2xA100-80GB", "--seq-len", "1024", "--global-batch", "8",
            "--pipeline-schedules", "interleaved", "--json"]
    assert main(base + ["--virtual-stages", "3"]) == 0
    searched = [p for p in json.loads(capsys.readouterr().out)["plans"] if p["origin"] == "search"]
    assert searched  # the uniform baselines (pp 1) rank beside them
    for p in searched:
        assert p["layout"].startswith("pp2 interleavedx3") and "[0,0) embedding" in p["layout"]
        assert p["layout"].endswith("[4,4) head")
    with pytest.raises(SystemExit):
        main(base + ["--virtual-stages", "1,2"])
    assert "chunks per rank must be whole numbers >= 2" in capsys.readouterr().err
