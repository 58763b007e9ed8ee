"""A plan made from a config.json records the file (absolute path, sha256) and finds its model again.

`flexmesh train`, `simulate` and `plan --check` run from another folder without ``--model`` take the
model from the recorded file; an edited file is refused in one line saying what changed and what
to pass; a folder named like a preset (``tiny/config.json``) is that config, never the preset; and
plans of presets serialise exactly as before (tests/test_goldens.py pins them byte for byte).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from flexmesh.cli import main
from flexmesh.errors import PlanError
from flexmesh.layout.plan import Plan, load_plan
from flexmesh.layout.plan_model import model_shape, plan_model
from flexmesh.spec.model import MODEL_PRESETS
from flexmesh.spec.model_file import ModelFile

SMALL = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 320, "torch_dtype": "float32",
         "max_position_embeddings": 512}
CLUSTER = ["--cluster", "1xA100-80GB"]
PLAN_FLAGS = [*CLUSTER, "--seq-len", "128", "--global-batch", "4"]


def _config(folder: Path, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**SMALL, **changes}))
    return path


def _err(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


@pytest.fixture
def no_torchrun(monkeypatch):
    """``flexmesh train`` in this process: no torchrun variables before, none left after."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(k, "")  # recorded, so whatever train sets is undone after the test
        monkeypatch.delenv(k)


@pytest.mark.slow
def test_a_plan_made_from_a_config_runs_from_another_folder_without_model(tmp_path, monkeypatch, capsys):
    from helpers import flexmesh_ranks, write_inputs

    _, corpus, _ = write_inputs(tmp_path, world=1)
    config = _config(tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "a/config.json", *PLAN_FLAGS, "--out", "plan.json"]) == 0  # a relative path
    d = json.loads((tmp_path / "plan.json").read_text())
    assert d["model"] == "a" and d["model_config"] == {
        "path": str(config.resolve()), "sha256": hashlib.sha256(config.read_bytes()).hexdigest()}

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # where neither "a" nor a/config.json means anything
    capsys.readouterr()
    assert main(["plan", "--check", "../plan.json", *CLUSTER]) == 0
    assert "valid" in capsys.readouterr().out
    assert main(["simulate", "--plan", "../plan.json", "--context", "128", "--global-batch", "4", "--steps", "2",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setup"]["model"] == "a"
    # one rank forked from the fork server, in this folder as the test stands in it (a child's start-up
    # imports torch: seconds of CPU)
    r = flexmesh_ranks(1, "train", "--plan", "../plan.json", "--corpus", str(corpus), "--max-steps", "1", "--out",
                       "run", "--cache-dir", str(tmp_path / "cache"), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((tmp_path / "elsewhere" / "run" / "checkpoints" / "step_000001" / "manifest.json")
                          .read_text())
    assert manifest["model"]["num_layers"] == 2 and manifest["model"]["vocab"] == 320


def test_an_edited_config_is_refused_until_the_plan_is_checked_against_it(tmp_path, monkeypatch, capsys, no_torchrun):
    config = _config(tmp_path / "a")
    assert main(["plan", "--model", str(config), *PLAN_FLAGS, "--out", str(tmp_path / "plan.json")]) == 0
    plan_file = str(tmp_path / "plan.json")
    copy = _config(tmp_path / "copy")  # the same content elsewhere is the plan's model
    assert plan_model(load_plan(plan_file), str(copy), plan_file).name == "a"

    _config(tmp_path / "a", intermediate_size=192)
    capsys.readouterr()
    monkeypatch.chdir(tmp_path / "copy")
    assert main(["plan", "--check", plan_file, *CLUSTER]) == 2
    err = _err(capsys)
    assert f"model config {config} has changed since plan {plan_file} was made from it (sha256 now " in err
    assert f"restore it, or check the plan against it and record it: flexmesh plan --check {plan_file} --model " \
           f"{config} --out {plan_file}" in err and "layers" not in err
    for model in ([], ["--model", str(config)]):  # the recorded path, with new content, given or not
        assert main(["train", "--plan", plan_file, *model, "--corpus", str(tmp_path), "--max-steps", "1", "--out",
                     str(tmp_path / "run")]) == 2
        assert "has changed since plan" in _err(capsys)

    # what the message says to run: the plan is valid for the file as it is now, and records it
    assert main(["plan", "--check", plan_file, *CLUSTER, "--model", str(config), "--out", plan_file]) == 0
    again = load_plan(plan_file)
    assert again.model_config == ModelFile(str(config), hashlib.sha256(config.read_bytes()).hexdigest())
    assert plan_model(again, None, plan_file).ffn_hidden == 192

    _config(tmp_path / "a", num_hidden_layers=3)
    capsys.readouterr()
    assert main(["plan", "--check", plan_file, *CLUSTER]) == 2
    assert "; it now has 3 layers, the plan 2)" in _err(capsys)
    config.unlink()
    with pytest.raises(PlanError, match=f"made from model config {config}, which does not exist .*; pass --model"):
        plan_model(again, None, plan_file)


def test_a_folder_named_like_a_preset_is_that_config_not_the_preset(tmp_path, monkeypatch, capsys, no_torchrun):
    monkeypatch.chdir(tmp_path)
    config = _config(tmp_path / "tiny")
    assert main(["plan", "--model", "tiny/", *PLAN_FLAGS, "--out", "plan.json"]) == 0
    plan = load_plan("plan.json")
    assert plan.model == "tiny" and plan.model_config is not None and plan.model_config.path == str(config)
    spec = plan_model(plan, None, "plan.json")
    assert (spec.num_layers, spec.hidden, spec.vocab) == (2, 64, 320)
    assert model_shape(spec) != model_shape(MODEL_PRESETS["tiny"])
    assert ModelFile.of("tiny") is None  # a bare preset name is the preset, even beside a folder of that name

    capsys.readouterr()
    assert main(["plan", "--check", "plan.json", *CLUSTER]) == 0
    for command in (["plan", "--check", "plan.json", *CLUSTER],
                    ["simulate", "--plan", "plan.json", "--context", "128", "--steps", "2"],
                    ["train", "--plan", "plan.json", "--corpus", str(tmp_path), "--max-steps", "1", "--out", "run"]):
        capsys.readouterr()
        assert main([*command, "--model", "tiny"]) == 2, command
        err = _err(capsys)
        assert f"--model tiny is not the model 'tiny' plan plan.json was made from ({config}; num_layers 2 vs 4" in err
        assert f"pass --model {config}, or re-plan for tiny" in err
    shutil.move(tmp_path / "tiny", tmp_path / "moved")
    with pytest.raises(PlanError, match="which is not here to compare with"):
        plan_model(plan, "tiny", "plan.json")
    assert plan_model(plan, str(tmp_path / "moved"), "plan.json") == spec  # the same file, moved


def test_the_plan_format_field_is_optional_and_checked():
    from flexmesh.layout.plan import StagePlan
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.runtime.state.checkpoint import plan_hash

    preset = Plan.uniform("tiny", "1xA100-80GB", 1, 1, "1f1b", 1, 128, 4, (StagePlan(0, 4, (LayerStrategy(),) * 4),))
    assert preset.model_config is None and list(preset.to_dict()) == [
        "version", "model", "cluster", "world_size", "seq_len", "global_batch", "pipeline_schedule", "cost_source",
        "overlap", "groups", "unused", "predicted"]  # as before the field existed
    recorded = replace(preset, model_config=ModelFile("/models/a/config.json", "ab" * 32))
    d = recorded.to_dict()
    assert list(d)[:3] == ["version", "model", "model_config"]
    assert Plan.from_dict(json.loads(json.dumps(d))).model_config == recorded.model_config
    assert plan_hash(recorded) == plan_hash(preset)  # where the config lies does not change what runs
    for bad, words in (("a/config.json", "plan model_config must be a JSON object"),
                       ({"path": "/a/config.json"}, "plan model_config is missing sha256"),
                       ({"path": "", "sha256": "ab"}, "plan model_config: model_config path must be a non-empty"),
                       ({"path": "/a", "sha256": "ab", "size": 1}, "unknown field")):
        with pytest.raises(PlanError, match=words):
            Plan.from_dict({**d, "model_config": bad})
