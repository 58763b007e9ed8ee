"""Bad flags are one usage line from argparse (never a traceback, never a silent default), the demo's
training plan trains without its profiles, and error messages print literally (no rich markup)."""

from __future__ import annotations

import json
import os

import pytest

from flexmesh.cli import main


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return " ".join(err.split())


@pytest.mark.parametrize("argv,expect", [
    (["plan", "--top", "0"], "argument --top: must be a whole number >= 1, got '0'"),
    (["plan", "--seq-len", "0"], "argument --seq-len: must be a whole number >= 1"),
    (["plan", "--global-batch", "0"], "argument --global-batch: must be a whole number >= 1"),
    (["plan", "--global-batch", "2.5"], "argument --global-batch: must be a whole number >= 1, got '2.5'"),
    (["plan", "--tokens-per-batch", "0"], "argument --tokens-per-batch: must be a whole number >= 1"),
    (["plan", "--lengths", ""], "argument --lengths: must not be empty"),
    (["plan", "--cluster", ""], "argument --cluster: must not be empty"),
    (["simulate", "--model", "tiny", "--context", "128", "--cluster", ""], "argument --cluster: must not be empty"),
    (["simulate", "--model", "tiny", "--context", "128", "--global-batch", "0"], "argument --global-batch"),
    (["simulate", "--model", "tiny", "--context", "128", "--tokens-per-batch", "0"], "argument --tokens-per-batch"),
    (["simulate", "--model", "tiny", "--context", "0"], "argument --context"),
    (["simulate", "--model", "tiny", "--context", "128", "--seed", "-1"],
     "argument --seed: must be a whole number >= 0"),
    (["train", "--plan", "p", "--corpus", "c", "--out", "o", "--max-steps", "-3"], "argument --max-steps"),
    (["train", "--plan", "p", "--corpus", "c", "--out", "o", "--max-steps", "1", "--lr", "-1"],
     "argument --lr: must be a finite number > 0, got '-1'"),
    (["train", "--plan", "p", "--corpus", "c", "--out", "o", "--max-steps", "1", "--lr", "nan"], "argument --lr"),
    (["train", "--plan", "p", "--corpus", "c", "--out", "o", "--max-steps", "1", "--nproc", "0"], "argument --nproc"),
    (["train", "--plan", "p", "--corpus", "c", "--out", "o", "--max-steps", "1", "--global-batch", "0"],
     "argument --global-batch"),
    (["train", "--plan", "p", "--corpus", "c", "--out", "o", "--max-steps", "1", "--max-len", "0"],
     "argument --max-len"),
    (["train", "--plan", "p", "--corpus", "c", "--out", "o", "--max-steps", "1", "--min-lr-ratio", "2"],
     "argument --min-lr-ratio: must be a number in [0, 1]"),
    (["train", "--plan", "p", "--corpus", "c", "--out", "o", "--max-steps", "1", "--collective-timeout", "inf"],
     "argument --collective-timeout"),
    (["profile", "hardware", "--nproc", "0"], "argument --nproc"),
    (["demo", "--steps", "0"], "argument --steps"),
    (["export", "--checkpoint", "c", "--out", "o", "--max-shard-size", "0.1B"], "argument --max-shard-size"),
])
def test_bad_flags_are_one_usage_line(capsys, argv, expect):
    assert expect in _usage_error(capsys, argv)


def test_out_naming_the_wrong_kind_of_path(capsys, tmp_path):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    for argv in (["train", "--plan", "p", "--corpus", "c", "--max-steps", "1", "--out", str(existing)],
                 ["export", "--checkpoint", "c", "--out", str(existing)],
                 ["demo", "--out", str(existing)],
                 ["simulate", "--model", "tiny", "--context", "128", "--plots", str(existing)]):
        assert "is an existing file, not a folder" in _usage_error(capsys, argv)
    assert existing.read_text() == "keep me"
    for argv in (["plan", "--out", str(tmp_path)], ["profile", "hardware", "--out", str(tmp_path)]):
        assert "is a folder; give a file path" in _usage_error(capsys, argv)


def test_messages_print_literally(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no wrapping inside the path
    for name in ("[bold]x[/bold].json", "a[/]b.json"):
        assert main(["plan", "--check", str(tmp_path / name), "--model", "tiny", "--cluster", "2xA100-80GB"]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / name}' does not exist" in err


@pytest.fixture
def single_process_env():
    """``flexmesh train`` in this process: no torchrun variables before, none left after."""
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    yield
    for k in keys:
        os.environ.pop(k, None)
    os.environ.update(saved)


def test_a_plan_whose_cluster_prices_nothing_says_what_to_pass(capsys, tmp_path, single_process_env):
    from flexmesh.report.runs import training_plan

    plan = tmp_path / "plan.json"
    training_plan(1, 64, 2).save(plan)  # the cluster label "1xcpu" names no device preset
    rc = main(["train", "--plan", str(plan), "--corpus", str(tmp_path), "--max-steps", "1", "--out",
               str(tmp_path / "run")])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "records cluster '1xcpu', which prices nothing" in err and "--hardware-profile" in err


def _profiled_plan(tmp_path):
    """A one-rank plan of the demo's model priced by a made-up CPU hardware profile, and a small corpus."""
    from flexmesh.commands.demo import training_plan_file
    from flexmesh.profile import CollectiveFit, HardwareProfile

    hw = tmp_path / "profiles" / "hardware.json"
    HardwareProfile(device={"type": "cpu", "name": "test cpu", "nodes": 1, "devices_per_node": 1,
                            "memory_bytes": 8 * 2**30}, dtype="fp32", matmul_flops_per_s={"fp32": 4e10},
                    memory_bytes_per_s=8e9, attention={"fp32": {"flops_per_s": 1e10}},
                    collectives=[CollectiveFit("send_recv", 2, "intra", 4e-5, 5e-10)]).save(hw)
    plan = training_plan_file(tmp_path, hw, nproc=1, seq_len=64, global_batch=2)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "word " * (5 + 7 * i)}) + "\n" for i in range(8)))
    return plan, corpus


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_training_plan_trains_without_profiles(tmp_path):
    from helpers import flexmesh

    plan, corpus = _profiled_plan(tmp_path)
    assert json.loads(plan.read_text())["cluster"].endswith("cluster.json")
    out = tmp_path / "run"
    proc = flexmesh("train", "--plan", str(plan), "--corpus", str(corpus), "--max-steps", "1", "--out", str(out),
                    "--cache-dir", str(tmp_path / "cache"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["predicted_step_time_s"] > 0


def test_train_refuses_a_model_other_than_the_plans(capsys, tmp_path, single_process_env):
    from dataclasses import replace

    from flexmesh.report.runs import training_plan
    from flexmesh.spec import MODEL_PRESETS
    from flexmesh.spec.hf import to_hf_config

    plan = tmp_path / "plan.json"
    training_plan(1, 64, 2).save(plan)
    # as many layers as the plan's model, twice as wide
    wide = replace(MODEL_PRESETS[json.loads(plan.read_text())["model"]], hidden=512, ffn_hidden=1376)
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(wide)))
    rc = main(["train", "--plan", str(plan), "--model", str(tmp_path / "config.json"), "--corpus", str(tmp_path),
               "--max-steps", "1", "--out", str(tmp_path / "run")])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "plan was made for model 'tiny'" in err and "hidden 256 vs 512" in err


def test_json_nested_deeper_than_the_parser_goes_is_one_error(tmp_path):
    from flexmesh.errors import PlanError
    from flexmesh.layout.plan import Plan

    (tmp_path / "p.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PlanError, match="nested too deeply"):
        Plan.load(tmp_path / "p.json")


@pytest.mark.parametrize("command", ["plan", "simulate", "train", "export", "profile", "demo"])
def test_help_names_only_real_defaults(capsys, command):
    """No help line says ``(default: None)`` or an empty default, nor a default twice."""
    import re

    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in out and "(default: )" not in out
    assert not re.search(r"\(default[^)]*\) \(default", out)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("flexmesh ")


@pytest.mark.timeout(300)
def test_a_loss_that_is_not_finite_stops_the_run_before_it_is_saved(tmp_path, capsys, monkeypatch,
                                                                    single_process_env):
    import dataclasses

    from flexmesh.runtime.train.trainer import Trainer

    plan, corpus = _profiled_plan(tmp_path)
    step = Trainer.step

    def diverging(self, *a, **kw):  # the third step's loss overflows, as a too-high learning rate makes it
        m = step(self, *a, **kw)
        return dataclasses.replace(m, loss=float("nan")) if m.step == 3 else m

    monkeypatch.setattr(Trainer, "step", diverging)
    out = tmp_path / "run"
    rc = main(["train", "--plan", str(plan), "--corpus", str(corpus), "--max-steps", "5", "--out", str(out),
               "--cache-dir", str(tmp_path / "cache"), "--no-progress", "--checkpoint-every", "1"])
    said = " ".join(capsys.readouterr().err.split())
    assert rc == 1 and "step 3: the loss is nan, so the run stopped before saving it" in said, said
    assert f"{out / 'checkpoints' / 'step_000002'} is intact" in said and "lower --lr" in said
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]


@pytest.mark.parametrize("stray", [{"RANK": "0"}, {"RANK": "0", "WORLD_SIZE": "1"},
                                   {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "x"}])
def test_stray_launch_variables_are_one_line(tmp_path, capsys, monkeypatch, single_process_env, stray):
    from flexmesh.report.runs import training_plan

    plan = tmp_path / "plan.json"
    training_plan(1, 64, 2).save(plan)
    for k, v in stray.items():
        monkeypatch.setenv(k, v)
    rc = main(["train", "--plan", str(plan), "--corpus", str(tmp_path), "--max-steps", "1", "--out",
               str(tmp_path / "run")])
    said = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and "a process torchrun did not start, with variables left from another launch?" in said, said


@pytest.mark.parametrize("command", [["plan"], ["simulate"], ["serve", "simulate"], ["serve", "plan", "--rate", "1"],
                                     ["export", "--checkpoint", "c", "--out", "o"]])
def test_an_empty_model_is_refused_not_taken_for_the_default(command, capsys):
    from flexmesh.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--model", ""])
    assert "--model: must not be empty" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["serve", "run"], ["serve", "bench", "--rate", "1"], ["profile", "engine"]])
def test_an_engine_arg_for_the_transformers_engine_is_refused_not_ignored(command, capsys):
    assert main([*command, "--engine-arg=--enforce-eager"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --engine-arg adds words to a vLLM or SGLang command") and err.count("\n") == 1


@pytest.mark.parametrize("fleet", [["--backend", "http://127.0.0.1:9"], ["--router-config", "router.json"]])
def test_engines_beside_a_fleet_given_otherwise_is_refused_not_ignored(fleet, capsys):
    assert main(["serve", "run", *fleet, "--engines", "3"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --engines starts that many engines of the flags' knobs; {fleet[0]} gives the fleet " \
                  "itself: drop one of them\n"


@pytest.mark.parametrize("fleet", [["--backend", "http://127.0.0.1:9"], ["--router-config", "router.json"]])
@pytest.mark.parametrize("start", [["--engine-arg=--enforce-eager"], ["--engine-python", "/usr/bin/python3"]])
def test_engine_start_flags_beside_running_engines_are_refused_not_ignored(fleet, start, capsys):
    assert main(["serve", "run", "--engine", "vllm", *fleet, *start]) == 2
    err = capsys.readouterr().err
    flag = start[0].split("=")[0]
    assert err == f"error: {flag} shapes the engines flexmesh starts; {fleet[0]} fronts engines already running: " \
                  f"drop {flag} (give those flags to the engines where they start)\n"
