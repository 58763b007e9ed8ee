import json

import pytest

from flexmesh.errors import SpecError
from flexmesh.spec import MODEL_PRESETS, from_hf_config, parse_cluster, parse_model


def test_llama2_7b_parameter_count_matches_published_size():
    # Meta reports 6.74B parameters for Llama 2 7B.
    assert MODEL_PRESETS["llama2-7b"].total_params == pytest.approx(6.74e9, rel=1e-3)


def test_llama3_70b_parameter_count():
    assert MODEL_PRESETS["llama3-70b"].total_params == pytest.approx(70.55e9, rel=2e-3)


def test_gpt_triple_parses_and_counts_megatron_params():
    m = parse_model("gpt:24:2304:24")
    # Megatron's estimate 12 l h^2 (1 + 13/12h + (V + s)/(12 l h)) for the 1.7B model of 2104.04473.
    h, L, V, s = 2304, 24, 51200, 2048
    assert m.total_params == pytest.approx(12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h)), rel=1e-3)


def test_unknown_model_lists_presets():
    with pytest.raises(SpecError, match="llama3-8b"):
        parse_model("llama9-1t")


def _write_cfg(tmp_path, **over):
    cfg = {"model_type": "qwen2", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
           "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000, "tie_word_embeddings": True,
           "rope_theta": 1e6, "hidden_act": "silu"}
    cfg.update(over)
    p = tmp_path / "config.json"
    p.write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return p


def test_hf_config_reads_qwen2(tmp_path):
    m = from_hf_config(_write_cfg(tmp_path))
    assert (m.num_layers, m.hidden, m.num_heads, m.num_kv_heads, m.ffn_hidden, m.vocab) == (4, 256, 8, 2, 512, 1000)
    assert m.qkv_bias and m.tie_embeddings and m.rope_theta == 1e6
    assert parse_model(str(tmp_path)) == m


def test_hf_config_missing_field_is_named(tmp_path):
    with pytest.raises(SpecError, match="intermediate_size"):
        from_hf_config(_write_cfg(tmp_path, intermediate_size=None))


def test_hf_config_unsupported_family(tmp_path):
    with pytest.raises(SpecError, match="llama, mistral, qwen2"):
        from_hf_config(_write_cfg(tmp_path, model_type="t5"))


def test_cluster_strings():
    c = parse_cluster("8x8xA100-40GB")
    assert (c.nodes, c.devices_per_node, c.world_size, c.device.name) == (8, 8, 64, "A100-40GB")
    one = parse_cluster("8xH100")
    assert (one.nodes, one.devices_per_node, one.device.name) == (1, 8, "H100-80GB")


def test_cluster_unknown_device_lists_known():
    with pytest.raises(SpecError, match="H100-80GB"):
        parse_cluster("8xMI300X")


def test_cluster_file_with_override_and_speed_factors(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('nodes = 1\ndevices_per_node = 2\nspeed_factors = [1.0, 0.5]\n'
                 '[device]\nbase = "A100-80GB"\nmemory_gib = 10.0\n')
    c = parse_cluster(str(p))
    assert c.device.memory_gib == 10.0 and c.speed(1) == 0.5


def test_cluster_speed_factor_count_must_match(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"nodes": 1, "devices_per_node": 4, "device": "H100", "speed_factors": [1.0]}))
    with pytest.raises(SpecError, match="one per device"):
        parse_cluster(str(p))
