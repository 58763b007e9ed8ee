"""`flexmesh export`: training checkpoints of every layout -> Hugging Face folders transformers loads.

Real checkpoints come from `flexmesh train` (two steps): one process with a tied Qwen2-style model,
and two processes under ZeRO-3, tensor parallelism and an interleaved pipeline (a Llama with
attention biases). Each export must load with ``AutoModelForCausalLM.from_pretrained`` and give the
logits of the flexmesh model built from the same checkpoint by torch's own DCP reader
(``dcp_to_torch_save``), within 1e-5 relative (largest difference over the largest value) in fp32.
Also: the config writer's round trip, shard sizes and the index, bf16, and the errors a user meets.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from flexmesh.errors import CheckpointError, SpecError
from flexmesh.spec.hf import spec_from_hf_dict, to_hf_config
from flexmesh.spec.model import MODEL_PRESETS, RopeScaling

torch.set_num_threads(1)
TOL = 1e-5
MEASURED: dict[str, float] = {}  # largest relative logit difference per layout, printed with -s

LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 320, "torch_dtype": "float32",
         "max_position_embeddings": 512, "attention_bias": True, "rope_theta": 5e5}
QWEN2_TIED = {**LLAMA, "model_type": "qwen2", "num_hidden_layers": 2, "tie_word_embeddings": True,
              "rms_norm_eps": 1e-5}
# name -> (config, processes, pipeline schedule, virtual stages, stages' layers, strategy)
RUNS = {
    "single-qwen2-tied": (QWEN2_TIED, 1, "1f1b", 1, [[0, 2]], "tp1-dp1z0"),
    "zero3": (LLAMA, 2, "1f1b", 1, [[0, 4]], "tp1-dp2z3"),
    "tp2": (LLAMA, 2, "1f1b", 1, [[0, 4]], "tp2-dp1z0"),
    "pp2-interleaved": (LLAMA, 2, "interleaved", 2, [[0, 1], [1, 2], [2, 3], [3, 4]], "tp1-dp1z0"),
}


def _corpus(tmp: Path) -> Path:
    corpus = tmp / "corpus"
    corpus.mkdir()
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly boxing".split()
    for i in range(16):
        (corpus / f"doc{i:02d}.txt").write_text(" ".join(words[(i + j * 3) % len(words)] for j in range(5 + i * 7)))
    return corpus


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (run folder, plan file) of a two-step `flexmesh train` run per layout (ranks from the fork server)."""
    from helpers import flexmesh_ranks

    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    tmp = tmp_path_factory.mktemp("export-runs")
    corpus = _corpus(tmp)
    out = {}
    for name, (cfg, world, schedule, v, layers, strategy) in RUNS.items():
        (tmp / name).mkdir()
        config = tmp / name / "config.json"
        config.write_text(json.dumps(cfg))
        st = LayerStrategy.parse(strategy)
        plan = Plan.uniform(model=str(config), cluster=f"{world}xA100-80GB", world_size=world, pp=len(layers) // v,
                    pipeline_schedule=schedule, virtual_stages=v, num_microbatches=2, seq_len=128, global_batch=4,
                    stages=tuple(StagePlan(a, b, (st,) * (b - a)) for a, b in layers))
        plan_path = tmp / name / "plan.json"
        plan.save(plan_path)
        r = flexmesh_ranks(world, "train", "--plan", str(plan_path), "--corpus", str(corpus), "--max-steps", "2",
                           "--out", str(tmp / name / "run"), "--cache-dir", str(tmp / "cache"), "--no-progress",
                           "--lr", "1e-2")
        assert r.returncode == 0, r.stderr[-4000:]
        out[name] = (tmp / name / "run", plan_path)
    return out


def _reference_logits(checkpoint: Path, spec, tokens: torch.Tensor, tmp: Path) -> torch.Tensor:
    """Logits of the flexmesh model holding the checkpoint's weights as torch's own DCP reader gives them."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from flexmesh.layout.step import Piece
    from flexmesh.runtime.model.packing import pack_microbatch
    from flexmesh.runtime.model.transformer import build_model

    dcp_to_torch_save(str(checkpoint), str(tmp / "ref.pt"))
    model = build_model(spec, device="cpu").eval()
    model.load_state_dict(_reference_state(tmp), strict=True)
    batch = pack_microbatch([tokens.numpy()], (Piece(0, 0, len(tokens)),))
    with torch.no_grad():
        return model(batch.tokens, batch).float()[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(RUNS))
def test_export_loads_in_transformers_with_the_same_logits(runs, name, tmp_path):
    transformers = pytest.importorskip("transformers")
    from flexmesh.cli import main
    from flexmesh.runtime.state.weights import load_hf_safetensors
    from flexmesh.spec import from_hf_config

    run, plan = runs[name]
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(run), "--out", str(out), "--plan", str(plan),
                 "--max-shard-size", "150KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert sum((out / f).stat().st_size for f in files) >= index["metadata"]["total_size"]
    cfg = json.loads((out / "config.json").read_text())
    spec = from_hf_config(out)
    assert spec == replace(from_hf_config(plan.parent / "config.json"), name=spec.name)
    tied = RUNS[name][0].get("tie_word_embeddings", False)
    assert cfg["tie_word_embeddings"] is tied and ("lm_head.weight" in index["weight_map"]) is not tied

    tokens = torch.as_tensor(np.random.default_rng(0).integers(0, spec.vocab, 48))
    checkpoint = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    ref = _reference_logits(checkpoint, spec, tokens, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(tokens[None]).logits.float()[0]
    diff = ((got - ref).abs().max() / ref.abs().max()).item()
    MEASURED[name] = diff
    print(f"{name}: max relative logit difference {diff:.2e}")
    assert diff <= TOL

    from flexmesh.runtime.model.transformer import build_model  # flexmesh's own loader reads the export too

    model = build_model(spec, device="cpu")
    load_hf_safetensors(model, out)
    ref_model = build_model(spec, device="cpu")
    ref_model.load_state_dict(_reference_state(tmp_path), strict=True)
    for (n, p), (_, q) in zip(model.state_dict().items(), ref_model.state_dict().items(), strict=True):
        assert torch.equal(p, q), n  # exact: the weights written and read back


def _reference_state(tmp: Path) -> dict:
    """The model part of torch's own DCP -> torch.save conversion that ``_reference_logits`` made."""
    state = torch.load(tmp / "ref.pt", weights_only=False)["model"]  # our own file, just written
    # an interleaved pipeline's state is a list of chunks: "0.layers.0...", "1.layers.2..."
    return {k.split(".", 1)[1] if k[0].isdigit() else k: v for k, v in state.items()}


@pytest.mark.slow
def test_bf16_export_and_errors(runs, tmp_path):
    from safetensors import safe_open

    from flexmesh.runtime.state.export import checkpoint_spec, export_checkpoint
    from flexmesh.spec import from_hf_config

    run, plan = runs["zero3"]
    spec = checkpoint_spec(run, plan=plan)
    rep = export_checkpoint(run, tmp_path / "bf16", spec, dtype="bf16")
    assert rep.files == ("model-00001-of-00001.safetensors",) and rep.dtype == "bf16"
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "bf16" / rep.files[0]), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert from_hf_config(tmp_path / "bf16") == replace(spec, dtype="bf16", name=spec.name)

    with pytest.raises(CheckpointError, match="already holds an export.*--overwrite"):
        export_checkpoint(run, tmp_path / "bf16", spec)
    # the run's own folder or its checkpoints would take files no manifest lists: refused; RUN/hf beside them is fine
    latest = sorted((run / "checkpoints").glob("step_*"))[-1]
    for inside in (run, run / "checkpoints", latest):
        with pytest.raises(CheckpointError, match="is the run's folder or inside its checkpoints"):
            export_checkpoint(run, inside, spec)
    with pytest.raises(CheckpointError, match="is a file, not a run or checkpoint folder"):
        export_checkpoint(latest / "manifest.json", tmp_path / "x", spec)
    rep = export_checkpoint(run, tmp_path / "bf16", spec, max_shard_bytes=200_000, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "bf16").glob("*.safetensors")) == list(rep.files)  # old shard gone
    # --overwrite touches only what an export left: a downloaded model's folder, or a shard changed since, is kept
    downloaded = tmp_path / "downloaded"
    shutil.copytree(tmp_path / "bf16", downloaded)
    (downloaded / ".flexmesh-export.json").unlink()
    before = {p.name: p.read_bytes() for p in downloaded.iterdir()}
    with pytest.raises(CheckpointError, match="which no flexmesh export left there"):
        export_checkpoint(run, downloaded, spec, overwrite=True)
    assert {p.name: p.read_bytes() for p in downloaded.iterdir()} == before
    shard = tmp_path / "bf16" / rep.files[0]
    shard.write_bytes(shard.read_bytes() + b"x")  # replaced by hand since the export
    with pytest.raises(CheckpointError, match=f"holds {rep.files[0]}, which no flexmesh export"):
        export_checkpoint(run, tmp_path / "bf16", spec, overwrite=True)

    with pytest.raises(CheckpointError, match="does not exist; pass --checkpoint"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "x", spec)
    step = run / "checkpoints" / "step_000002"
    unfinished = tmp_path / "step_000002"
    shutil.copytree(step, unfinished)
    (unfinished / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json: it is unfinished"):
        export_checkpoint(unfinished, tmp_path / "x", spec)
    shutil.copytree(step, tmp_path / "partial" / "step_000002")
    next((tmp_path / "partial" / "step_000002").glob("*.distcp")).unlink()
    with pytest.raises(CheckpointError, match=r"lacks __\d_\d\.distcp"):
        export_checkpoint(tmp_path / "partial" / "step_000002", tmp_path / "x", spec)
    with pytest.raises(CheckpointError, match="not of model 'tiny'; pass the --model or --plan"):
        export_checkpoint(run, tmp_path / "x", MODEL_PRESETS["tiny"])
    # the manifest records the model: export needs neither --model nor --plan
    assert json.loads((step / "manifest.json").read_text())["model"] == spec.to_dict()
    assert checkpoint_spec(run) == spec
    from flexmesh.cli import main

    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "bare")]) == 0
    assert (tmp_path / "bare" / "config.json").is_file()
    # a manifest written before the model was recorded needs one of them
    older = tmp_path / "older" / "step_000002"
    shutil.copytree(step, older)
    manifest = json.loads((older / "manifest.json").read_text())
    del manifest["model"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecError, match="does not record its model; pass --model"):
        checkpoint_spec(older)
    # export checks what resume checks: a flipped bit in a shard, and a planted pickle in DCP's metadata
    # (its manifest rewritten to match) are refused before anything is read or run
    flipped = tmp_path / "flipped" / "step_000002"
    shutil.copytree(step, flipped)
    shard = sorted(flipped.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name} does not match its sha256"):
        export_checkpoint(flipped, tmp_path / "x", spec)
    planted = tmp_path / "planted" / "step_000002"
    shutil.copytree(step, planted)
    ran = tmp_path / "payload-ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {ran}",))

    import hashlib
    import pickle

    (planted / ".metadata").write_bytes(pickle.dumps(Payload()))
    manifest = json.loads((planted / "manifest.json").read_text())
    manifest["sha256"][".metadata"] = hashlib.sha256((planted / ".metadata").read_bytes()).hexdigest()
    (planted / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="which a DCP checkpoint never holds"):
        export_checkpoint(planted, tmp_path / "x", spec)
    assert not ran.exists()
    assert not (tmp_path / "x").exists()


def test_cli_errors_are_one_line(tmp_path, capsys):
    from flexmesh.cli import main

    assert main(["export", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o"),
                 "--model", "tiny"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "does not exist; pass --checkpoint RUN/checkpoints/step_NNNNNN" in err
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "o"),
                 "--model", "tiny"]) == 2
    assert "holds no finished flexmesh checkpoint" in " ".join(capsys.readouterr().err.split())


# ---- the config writer ---------------------------------------------------------------------------
_TINY = MODEL_PRESETS["tiny"]
WRITTEN = {
    **{name: spec for name, spec in MODEL_PRESETS.items()},
    "mistral-window": replace(_TINY, sliding_window=64),
    "qwen2-some-layers-slide": replace(_TINY, qkv_bias=True, sliding_window=64,
                                       window_layers=(False, True, True, False)),
    "qwen3": replace(_TINY, qk_norm=True, qkv_bias=True, attention_out_bias=True, head_dim_override=16),
    "llama-all-biases-tied": replace(_TINY, qkv_bias=True, attention_out_bias=True, mlp_bias=True,
                                     tie_embeddings=True, dtype="fp32"),
    "yarn": replace(_TINY, rope_scaling=RopeScaling("yarn", 4.0, 1024, beta_fast=16.0, mscale=0.7)),
    "dynamic": replace(_TINY, rope_scaling=RopeScaling("dynamic", 2.0, 4096)),
    "linear": replace(_TINY, rope_scaling=RopeScaling("linear", 2.0)),
}
FAMILY = {"qwen2.5-7b": "qwen2", "mistral-window": "mistral", "qwen2-some-layers-slide": "qwen2", "qwen3": "qwen3"}


@pytest.mark.parametrize("name", list(WRITTEN))
def test_config_round_trip(name, tmp_path):
    spec = WRITTEN[name]
    cfg = to_hf_config(spec)
    assert cfg["model_type"] == FAMILY.get(name, cfg["model_type"])
    assert spec_from_hf_dict(cfg) == spec
    assert spec_from_hf_dict(json.loads(json.dumps(cfg))) == spec  # through JSON: lists, no tuples
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    transformers.AutoConfig.from_pretrained(tmp_path).save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert spec_from_hf_dict(again, name=spec.name) == spec  # transformers reads it as meant


def test_config_round_trip_of_specs_read_from_hf(tmp_path):
    base = {"num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 96, "vocab_size": 128}
    for cfg in ({"model_type": "mistral", "sliding_window": 16}, {"model_type": "mistral", "sliding_window": None},
                {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
                {"model_type": "qwen3", "head_dim": 32, "attention_bias": True},
                {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64}}):
        spec = spec_from_hf_dict({**base, **cfg}, name="m")
        assert spec_from_hf_dict(to_hf_config(spec)) == spec, cfg


@pytest.mark.parametrize("kw, words", [
    (dict(norm="layernorm"), "norm='layernorm'"),
    (dict(attention_out_bias=True), "o_proj bias needs q/k/v biases"),
    (dict(sliding_window=8, window_layers=(True, False, False, False)), "only exists in Qwen2"),
    (dict(qk_norm=True, mlp_bias=True), "Qwen3"),
    (dict(rope_scaling=RopeScaling("dynamic", 2.0, 64)), "set original_max_position to max_position"),
])
def test_specs_without_a_transformers_family_are_refused(kw, words):
    with pytest.raises(SpecError, match="Hugging Face") as e:
        to_hf_config(replace(_TINY, **kw))
    assert words in str(e.value) and "\n" not in str(e.value)
