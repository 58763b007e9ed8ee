"""The Hugging Face config reader (both transformers layouts, defaults, refusals) and the weight
loader's report of missing, unexpected and other-stage tensors."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import spawn
from safetensors.torch import load_file, save_file

from flexmesh.errors import CheckpointError, SpecError
from flexmesh.runtime.model.transformer import build_model
from flexmesh.runtime.state.weights import load_hf_safetensors, save_hf_safetensors
from flexmesh.spec import from_hf_config
from flexmesh.spec.model import ModelSpec, RopeScaling

BASE = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "vocab_size": 128}


def _read(tmp_path, **cfg):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama", **BASE, **cfg}))
    return from_hf_config(p)


def test_rope_theta_and_dtype_in_both_layouts(tmp_path):
    v4 = _read(tmp_path, rope_theta=5e5, torch_dtype="float32")
    v5 = _read(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 5e5}, dtype="float32")
    assert v4 == v5 and v4.rope_theta == 5e5 and v4.dtype == "fp32" and v4.rope_scaling is None


def test_transformers_defaults_per_family(tmp_path):
    llama = _read(tmp_path)
    assert (llama.norm_eps, llama.rope_theta, llama.max_position, llama.num_kv_heads) == (1e-6, 10000.0, 2048, 2)
    qwen3 = _read(tmp_path, model_type="qwen3", num_key_value_heads=None)
    assert (qwen3.head_dim, qwen3.num_kv_heads, qwen3.qk_norm, qwen3.qkv_bias) == (128, 4, True, False)
    mistral = {k: v for k, v in BASE.items() if k != "num_key_value_heads"}
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "mistral", **mistral, "num_attention_heads": 8}))
    assert from_hf_config(p).num_kv_heads == 8 and from_hf_config(p).max_position == 131072


def test_biases_per_family(tmp_path):
    llama = _read(tmp_path, attention_bias=True, mlp_bias=True)
    assert llama.qkv_bias and llama.attention_out_bias and llama.mlp_bias
    qwen2 = _read(tmp_path, model_type="qwen2", attention_bias=True, mlp_bias=True)
    assert qwen2.qkv_bias and not qwen2.attention_out_bias and not qwen2.mlp_bias  # as Qwen2Attention builds it
    mistral = _read(tmp_path, model_type="mistral", attention_bias=True)
    assert not (mistral.qkv_bias or mistral.attention_out_bias)
    h, ffn = 64, 96  # q/k/v biases h + 2 * kv_dim, o bias h, gate/up/down biases 2 * ffn + h
    assert llama.layer_params - _read(tmp_path).layer_params == (h + 2 * 32) + h + (2 * ffn + h)
    # Qwen3's default head_dim is 128; its q/k norms add 2 * head_dim per layer
    qwen3, same_shape = _read(tmp_path, model_type="qwen3"), _read(tmp_path, head_dim=128)
    assert qwen3.layer_params - same_shape.layer_params == 2 * 128


def test_rope_scalings_are_read(tmp_path):
    l3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    s = _read(tmp_path, max_position_embeddings=131072, rope_scaling={"rope_type": "llama3", **l3}).rope_scaling
    assert s == RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)
    s = _read(tmp_path, max_position_embeddings=4096, rope_scaling={"type": "dynamic", "factor": 2.0}).rope_scaling
    assert s == RopeScaling("dynamic", 2.0, 4096)  # relative to max_position_embeddings, as transformers
    s = _read(tmp_path, max_position_embeddings=4096,
              rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "original_max_position_embeddings": 1024})
    assert s.rope_scaling == RopeScaling("yarn", 4.0, 1024) and s.rope_theta == 1e6  # factor from the lengths


def test_spec_dict_round_trip_keeps_new_fields():
    m = ModelSpec("m", 2, 64, 4, 2, 96, 128, rope_scaling=RopeScaling("yarn", 4.0, 64, attention_factor=1.2),
                  attention_out_bias=True, mlp_bias=True, qk_norm=True)
    assert ModelSpec.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert "rope_scaling" not in ModelSpec("p", 2, 64, 4, 2, 96, 128).to_dict()  # old dicts (profile hashes) unchanged


@pytest.mark.parametrize("cfg, words", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type 'longrope' is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
     "partial_rotary_factor 0.25"),
    ({"rope_scaling": {"rope_type": "linear"}}, "needs rope parameter 'factor'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}}, "high_freq_factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "mrope_section": [1]}}, "mrope_section"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer-type rope_parameters"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
    ({"attention_dropout": 0.1}, "attention_dropout 0.1"),
    ({"dtype": "float8_e4m3fn"}, "dtype 'float8_e4m3fn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"model_type": "t5"}, "llama, mistral, qwen2, qwen3"),
])
def test_unsupported_fields_are_one_line_errors(tmp_path, cfg, words):
    with pytest.raises(SpecError) as e:
        _read(tmp_path, **cfg)
    assert words in str(e.value) and "\n" not in str(e.value)


# ---- the weight loader's report ------------------------------------------------------------------------
SPEC = ModelSpec("t", 2, 64, 4, 2, 96, 128, dtype="fp32", qkv_bias=True, attention_out_bias=True, mlp_bias=True,
                 qk_norm=True)


def _file(tmp_path, spec=SPEC):
    model = build_model(spec, "cpu")
    path = tmp_path / "model.safetensors"
    save_hf_safetensors(model, path)
    return path


def test_new_tensors_round_trip(tmp_path):
    path = _file(tmp_path)
    keys = set(load_file(str(path)))
    assert {"model.layers.0.self_attn.o_proj.bias", "model.layers.1.mlp.down_proj.bias",
            "model.layers.0.self_attn.q_norm.weight"} <= keys
    report = load_hf_safetensors(build_model(SPEC, "cpu"), path)
    assert set(report.loaded) == keys and not report.other_stages


def test_unexpected_and_missing_tensors_are_named(tmp_path):
    path = _file(tmp_path)
    plain = ModelSpec("t", 2, 64, 4, 2, 96, 128, dtype="fp32", qkv_bias=True)
    with pytest.raises(CheckpointError, match=r"hold .*o_proj.bias.*no place for.*attention_bias and mlp_bias"):
        load_hf_safetensors(build_model(plain, "cpu"), path)
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.bias"]
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # old checkpoints: recomputed
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"missing model.layers.1.mlp.up_proj.bias") as e:
        load_hf_safetensors(build_model(SPEC, "cpu"), path)
    assert "\n" not in str(e.value) and "inv_freq" not in str(e.value)


def test_other_stages_tensors_are_named_not_refused(tmp_path):
    path = _file(tmp_path)
    stage = build_model(SPEC, "cpu")
    del stage.layers["0"]
    stage.tok_embeddings = None
    report = load_hf_safetensors(stage, path)
    assert "model.embed_tokens.weight" in report.other_stages
    assert all(k.startswith("model.layers.0.") or k == "model.embed_tokens.weight" for k in report.other_stages)
    assert "belong to other pipeline stages" in report.summary()


# ---- tensor parallelism with the new tensors (two gloo processes) ----------------------------------------
def _tp_worker(rank: int, port: int) -> None:
    from datetime import timedelta

    import numpy as np
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from flexmesh.layout.step import Piece
    from flexmesh.runtime.model.packing import pack_microbatch
    from flexmesh.runtime.parallel.parallelize import apply_tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        spec = ModelSpec("t", 2, 64, 4, 2, 96, 128, dtype="fp32", qkv_bias=True, attention_out_bias=True,
                         mlp_bias=True, qk_norm=True, rope_scaling=RopeScaling("yarn", 4.0, 8))
        ref = build_model(spec, "cpu")
        with torch.no_grad():  # non-trivial norms and biases, identical on both ranks
            gen = torch.Generator().manual_seed(1)
            for name, p in ref.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.copy_(1.0 * ("norm" in name) + 0.3 * torch.randn(p.shape, generator=gen))
        rng = np.random.default_rng(0)
        docs = [rng.integers(0, 128, n) for n in (8, 12, 6)]
        b = pack_microbatch(docs, tuple(Piece(i, 0, len(d)) for i, d in enumerate(docs)))
        probe = torch.randn(1, 26, 128, generator=torch.Generator().manual_seed(2))
        (ref(b.tokens, b) * probe).sum().backward()
        tp = build_model(spec, "cpu")
        tp.load_state_dict(ref.state_dict())
        apply_tp(tp, init_device_mesh("cpu", (2,)))
        out = tp(b.tokens, b)
        (out * probe).sum().backward()
        got = dict(tp.named_parameters())
        for name, p in ref.named_parameters():
            g = got[name].grad
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
            # an o_proj/down_proj bias added once per rank, or q/k norm gradients of one rank's heads, fail here
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5, msg=name)
        dist.barrier()  # gloo can abort at teardown when one rank destroys its group while the other still sends
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tensor_parallel_biases_and_qk_norms(monkeypatch):

    from flexmesh.runtime.launch import free_port

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spawn(_tp_worker, (free_port(),), 2)
