"""An engine's own rates on the device layer's kernels: named factors, each on one rate, fitted back from rows."""

from __future__ import annotations

import numpy as np
import pytest

from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.inference.analytic import AnalyticIteration
from flexmesh.cost.inference.engine_rates import TERMS, EngineRates, fit_engine_rates, fit_rate
from flexmesh.errors import SpecError
from flexmesh.spec import MODEL_PRESETS, parse_cluster

MODEL = MODEL_PRESETS["llama2-7b"]
TRUE = EngineRates(gemm=0.8, pointwise=0.55, prefill_attention=0.45, decode_attention=1.25)
TOKENS = np.array([1.0, 16.0, 128.0, 1024.0, 8192.0])
DECODES = [(b, c) for b in (1, 8, 64) for c in (256, 2048)]  # (requests, context each)
CHUNKS = [(c, n) for c in (0, 1024) for n in (128, 512, 2048)]  # (context, chunk)


def _hw() -> Hardware:
    return Hardware(parse_cluster("1xA100-80GB"))


def _terms(rates: EngineRates) -> dict[str, np.ndarray]:
    """Each term's rows priced at ``rates``: a layer's GEMMs and streaming kernels at ``TOKENS``, decode-only and
    prefill-only attention."""
    it = AnalyticIteration(MODEL, rates.on(_hw()))
    k = it.kernels
    return {"gemm": np.concatenate([k.gemm(TOKENS, n, red) for n, red in it.shapes]),
            "pointwise": k.memory_bound(TOKENS * it.pointwise_bytes, 4),
            "decode_attention": np.array([it.attention_s(b, b * c, ()) for b, c in DECODES]),
            "prefill_attention": np.array([it.attention_s(0, 0, [chunk]) for chunk in CHUNKS])}


def test_no_rates_and_unit_rates_price_as_the_device_layer():
    hw = _hw()
    plain, unit = AnalyticIteration(MODEL, hw), AnalyticIteration(MODEL, EngineRates().on(hw))
    assert unit.kernels is plain.kernels is hw.device_kernels
    batch = [(1000, 1)] * 8 + [(0, 512)]
    assert unit.iteration_s(batch) == plain.iteration_s(batch)  # exact: the same kernels object prices both


def test_each_rate_scales_its_own_kernels_and_leaves_the_fixed_costs():
    hw = _hw()
    k, slow = hw.device_kernels, TRUE.kernels(hw.device_kernels)
    assert slow.mm_flops == k.mm_flops * TRUE.gemm and slow.attn_flops == k.attn_flops * TRUE.prefill_attention
    assert slow.hbm_bytes_per_s == k.hbm_bytes_per_s * TRUE.pointwise  # exact: the same product
    assert slow.decode_measured.hbm_bytes_per_s == k.decode_measured.hbm_bytes_per_s * TRUE.decode_attention
    assert slow.gemm_measured == k.gemm_measured and slow.attn_measured == k.attn_measured  # fixed costs, GEMM bytes
    assert slow.launch_s == k.launch_s and slow.decode_measured.fixed_s == k.decode_measured.fixed_s
    # a large GEMM is compute-bound: about 1 / gemm slower; a one-row GEMM reads its weights at the same rate
    assert float(slow.gemm(8192, 4096, 4096) / k.gemm(8192, 4096, 4096)) == pytest.approx(1 / TRUE.gemm, rel=0.03)
    assert float(slow.gemm(1, 4096, 4096) / k.gemm(1, 4096, 4096)) == pytest.approx(1.0, rel=0.01)


def test_the_fit_recovers_known_rates_from_synthetic_rows():
    measured = _terms(TRUE)
    rows = {name: (lambda r, n=name: _terms(r)[n], measured[name]) for name in TERMS}
    # the layer's rates first; attention's rows write the KV cache at the streaming rate, so their rates are
    # fitted with the layer's as the base
    layer = fit_engine_rates({n: rows[n] for n in ("gemm", "pointwise")}, "layer")
    fit = fit_engine_rates({n: rows[n] for n in ("prefill_attention", "decode_attention")}, "synthetic", layer)
    for name in TERMS:
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-3), name
    assert fit.source == "synthetic"
    # a term not named keeps the device layer's rate
    only = fit_engine_rates({"gemm": rows["gemm"]}, "gemm only")
    assert only.gemm == pytest.approx(TRUE.gemm, rel=1e-3) and only.pointwise == only.decode_attention == 1.0


def test_the_fit_sees_only_the_rows_it_prices():
    k = _hw().device_kernels
    shapes = np.array([512.0, 4096.0, 8192.0])
    seen = EngineRates(gemm=0.7).kernels(k).gemm(shapes, 4096, 4096)
    # rows the fit does not price cannot move it, whatever they hold
    assert fit_rate(lambda f: EngineRates(gemm=f).kernels(k).gemm(shapes, 4096, 4096), seen) == \
        pytest.approx(0.7, rel=1e-4)
    with pytest.raises(ValueError):
        fit_rate(lambda f: np.array([]), np.array([]))
    with pytest.raises(ValueError):
        fit_engine_rates({"overhead": (lambda r: seen, seen)}, "x")


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_rate_is_a_positive_factor(bad):
    with pytest.raises(SpecError):
        EngineRates(gemm=bad)
