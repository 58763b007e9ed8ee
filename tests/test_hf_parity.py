"""flexmesh computes what transformers computes for the same Hugging Face checkpoint (fp32).

Each case builds a tiny transformers model with random weights (norms and biases randomised too,
embeddings small so that the RMSNorm epsilon shows), writes it with ``save_pretrained`` in the
transformers 5 layout and rewrites its config.json in the transformers 4 layout; flexmesh reads
each config with its reader, loads the safetensors with its loader and must match the logits of
one sequence, of a packed row of three documents (against separate transformers passes), the loss
and every gradient within 1e-5 relative (largest difference over the largest value).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_below, randomise_hf, rel_diff, transformers_diffs

from flexmesh.layout.step import Piece
from flexmesh.runtime.model.packing import pack_microbatch
from flexmesh.runtime.model.transformer import build_model
from flexmesh.runtime.state.weights import load_hf_safetensors
from flexmesh.spec import from_hf_config

transformers = pytest.importorskip("transformers", reason="transformers is the reference; pip install -e .[dev]")

torch.set_num_threads(1)
TOL = 1e-5
LENGTHS = (21, 37, 48)  # ascending, and past 32 tokens so that every RoPE scaling changes the angles
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, hidden_act="silu")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0}

# name -> (model_type, config overrides, rope parameters besides rope_theta)
CASES: dict[str, tuple[str, dict, dict]] = {
    "llama": ("llama", {"rms_norm_eps": 1e-5}, {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}, {}),
    "llama-attention-bias": ("llama", {"attention_bias": True}, {}),
    "llama-mlp-bias": ("llama", {"mlp_bias": True}, {}),
    "llama3-scaling": ("llama", {"max_position_embeddings": 256}, LLAMA3),
    "linear-scaling": ("llama", {}, {"rope_type": "linear", "factor": 4.0}),
    "dynamic-scaling": ("llama", {"max_position_embeddings": 32}, {"rope_type": "dynamic", "factor": 4.0}),
    "yarn-scaling": ("llama", {"max_position_embeddings": 128}, YARN),
    "mistral": ("mistral", {"sliding_window": None}, {}),
    "qwen2": ("qwen2", {}, {}),
    "qwen3": ("qwen3", {"head_dim": 16, "attention_bias": True}, {}),
}


def _as_transformers4(src: Path, dst: Path) -> None:
    """The same checkpoint with a transformers 4 config.json: top-level rope_theta and rope_scaling,
    torch_dtype, and default-valued fields left out (so the reader's defaults are exercised)."""
    shutil.copytree(src, dst)
    cfg = json.loads((src / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    cfg["torch_dtype"] = cfg.pop("dtype")
    if cfg.get("rms_norm_eps") == 1e-6:
        del cfg["rms_norm_eps"]
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, {layout: checkpoint folder}); built once per case."""
    built: dict[str, tuple[torch.nn.Module, dict[str, Path]]] = {}

    def get(name: str):
        if name not in built:
            model_type, over, rope = CASES[name]
            cfg = transformers.AutoConfig.for_model(model_type, **SHAPE, **over, dtype="float32",
                                                    rope_parameters={"rope_theta": 5000.0, **rope})
            torch.manual_seed(0)
            hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
            randomise_hf(hf, seed=len(built) + 1)
            root = tmp_path_factory.mktemp(name)
            hf.save_pretrained(root / "v5")
            _as_transformers4(root / "v5", root / "v4")
            reread = transformers.AutoConfig.from_pretrained(root / "v4")
            # transformers reads both layouts alike (it keeps the old "type" key next to rope_type)
            assert {k: v for k, v in reread.rope_parameters.items() if k != "type"} == hf.config.rope_parameters
            built[name] = (hf, {"v5": root / "v5", "v4": root / "v4"})
        return built[name]

    return get


def _docs() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, SHAPE["vocab_size"], n) for n in LENGTHS]


@pytest.mark.parametrize("layout", ["v5", "v4"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(checkpoints, case, layout):
    hf, folders = checkpoints(case)
    spec = from_hf_config(folders[layout])
    assert spec.rope_theta == 5000.0 and spec.dtype == "fp32"
    assert spec.norm_eps == hf.config.rms_norm_eps
    model = build_model(replace(spec, name=case), "cpu")
    report = load_hf_safetensors(model, folders[layout])
    assert not report.other_stages
    assert_below(transformers_diffs(model, hf, _docs()), TOL, f"{case}/{layout}")


def test_mistakes_would_show(checkpoints):
    """Guard against a vacuous pass: a wrong RoPE scaling, theta or epsilon moves the logits past TOL."""
    docs = _docs()
    single = pack_microbatch(docs[-1:], (Piece(0, 0, len(docs[-1])),))
    wrong = {"llama3-scaling": {"rope_scaling": None}, "dynamic-scaling": {"rope_scaling": None},
             "yarn-scaling": {"rope_scaling": None}, "llama": {"norm_eps": 1e-6}, "qwen2": {"rope_theta": 10000.0}}
    for case, change in wrong.items():
        hf, folders = checkpoints(case)
        model = build_model(replace(from_hf_config(folders["v5"]), **change), "cpu")
        load_hf_safetensors(model, folders["v5"])
        with torch.no_grad():
            want = hf(torch.as_tensor(docs[-1])[None]).logits[0]
            assert rel_diff(model(single.tokens, single)[0], want) > 100 * TOL, case
