"""bench/distserve_vllm.py: DistServe's profiles of two engines on its own grid against flexmesh's descriptions."""

from __future__ import annotations

import statistics

import pytest

import bench.distserve_vllm as dv


def test_the_grid_is_distserves_and_every_point_is_priced_both_ways():
    for model, tp in dv.LIMITS:
        points = dv.grid(model, tp)
        assert points and all(b * ((n + 15) // 16 * 16) <= dv.LIMITS[model, tp] for b, n in points)
        assert (1, 4) in points and all(b in dv.BATCHES and n in dv.LENGTHS for b, n in points)
    cases = dv.cases()
    assert len(cases) == 2 * len(dv.PRICED_BY) * sum(len(dv.grid(m, t)) for m, t in dv.LIMITS)
    assert all(c["measured"] > 0 and all(c[name] > -1 for name in dv.PRICED_BY[c["engine"]]) for c in cases)


def test_the_profile_switches_decode_fits_above_its_threshold_and_prefill_grows_with_tokens():
    model, tp = "facebook/opt-13b", 1
    threshold = dv.profile()["vllm", model, tp, "decode_small"][3]
    a, b, c, _ = dv.profile()["vllm", model, tp, "decode_large"]
    big = threshold + 1
    assert dv.profile_s(model, tp, "decode", big, 512) * 1e3 == pytest.approx(a + b * big * 512 + c * big, rel=1e-12)
    assert dv.profile_s(model, tp, "prefill", 1, 2020) > dv.profile_s(model, tp, "prefill", 1, 128)


def test_the_eager_description_never_decodes_faster_and_prices_prompts_alike():
    for model, tp in dv.LIMITS:
        for batch in (1, 16, 128):
            graphed, eager = (dv.priced_s(e, model, tp, "decode", batch, 512) for e in dv.ENGINES)
            assert eager >= graphed
        # prompts run eagerly in vLLM V0 either way (graph_tokens 0)
        assert dv.priced_s(dv.ENGINES[0], model, tp, "prefill", 4, 512) == \
            dv.priced_s(dv.ENGINES[1], model, tp, "prefill", 4, 512)  # exact: the same terms


def test_the_two_engines_profiles_differ_and_distserves_description_drops_the_workers_rpc():
    model = "facebook/opt-13b"
    # DistServe's own engine prefills faster than its vLLM baseline on the same node (its published fits)
    assert dv.profile_s(model, 1, "prefill", 8, 1024, "distserve") < dv.profile_s(model, 1, "prefill", 8, 1024, "vllm")
    # same kernels at tp 1; beyond it vllm-v0 pays its Ray workers' RPC each iteration, the DistServe description not
    ds, eager = dv.engine("distserve"), dv.engine("vllm-v0, eager")
    assert ds.multi_gpu_ms == 0 < eager.multi_gpu_ms and ds.rates.unit and not ds.cuda_graphs
    assert dv.priced_s("distserve", model, 2, "decode", 16, 512) < \
        dv.priced_s("vllm-v0, eager", model, 2, "decode", 16, 512)
    with pytest.raises(ValueError, match="known: vllm-v0"):
        dv.engine("sarathi")


def test_the_distserve_preset_is_nearer_distserves_profile_than_vllm_v0_on_most_rows():
    # DistServe's engine, per model, tp and kind: the median |priced / its fit - 1| of each description
    nearer, worst = 0, {"distserve": 0.0, "vllm-v0": 0.0}
    for model, tp in dv.LIMITS:
        for kind in ("prefill", "decode"):
            med = {}
            for name in worst:
                med[name] = statistics.median(
                    abs(dv.priced_s(name, model, tp, kind, b, n) / dv.profile_s(model, tp, kind, b, n, "distserve") - 1)
                    for b, n in dv.grid(model, tp))  # as the bench reads a row: the median, not one side of it
                worst[name] = max(worst[name], med[name])
            nearer += med["distserve"] < med["vllm-v0"]
    assert nearer > len(dv.LIMITS) and worst["distserve"] < 0.25 < worst["vllm-v0"]
