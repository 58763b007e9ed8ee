"""Families engines serve and flexmesh's runtime does not build (OPT, GPT-NeoX, Falcon, Gemma, Gemma 2, GPT-2,
GPT-BigCode, GPT-J, Phi, Phi-3, StarCoder2, MPT, BLOOM): read from their config.json for their shapes, priced by
serving, refused by the runtime in one line."""

from __future__ import annotations

import json

import pytest

from flexmesh.errors import SpecError
from flexmesh.spec import parse_model
from flexmesh.spec.hf_priced import PRICED_FAMILIES, priced_from_hf_dict

# The published configs' shape fields (Hugging Face: facebook/opt-13b, EleutherAI/pythia-12b, tiiuae/falcon-7b,
# tiiuae/falcon-40b, google/gemma-7b) and their models' published parameter counts
CONFIGS = {
    "opt-13b": ({"model_type": "opt", "num_hidden_layers": 40, "hidden_size": 5120, "num_attention_heads": 40,
                 "ffn_dim": 20480, "vocab_size": 50272, "max_position_embeddings": 2048, "torch_dtype": "float16",
                 "word_embed_proj_dim": 5120}, 12.85e9),
    "pythia-12b": ({"model_type": "gpt_neox", "num_hidden_layers": 36, "hidden_size": 5120, "num_attention_heads": 40,
                    "intermediate_size": 20480, "vocab_size": 50688, "max_position_embeddings": 2048,
                    "rotary_pct": 0.25, "tie_word_embeddings": False}, 11.85e9),
    "falcon-7b": ({"model_type": "falcon", "num_hidden_layers": 32, "hidden_size": 4544, "num_attention_heads": 71,
                   "vocab_size": 65024, "multi_query": True, "parallel_attn": True, "bias": False}, 6.92e9),
    "falcon-40b": ({"model_type": "falcon", "num_hidden_layers": 60, "hidden_size": 8192, "num_attention_heads": 128,
                    "num_kv_heads": 8, "new_decoder_architecture": True, "vocab_size": 65024, "bias": False},
                   41.8e9),
    "gemma-7b": ({"model_type": "gemma", "num_hidden_layers": 28, "hidden_size": 3072, "num_attention_heads": 16,
                  "num_key_value_heads": 16, "head_dim": 256, "intermediate_size": 24576, "vocab_size": 256000,
                  "max_position_embeddings": 8192}, 8.54e9),
    # mosaicml/mpt-7b (6.7B) and bigscience/bloom-7b1 (7,069,016,064 parameters, its model card)
    "mpt-7b": ({"model_type": "mpt", "n_layers": 32, "d_model": 4096, "n_heads": 32, "expansion_ratio": 4,
                "max_seq_len": 2048, "vocab_size": 50432, "no_bias": True, "attn_config": {"alibi": True}}, 6.65e9),
    "bloom-7b1": ({"model_type": "bloom", "n_layer": 30, "hidden_size": 4096, "n_head": 32, "vocab_size": 250880},
                  7.069e9),
}


def _write(tmp_path, name: str, cfg: dict) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_family_reads_to_its_published_size(tmp_path, name):
    cfg, params = CONFIGS[name]
    spec = parse_model(_write(tmp_path, name, cfg))
    assert spec.priced_only == cfg["model_type"] and spec.name == name
    assert spec.total_params == pytest.approx(params, rel=0.02)


def test_shapes_that_matter_to_serving_are_read(tmp_path):
    falcon7 = parse_model(_write(tmp_path, "f7", CONFIGS["falcon-7b"][0]))
    falcon40 = parse_model(_write(tmp_path, "f40", CONFIGS["falcon-40b"][0]))
    gemma = parse_model(_write(tmp_path, "g", CONFIGS["gemma-7b"][0]))
    opt = parse_model(_write(tmp_path, "o", CONFIGS["opt-13b"][0]))
    assert (falcon7.num_kv_heads, falcon40.num_kv_heads, gemma.head_dim, gemma.num_kv_heads) == (1, 8, 256, 16)
    assert (opt.max_position, opt.dtype, opt.activation, gemma.activation) == (2048, "fp16", "gelu", "swiglu")


def test_what_changes_the_shapes_and_is_not_read_is_refused(tmp_path):
    opt350 = {**CONFIGS["opt-13b"][0], "word_embed_proj_dim": 512}
    with pytest.raises(SpecError, match="word_embed_proj_dim"):
        parse_model(_write(tmp_path, "opt350", opt350))
    with pytest.raises(SpecError, match="missing num_hidden_layers"):
        parse_model(_write(tmp_path, "short", {"model_type": "opt", "hidden_size": 64}))
    with pytest.raises(SpecError, match="priced for serving only, opt, gpt_neox, falcon, gemma, gemma2, gpt2, "):
        parse_model(_write(tmp_path, "t5", {"model_type": "t5"}))


def test_the_runtime_refuses_to_build_one_and_serving_prices_it(tmp_path, capsys):
    from flexmesh.cli import main
    from flexmesh.runtime.model.transformer import build_model

    folder = _write(tmp_path, "opt-13b", CONFIGS["opt-13b"][0])
    with pytest.raises(SpecError, match="opt config, read for its shapes to price serving"):
        build_model(parse_model(folder))
    rc = main(["serve", "simulate", "--model", folder, "--cluster", "2xA100-80GB", "--trace", "const:500:50",
               "--requests", "20", "--rate", "2", "--engine", "vllm-v0", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["model"] == "opt-13b" and doc["runs"][0]["requests"] == 20


@pytest.mark.parametrize("family", PRICED_FAMILIES)
def test_each_family_has_the_parameters_transformers_builds_from_its_default_config(family):
    """Every field a family's config class defaults is read as that class reads it: the shapes give the parameter
    count of the model transformers builds from the same config (on the meta device, no memory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(family)
    spec = priced_from_hf_dict(config.to_dict(), family)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    # within a family's biases priced where it has none (GPT-J's attention, Falcon's dense), under 0.02%
    assert spec.total_params == pytest.approx(sum(p.numel() for p in model.parameters()), rel=2e-4)


def test_an_alibi_falcon_reads_to_the_size_transformers_builds():
    """Falcon-RW-1B's shapes (ALiBi, no rotary; vLLM's FalconAttention serves it with ALiBi slopes): ALiBi has no
    weights, so the count matches the model transformers builds as the rotary ones do."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconConfig(alibi=True, num_hidden_layers=24, hidden_size=2048, num_attention_heads=32,
                                       multi_query=False, parallel_attn=False, bias=True, vocab_size=50304)
    spec = priced_from_hf_dict(config.to_dict(), "falcon-rw-1b")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert spec.num_kv_heads == 32
    assert spec.total_params == pytest.approx(sum(p.numel() for p in model.parameters()), rel=2e-4)


def test_sliding_windows_are_read_where_the_family_has_them():
    gemma2 = priced_from_hf_dict({"model_type": "gemma2", "num_hidden_layers": 4, "hidden_size": 256,
                                  "num_attention_heads": 4, "vocab_size": 1000})
    assert gemma2.sliding_window == 4096 and gemma2.window_layers == (True, False, True, False)
    typed = priced_from_hf_dict({"model_type": "gemma2", "num_hidden_layers": 2, "hidden_size": 256,
                                 "num_attention_heads": 4, "vocab_size": 1000, "sliding_window": 512,
                                 "layer_types": ["full_attention", "sliding_attention"]})
    assert (typed.sliding_window, typed.window_layers) == (512, (False, True))
    phi3 = priced_from_hf_dict({"model_type": "phi3", "num_hidden_layers": 2, "hidden_size": 256,
                                "num_attention_heads": 4, "vocab_size": 1000, "sliding_window": 2047})
    assert (phi3.sliding_window, phi3.window_layers, phi3.attention_windows) == (2047, None, (2047, 2047))
    plain = priced_from_hf_dict({"model_type": "starcoder2", "num_hidden_layers": 2, "hidden_size": 256,
                                 "num_attention_heads": 4, "vocab_size": 1000, "sliding_window": None})
    assert plain.sliding_window is None and plain.num_kv_heads == 2
    with pytest.raises(SpecError, match="layer_types must list one type per layer"):
        priced_from_hf_dict({"model_type": "gemma2", "num_hidden_layers": 3, "hidden_size": 256,
                             "num_attention_heads": 4, "vocab_size": 1000, "layer_types": ["full_attention"]})
    with pytest.raises(SpecError, match=r"layer_types \['chunked_attention'\] are not supported"):
        priced_from_hf_dict({"model_type": "gemma2", "num_hidden_layers": 2, "hidden_size": 256,
                             "num_attention_heads": 4, "vocab_size": 1000,
                             "layer_types": ["sliding_attention", "chunked_attention"]})
