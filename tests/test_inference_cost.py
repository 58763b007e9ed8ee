"""Inference pricing on the device layer: decode is memory-bound, prefill scales with its tokens, KV bytes and
capacity, tensor and pipeline parallelism, KV transfer paths, the engine overhead, and the interface's
fallback for timings that price only whole batches."""

from __future__ import annotations

import pytest

from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.device.layer_shapes import linear_shapes, pointwise_elems, pointwise_elems_per_token
from flexmesh.cost.inference.analytic import AnalyticIteration
from flexmesh.cost.inference.memory import (
    kv_bytes_per_token,
    kv_bytes_per_token_on_device,
    kv_capacity,
    weight_bytes_on_device,
)
from flexmesh.cost.inference.overhead import EngineOverhead, fit_overhead, parse_overhead, preset_overhead
from flexmesh.cost.inference.timing import split_s
from flexmesh.cost.inference.transfer import Span, kv_path
from flexmesh.errors import SpecError
from flexmesh.spec import MODEL_PRESETS, parse_cluster
from flexmesh.spec.cluster import parse_mixed_cluster

LLAMA8 = MODEL_PRESETS["llama3-8b"]


def _it(model=LLAMA8, cluster="8xH100", tp=1, pp=1, overhead=None):
    return AnalyticIteration(model, Hardware(parse_cluster(cluster)), tp, pp, overhead)


@pytest.mark.parametrize("cluster", ["8xH100", "8xA100-40GB", "8xL4", "8xA10G"])
def test_a_decode_iteration_is_memory_bound_doubling_a_small_batch_costs_far_less_than_double(cluster):
    it = _it(cluster=cluster, overhead=EngineOverhead(0.0, 0.0, "none"))
    for b in (1, 2, 4, 8):
        one, two = it.iteration_s([(512, 1)] * b), it.iteration_s([(512, 1)] * (2 * b))
        assert two < 1.2 * one, (cluster, b, one, two)
    # and far below b times one request's step: the weights are read once per iteration
    assert it.iteration_s([(512, 1)] * 16) < 2 * it.iteration_s([(512, 1)])


def test_decode_attention_grows_with_the_kv_it_reads_and_the_decode_sum_is_exact():
    it = _it()
    short, long = it.split_s(8, 8 * 100, ()), it.split_s(8, 8 * 8000, ())
    assert long > short
    # the summed form prices the same as the batch spelled out (constant time in the decodes)
    batch = [(100 + i, 1) for i in range(8)]
    assert it.split_s(8, sum(c for c, _ in batch), ()) == pytest.approx(it.iteration_s(batch), rel=1e-12)
    assert it.decode_run_s(8, 800, 5) == pytest.approx(sum(it.split_s(8, 800 + 8 * k, ()) for k in range(5)),
                                                       rel=1e-12)


@pytest.mark.parametrize("cluster", ["8xH100", "8xA100-80GB"])
def test_prefill_scales_with_its_tokens(cluster):
    it = _it(cluster=cluster)
    t = {n: it.iteration_s([(0, n)]) for n in (1024, 2048, 4096, 8192)}
    for n in (1024, 2048, 4096):
        # but where the A100's 1024-row GEMMs run 1.2 waves of 128 x 256 tiles on its 108 SMs, the second mostly
        # idle: its measured table times 1024 x 4096 x 4096 at 204 us and 2048 rows at 305 us (the wave term)
        low = 1.7 if (cluster, n) == ("8xA100-80GB", 1024) else 1.8
        assert low < t[2 * n] / t[n] < 2.3, (n, t)
    # a chunk against a long prefix costs more than the same chunk alone (attention over the context)
    assert it.iteration_s([(30_000, 2048)]) > it.iteration_s([(0, 2048)])


def test_terms_sum_to_the_iteration_and_the_overhead_is_never_zero_by_default():
    it = _it()
    terms = it.terms(16, 16 * 500, [(0, 1000)])
    assert sum(terms.values()) == pytest.approx(it.split_s(16, 16 * 500, [(0, 1000)]), rel=1e-12)
    assert terms["overhead"] > 0 and it.overhead.source.startswith("preset vllm")
    assert it.iteration_s([]) == 0.0


def test_tensor_parallelism_adds_all_reduces_but_splits_the_weights():
    one, four = _it(MODEL_PRESETS["llama3-70b"], tp=4), _it(MODEL_PRESETS["llama3-70b"], tp=8)
    assert four.iteration_s([(1000, 1)] * 8) < one.iteration_s([(1000, 1)] * 8)
    assert weight_bytes_on_device(MODEL_PRESETS["llama3-70b"], 8, 1) == pytest.approx(
        weight_bytes_on_device(MODEL_PRESETS["llama3-70b"], 4, 1) / 2)
    with pytest.raises(SpecError, match="tp 3 does not divide"):
        _it(tp=3)
    with pytest.raises(SpecError, match="mixture of experts"):
        _it(MODEL_PRESETS["mixtral-8x7b"], tp=2)


def test_a_pipeline_runs_its_stages_one_after_another_plus_sends():
    flat, piped = _it(tp=2), _it(tp=2, pp=2)
    batch = [(0, 4096)]
    assert piped.iteration_s(batch) > flat.iteration_s(batch)  # the same layers one stage after another, plus a send
    assert weight_bytes_on_device(LLAMA8, 1, 2) < 0.6 * weight_bytes_on_device(LLAMA8, 1, 1)


@pytest.mark.parametrize("device", ["H100", "A100-40GB", "L40S", "L4"])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (4, 1), (8, 2), (8, 4)])
@pytest.mark.parametrize("all_reduce", ["nccl", "vllm"])
def test_count_terms_priced_by_blocks_are_the_ones_priced_one_by_one(device, tp, pp, all_reduce):
    hw = Hardware(parse_cluster(f"4x8x{device}"))
    model = MODEL_PRESETS["llama3-8b"]
    one, blocks = (AnalyticIteration(model, hw, tp, pp, block=b, all_reduce=all_reduce) for b in (0, 64))
    tokens = [1, 2, 63, 64, 65, 127, 128, 511, 512, 513, 1000, 4097, 8192, 9001]
    for decodes in (False, True):  # exact: the same numpy ufuncs element by element on arrays and scalars
        assert [blocks.dense_s(t, decodes) for t in tokens] == [one.dense_s(t, decodes) for t in tokens]
    # exact: the same numpy ufuncs element by element on arrays and scalars
    assert [blocks.head_s(n) for n in tokens] == [one.head_s(n) for n in tokens]
    assert len(blocks._dense[False]) > len(tokens) and len(blocks._head) > len(tokens)  # the blocks around them too
    batch = [(900, 1)] * 20 + [(0, 700), (30, 33)]
    # exact: the same terms, by blocks or one by one (the ufuncs above)
    assert blocks.iteration_s(batch) == one.iteration_s(batch)


def test_kv_bytes_and_capacity():
    assert kv_bytes_per_token(LLAMA8) == 2 * 32 * 8 * 128 * 2
    # tp 16 > 8 KV heads: each device keeps one head, replicated
    assert kv_bytes_per_token_on_device(LLAMA8, 16, 1) == kv_bytes_per_token_on_device(LLAMA8, 8, 1)
    h100 = parse_cluster("8xH100").device
    c = kv_capacity(LLAMA8, h100, 1, 1, 8192, 1024)
    assert c.fraction == 0.9
    assert c.kv_bytes == pytest.approx(h100.memory_gib * 2**30 * 0.9 - c.reserve_bytes - c.weight_bytes
                                       - c.activation_bytes)
    assert c.tokens == c.blocks * 16 and c.blocks * 16 * c.kv_bytes_per_token <= c.kv_bytes
    less = kv_capacity(LLAMA8, h100, 1, 1, 8192, 1024, fraction=0.5)
    assert less.blocks < c.blocks
    assert kv_capacity(LLAMA8, h100, 2, 1, 8192, 1024).blocks > 2 * c.blocks  # weights split, KV heads split
    with pytest.raises(SpecError, match="no room for a KV cache"):
        kv_capacity(MODEL_PRESETS["llama3-70b"], parse_cluster("8xL4").device, 1, 1, 2048, 256)


def test_kv_transfer_paths_follow_the_cluster():
    c = parse_mixed_cluster("2x8xH100+1x8xA100-40GB")
    same_node = kv_path(Span(0, frozenset({0}), 2), Span(0, frozenset({0}), 2), c)
    other_node = kv_path(Span(0, frozenset({0}), 2), Span(0, frozenset({1}), 2), c)
    other_group = kv_path(Span(0, frozenset({0}), 2), Span(1, frozenset({2}), 2), c)
    assert same_node.via == "nvlink" and other_node.via == "network" and other_group.via == "link 0-1"
    gib = float(2**30)
    assert same_node.seconds(gib) < other_node.seconds(gib)
    assert other_group.seconds(gib) == pytest.approx(c.link(0, 1).latency_us * 1e-6
                                                     + gib / (c.link(0, 1).gbps * 1e9 * 0.85))
    assert same_node.seconds(0) == 0.0
    wide = kv_path(Span(0, frozenset({0}), 4), Span(0, frozenset({0}), 4), c)
    assert wide.bytes_per_s == pytest.approx(2 * same_node.bytes_per_s)  # twice the devices, twice the streams
    pcie = parse_mixed_cluster("8xL4")
    assert kv_path(Span(0, frozenset({0}), 1), Span(0, frozenset({0}), 1), pcie).via == "pcie"


def test_engine_overhead_is_fitted_to_its_samples_and_can_be_given():
    o = preset_overhead()
    assert o.fixed_s > 0 and o.per_request_s > 0
    assert fit_overhead([1, 2, 3], [2.0, 3.0, 4.0]) == pytest.approx((1e-3, 1e-3))
    assert parse_overhead("0.5").seconds(100) == pytest.approx(0.5e-3)
    for bad in ("-1", "a,b", "1,2,3"):
        with pytest.raises(SpecError, match="FIXED_MS"):
            parse_overhead(bad)


def test_a_timing_that_prices_only_whole_batches_is_asked_with_the_decodes_spelled_out():
    class Linear:
        def iteration_s(self, batch):
            return 1e-3 + sum(2e-6 * ctx + 1e-5 * new for ctx, new in batch)

    got = split_s(Linear(), 3, 301, [(0, 50)])
    assert got == pytest.approx(Linear().iteration_s([(101, 1), (100, 1), (100, 1), (0, 50)]))
    it = _it()
    assert split_s(it, 3, 300, []) == it.split_s(3, 300, [])  # exact: split_s calls the timing's own split_s


def test_the_shared_layer_shapes_are_the_training_models():
    from flexmesh.cost.training import analytic

    assert analytic.linear_shapes is linear_shapes and analytic.pointwise_elems_per_token is pointwise_elems_per_token
    p = pointwise_elems(LLAMA8)
    assert pointwise_elems_per_token(LLAMA8) == (p.norms + p.rotary, p.activation)
