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
        # exact: the bench calls the same function on the same tokens
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
    for row, m in zip(rows, medians.values()):  # the device layer alone: a figure, not a target
        assert 0.0 <= m < 1.0 and row[2] == f"{m:.1%}"
    rates = vl.attention_rates()
    assert set(rates) == {"decode", "prefill"} and all(v > 0 and f > 0 for v, f in rates.values())


# ---- the engine's rates (flexmesh.cost.inference.engine_rates) fitted to Vidur's rows, scored held out ---------


def _synthetic_operators(rates):
    """Vidur's operator rows with every time replaced by the device layer's price at ``rates``."""
    out = {}
    for (gpu, model), (tokens, _) in vl.measured_operators().items():
        out[(gpu, model)] = (tokens, vl.predicted_operators(vl.MODELS[model], vl.PARTS[gpu], tokens, rates))
    return out


@pytest.fixture
def fresh_fits():
    """The bench's cached fits cleared before and after (a test that changes the rows fits anew)."""
    for f in (vl.fit_layer_rates, vl.layer_fits, vl.iteration_fits):
        f.cache_clear()
    yield
    for f in (vl.fit_layer_rates, vl.layer_fits, vl.iteration_fits):
        f.cache_clear()


def test_the_layer_fit_recovers_known_rates_from_synthetic_rows(monkeypatch, fresh_fits):
    from flexmesh.cost.inference.engine_rates import EngineRates

    true = EngineRates(gemm=0.8, pointwise=0.5)
    synthetic = _synthetic_operators(true)
    monkeypatch.setattr(vl, "measured_operators", lambda: synthetic)
    for groups in (tuple(sorted(synthetic)), (("a100", "meta-llama/Meta-Llama-3-8B"),)):
        fit = vl.fit_layer_rates(groups)
        assert fit.gemm == pytest.approx(0.8, rel=1e-3) and fit.pointwise == pytest.approx(0.5, rel=1e-3)
        assert fit.prefill_attention == fit.decode_attention == 1.0


def test_held_out_groups_leave_out_the_scored_model_or_gpu():
    keys = sorted(vl.measured_operators())
    for key in keys:
        by_model, by_gpu = vl.held_out_groups(key, "model"), vl.held_out_groups(key, "gpu")
        assert by_model and by_gpu  # every group is scored by a fit to some other
        assert all(m != key[1] for _, m in by_model) and all(g != key[0] for g, _ in by_gpu)
    fits = vl.layer_fits()
    assert set(fits) == {"in sample", "leave one model out", "leave one GPU out"}
    for key in keys:
        # exact: the same fit of the same rows
        assert fits["leave one model out"][key] == vl.fit_layer_rates(vl.held_out_groups(key, "model"))
        assert fits["leave one GPU out"][key] == vl.fit_layer_rates(vl.held_out_groups(key, "gpu"))


def test_rows_held_out_never_enter_the_layer_fit(monkeypatch, fresh_fits):
    key = ("a100", "meta-llama/Llama-2-7b-hf")
    groups = vl.held_out_groups(key, "model")
    before = vl.fit_layer_rates(groups)
    real = vl.measured_operators()
    tokens, ops = real[key]
    corrupt = {**real, key: (tokens, {op: 10.0 * v for op, v in ops.items()})}  # the held-out rows, 10x
    monkeypatch.setattr(vl, "measured_operators", lambda: corrupt)
    vl.fit_layer_rates.cache_clear()
    assert vl.fit_layer_rates(groups) == before  # exact: the same fit of the same rows
    assert vl.fit_layer_rates(tuple(sorted(corrupt))) != before  # where they are fitted, they move the fit


def test_attention_rows_held_out_never_enter_the_attention_fit(monkeypatch, fresh_fits):
    from flexmesh.cost.inference.engine_rates import EngineRates

    rows = vl.measured_attention()
    folds = vl.attention_folds(rows)
    for kind in (rows["is_prefill"], ~rows["is_prefill"]):  # each kind split in two alternating halves
        assert abs(int((folds[kind] == 0).sum()) - int((folds[kind] == 1).sum())) <= 1
    for by, axis in (("context", rows["kv_cache_size"]), ("step", vl.step_tokens(rows))):
        halves = vl.attention_folds(rows, by)
        for kind in (rows["is_prefill"], ~rows["is_prefill"]):  # the half above the kind's median against the rest
            assert axis[kind & (halves == 1)].min() > axis[kind & (halves == 0)].max()
            assert (kind & (halves == 1)).any()
    seen, layer = folds != 0, EngineRates(gemm=0.9, pointwise=0.6)
    before = vl.fit_attention_rates(seen, layer)
    assert (before.gemm, before.pointwise) == (0.9, 0.6)
    corrupt = {c: (np.where(seen, v, 3.0 * v) if c in vl.ATTENTION_OPERATORS else v) for c, v in rows.items()}
    monkeypatch.setattr(vl, "measured_attention", lambda: corrupt)
    assert vl.fit_attention_rates(seen, layer) == before  # exact: the same fit of the same rows
    assert vl.fit_attention_rates(np.ones_like(seen), layer) != before


def test_held_out_iterations_are_priced_by_fits_that_did_not_see_them():
    fits = vl.iteration_fits()
    assert set(fits) == {"in sample", *(f"held out, {split}" for split in vl.SPLITS)}
    keys = tuple(sorted(vl.measured_operators()))
    layer = vl.fit_layer_rates(tuple(k for k in keys if k != vl.ITERATION))
    rows = vl.measured_attention()
    for split, by in vl.SPLITS.items():
        folds, rates = fits[f"held out, {split}"]
        assert np.array_equal(folds, vl.attention_folds(rows, by)) and len(rates) == vl.FOLDS
        for f, r in enumerate(rates):  # fold f is priced by rates fitted to the other fold alone
            assert r == vl.fit_attention_rates(folds != f, layer)  # exact: the same fit of the same rows
    rows, fit_rows, medians = vl.iteration_rate_rows()
    assert [row[0] for row in rows] == ["prefill", "decode"]
    assert set(medians) == {f"held out, {split}" for split in vl.SPLITS}
    for row in rows:  # the targets: judged on the held-out figures, one per split
        for j, by_kind in enumerate(medians.values()):
            m = by_kind[row[0]]
            assert 0.0 <= m < 1.0 and row[4 + j] == f"{m:.1%} {'PASS' if m <= vl.BOUND else 'FAIL'}"
    assert fit_rows[0][0] == "in sample" and len(fit_rows) == 1 + vl.FOLDS * len(vl.SPLITS)


def test_the_layer_table_judges_each_gpu_type_held_out():
    rows, fit_rows, medians = vl.layer_rate_rows()
    assert len(rows) == len(vl.measured()) and all(len(r) == 6 for r in rows)
    assert set(medians) == {"in sample", "leave one model out", "leave one GPU out"}
    assert all(set(m) == set(vl.PARTS.values()) for m in medians.values())
    # every held-out fit names rows that share neither the scored rows' model (or GPU type) with them
    for scheme, fitted, scored, *_ in fit_rows:
        if scheme != "in sample":
            assert not set(fitted.split(", ")) & set(scored.split(", "))


def test_a_part_priced_from_borrowed_tables_is_scored_on_shards_no_fit_saw(monkeypatch, fresh_fits):
    from flexmesh.cost.device.hardware import unmeasured_notes
    from flexmesh.spec.devices import DEVICE_PRESETS

    borrowed = vl.borrowed_measured()
    assert {tp for _, _, tp in borrowed} == {1, 2, 4, 8} and {g for g, _, _ in borrowed} == set(vl.BORROWED)
    for part in vl.BORROWED.values():  # the part has no tables of its own, and serve simulate says so
        assert any(n.startswith(f"{part}: no kernel tables") for n in unmeasured_notes([DEVICE_PRESETS[part]]))
    tokens = np.array([1.0, 4096.0])
    # each GPU's shard: half the heads and MLP width at tp 2 cost less than the whole at tp 1
    one, two = (vl.predicted("llama2-70b", "A40", tokens, tp=tp) for tp in (1, 2))
    assert np.all(two < one) and two[-1] == pytest.approx(one[-1] / 2, rel=0.1)
    rows, medians = vl.borrowed_rows()
    assert len(rows) == len(borrowed) and set(medians) == set(vl.BORROWED.values())
    # its rows enter no fit: the sarathi rates it is priced at are the A100 and H100 rows' alone
    fit = vl.fit_layer_rates(tuple(sorted(vl.measured_operators())))
    assert all(g in vl.PARTS for g, _ in vl.measured_operators())
    corrupt = {k: (t, 10.0 * s) for k, (t, s) in borrowed.items()}
    monkeypatch.setattr(vl, "borrowed_measured", lambda: corrupt)
    vl.fit_layer_rates.cache_clear()
    assert vl.fit_layer_rates(tuple(sorted(vl.measured_operators()))) == fit  # exact: the same fit of the same rows
    assert vl.borrowed_rows()[1] != medians  # yet the scores are of its rows
