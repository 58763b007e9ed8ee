"""Calibration: the presets are the fits on the named fitting set, and leave-one-out errors are honest."""

from dataclasses import replace

import numpy as np
import pytest

from flexmesh.cost.training import calibrate
from flexmesh.spec.cluster import DEVICE_PRESETS, GEMM_TABLES


@pytest.fixture(scope="module")
def table():
    return calibrate.calibration_table()


def test_fitting_rows_in_sample_within_15_percent(table):
    for row in table:
        assert 0.85 <= row["ratio"] <= 1.15, row


def test_leave_one_out_errors_meet_the_targets_on_both_gpu_families(table):
    for family, (median, worst) in calibrate.error_summary(table, "loo_ratio").items():
        assert median <= 0.08 and worst <= 0.20, (family, median, worst)
    # a row the fit never saw is predicted worse (or no better) than in sample, on average
    loo = np.mean([abs(r["loo_ratio"] - 1) for r in table])
    ins = np.mean([abs(r["ratio"] - 1) for r in table])
    assert loo >= ins - 1e-6


def test_leave_one_out_refits_without_the_row():
    rows = [(1.0, 2.0), (2.0, 4.0), (3.0, 9.0), (4.0, 8.0)]  # y = c x; the fit is the mean of y / x
    seen = []

    def fit(rs):
        seen.append(tuple(rs))
        return {"c": sum(y / x for x, y in rs) / len(rs)}

    errors = calibrate.leave_one_out(rows, fit, lambda r, p: p["c"] * r[0] / r[1] - 1)
    assert [len(s) for s in seen] == [3, 3, 3, 3]
    assert all(rows[i] not in seen[i] for i in range(4))
    # row 2 (y / x = 3) held out: c = 2, predicted 6 for 9
    assert errors[2] == pytest.approx(6 / 9 - 1)
    assert errors[0] == pytest.approx(7 / 3 / 2 - 1)


def test_leave_one_source_out_uses_nothing_of_the_source(monkeypatch):
    """The A100 rows predicted without Megatron-LM's table: the constants do not move when that table
    does, and come from the H100 fit through the measured GEMM tables."""
    before = calibrate.transferred_params("A100")
    doubled = tuple(replace(r, tflops_per_gpu=2 * r.tflops_per_gpu) if r.family == "A100" else r
                    for r in calibrate.PUBLISHED_RUNS)
    monkeypatch.setattr(calibrate, "PUBLISHED_RUNS", doubled)
    assert calibrate.transferred_params("A100") == before  # exact: the same fit of the same rows
    assert calibrate.fit_efficiencies("A100")["mm_efficiency"] > before["mm_efficiency"]  # in sample it moves
    t = GEMM_TABLES
    h100_fit = calibrate.fit_efficiencies("H100")["mm_efficiency"]
    assert before["mm_efficiency"] == pytest.approx(
        h100_fit * t["a100_sxm"].efficiency / t["h100_sxm"].efficiency)


def test_refit_reproduces_presets():
    a100, h100 = DEVICE_PRESETS["A100-80GB"], DEVICE_PRESETS["H100-80GB"]
    fa = calibrate.fit_efficiencies("A100")
    assert fa["mm_efficiency"] == pytest.approx(a100.mm_efficiency, abs=0.005)
    assert calibrate.fit_efficiencies("H100")["mm_efficiency"] == pytest.approx(h100.mm_efficiency, abs=0.005)
    assert calibrate.fit_attn_efficiency() == pytest.approx(a100.attn_efficiency, abs=0.005)
    intra, inter = calibrate.fit_a2a_efficiency()
    assert (intra, inter) == pytest.approx((a100.a2a_intra_efficiency, a100.a2a_inter_efficiency), abs=0.005)
    # fitted constants stay below the datasheet peak
    assert 0 < h100.mm_efficiency < 1 and 0 < a100.mm_efficiency < 1


def test_fitting_set_names_its_sources_and_both_families():
    families = {r.family for r in calibrate.PUBLISHED_RUNS}
    assert families == {"A100", "H100"}
    assert all("2104.04473" in r.source or "2407.21783" in r.source for r in calibrate.PUBLISHED_RUNS)
    assert len(calibrate.fitting_rows("H100")) >= 3  # enough for leave-one-out of one constant


def test_published_step_time_uses_the_papers_flop_formula():
    run = calibrate.PUBLISHED_RUNS[0]  # 1.7B on 32 GPUs at 137 TFLOP/s
    m, B, s = run.model, run.global_batch, run.seq_len
    flops = (96 * B * s * m.num_layers * m.hidden**2
             * (1 + s / (6 * m.hidden) + m.vocab / (16 * m.num_layers * m.hidden)))
    assert run.published_step_time() == pytest.approx(flops / (32 * 137e12))
