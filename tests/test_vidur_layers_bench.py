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
