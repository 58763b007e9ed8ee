"""bench/vidur_layers.py: Vidur's operators one by one against the device layer's price of the same work."""

from __future__ import annotations

import numpy as np
import pytest

import bench.vidur_layers as vl
from flexmesh.cost.device.layer_shapes import pointwise_elems
from flexmesh.spec import MODEL_PRESETS


def test_the_layer_is_the_sum_of_its_operators():
    layers, ops = vl.measured(), vl.measured_operators()
    assert set(layers) == set(ops) and len(ops) == 3
    for key, (tokens, secs) in layers.items():
        assert np.array_equal(tokens, ops[key][0]) and set(ops[key][1]) == set(vl.OPERATORS)
        assert np.allclose(secs, sum(ops[key][1].values()))


@pytest.mark.parametrize("model", ["llama2-7b", "llama3-8b"])
def test_pointwise_operators_move_the_layers_elements_and_the_residual_add(model):
    m = MODEL_PRESETS[model]
    e, p = vl.operator_elems(model), pointwise_elems(m)
    assert e["input_layernorm"] == e["post_attention_layernorm"] == 2 * m.hidden
    assert sum(e.values()) == p.norms + p.rotary + p.activation + 3 * m.hidden


def test_the_operators_are_priced_at_the_device_layers_kernels():
    from flexmesh.cost.device.hardware import Hardware
    from flexmesh.cost.inference.analytic import AnalyticIteration
    from flexmesh.spec.cluster import ClusterSpec
    from flexmesh.spec.devices import DEVICE_PRESETS

    tokens = np.array([1.0, 256.0, 4096.0])
    ops = vl.predicted_operators("llama2-7b", "A100-80GB", tokens)
    assert set(ops) == set(vl.OPERATORS)
    it = AnalyticIteration(MODEL_PRESETS["llama2-7b"], Hardware(ClusterSpec(1, 1, DEVICE_PRESETS["A100-80GB"])))
    for op, i in vl.GEMMS.items():  # the layer's GEMMs, at the device layer's kernels
        assert np.array_equal(ops[op], it.kernels.gemm(tokens, *it.shapes[i]))
    for op, elems in vl.operator_elems("llama2-7b").items():  # one streaming kernel each, its fixed cost included
        assert np.allclose(ops[op], tokens * elems * 2 / it.kernels.hbm_bytes_per_s + it.kernels.launch_s)
    # five pointwise kernels against the layer's four fused ones: within 5% of the layer's price
    assert np.allclose(sum(ops.values()), vl.predicted("llama2-7b", "A100-80GB", tokens), rtol=0.05)


def test_achieved_rates_are_fractions_of_the_datasheet():
    for (gpu, model), (tokens, ops) in vl.measured_operators().items():
        for op in vl.OPERATORS:
            rate = vl.achieved(vl.MODELS[model], vl.PARTS[gpu], op, float(tokens[-1]), float(ops[op][-1]))
            assert 0.2 < rate < 1.0, (gpu, model, op, rate)


def test_swapping_in_vidurs_times_scores_each_part_of_the_layer():
    out = vl.swapped()
    assert set(out) == set(vl.PARTS)
    assert all(0.0 <= g < 1.0 and 0.0 <= pw < 1.0 for g, pw in out.values())


def test_the_attention_profile_parses_with_its_columns():
    with vl.ATTENTION_DATA.open() as f:
        comments = [line for line in f if line.startswith("#")]
    assert len(comments) == 2 and "7ac2fe9" in comments[0] and "MIT" in comments[0]
    rows = vl.measured_attention()
    assert set(rows) == {"batch_size", "prefill_chunk_size", "kv_cache_size", "is_prefill", *vl.ATTENTION_OPERATORS}
    prefill = rows["is_prefill"]
    assert 100 < prefill.sum() and 100 < (~prefill).sum()
    # a prefill row is one chunk with a prefill time and no decode time; a decode row the other way round
    assert np.all(rows["batch_size"][prefill] == 1) and np.all(rows["prefill_chunk_size"][prefill] > 0)
    assert np.all(rows["prefill_chunk_size"][~prefill] == 0) and np.all(rows["batch_size"][~prefill] >= 1)
    assert np.all(np.isnan(rows["attn_decode"][prefill])) and np.all(rows["attn_prefill"][prefill] > 0)
    assert np.all(np.isnan(rows["attn_prefill"][~prefill])) and np.all(rows["attn_decode"][~prefill] > 0)
    assert np.all(rows["kv_cache_size"] + rows["prefill_chunk_size"] <= 4096)
    keys = set(zip(rows["batch_size"], rows["prefill_chunk_size"], rows["kv_cache_size"]))
    assert len(keys) == len(rows["batch_size"])  # no row twice


def test_an_iteration_is_the_layers_times_outside_attention_plus_attention_on_both_sides():
    from flexmesh.cost.device.hardware import Hardware
    from flexmesh.cost.inference.analytic import AnalyticIteration
    from flexmesh.spec.cluster import ClusterSpec
    from flexmesh.spec.devices import DEVICE_PRESETS

    r = vl.iterations()
    assert np.all(r["layers"] == MODEL_PRESETS["llama2-7b"].num_layers)
    assert np.allclose(r["measured"], r["layers"] * (r["measured_outside"] + r["measured_attention"]))
    assert np.allclose(r["predicted"], r["layers"] * (r["predicted_outside"] + r["predicted_attention"]))
    it = AnalyticIteration(MODEL_PRESETS["llama2-7b"], Hardware(ClusterSpec(1, 1, DEVICE_PRESETS["A100-80GB"])))
    tokens, secs = vl.measured()[vl.ITERATION]
    order = np.argsort(tokens)
    write = it.kernels.memory_bound
    for i in (int(np.argmax(~r["is_prefill"])), int(np.argmax(r["is_prefill"]))):  # a decode row, a prefill row
        b, p, c = (int(r[k][i]) for k in ("batch_size", "prefill_chunk_size", "kv_cache_size"))
        if r["is_prefill"][i]:
            assert r["tokens"][i] == p
            kernel, attention = r["attn_prefill"][i], it.attention_s(0, 0, [(c, p)])
            new = p
        else:
            assert r["tokens"][i] == b
            kernel, attention = r["attn_decode"][i], it.attention_s(b, b * c, ())
            new = b
        # Vidur's side: the reshapes around the kernel, and the layer outside attention at the step's tokens
        assert np.isclose(r["measured_attention"][i], r["attn_input_reshape"][i] + kernel + r["attn_output_reshape"][i])
        assert np.isclose(r["measured_outside"][i], np.interp(new, tokens[order], secs[order]))
        # flexmesh's: the analytic iteration's attention over the layers less its KV-cache write, and the layer's
        # GEMMs and pointwise operators at the step's tokens
        assert np.isclose(r["predicted_attention"][i], attention / it.layers - write(2.0 * new * it.kv_token_bytes))
        assert np.isclose(r["predicted_outside"][i], vl.predicted("llama2-7b", "A100-80GB", np.array([float(new)]))[0])


def test_outside_attention_is_vidurs_profiled_sum_at_a_profiled_count():
    tokens, secs = vl.measured()[vl.ITERATION]
    at = np.array([1.0, 64.0, 1024.0])
    assert np.allclose(vl.measured_outside_attention(at), [secs[list(tokens).index(t)] for t in at])


def test_the_whole_iteration_table_scores_prefill_and_decode_apart():
    rows, medians = vl.iteration_rows()
    assert [row[0] for row in rows] == ["prefill", "decode"] and set(medians) == {"prefill", "decode"}
    r = vl.iterations()
    assert [int(row[1]) for row in rows] == [int(r["is_prefill"].sum()), int((~r["is_prefill"]).sum())]
    for row, m in zip(rows, medians.values()):
        assert 0.0 <= m < 1.0 and row[2].endswith("PASS" if m <= vl.BOUND else "FAIL")
    rates = vl.attention_rates()
    assert set(rates) == {"decode", "prefill"} and all(v > 0 and f > 0 for v, f in rates.values())
