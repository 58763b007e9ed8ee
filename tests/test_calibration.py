"""The preset efficiencies reproduce published training throughput, and the fits can be redone."""

import pytest

from flexmesh.cost import calibrate
from flexmesh.spec.cluster import DEVICE_PRESETS


@pytest.mark.parametrize("row", calibrate.calibration_table(), ids=lambda r: r["run"])
def test_published_runs_within_15_percent(row):
    assert 0.85 <= row["ratio"] <= 1.15, row


def test_refit_reproduces_presets():
    a100, h100 = DEVICE_PRESETS["A100-80GB"], DEVICE_PRESETS["H100-80GB"]
    fa = calibrate.fit_efficiencies("A100")
    assert fa["mm_efficiency"] == pytest.approx(a100.mm_efficiency, abs=0.005)
    assert fa["unfused_attn_efficiency"] == pytest.approx(calibrate.UNFUSED_ATTN_EFFICIENCY, abs=0.005)
    assert calibrate.fit_efficiencies("H100")["mm_efficiency"] == pytest.approx(h100.mm_efficiency, abs=0.005)
    assert calibrate.fit_attn_efficiency() == pytest.approx(a100.attn_efficiency, abs=0.005)
    intra, inter = calibrate.fit_a2a_efficiency()
    assert (intra, inter) == pytest.approx((a100.a2a_intra_efficiency, a100.a2a_inter_efficiency), abs=0.005)


def test_published_step_time_uses_the_papers_flop_formula():
    run = calibrate.PUBLISHED_RUNS[0]  # 1.7B on 32 GPUs at 137 TFLOP/s
    m, B, s = run.model, run.global_batch, run.seq_len
    flops = (96 * B * s * m.num_layers * m.hidden**2
             * (1 + s / (6 * m.hidden) + m.vocab / (16 * m.num_layers * m.hidden)))
    assert run.published_step_time() == pytest.approx(flops / (32 * 137e12))
