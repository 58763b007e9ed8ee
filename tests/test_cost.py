"""Cost formulas against hand-computed cases on a device with round numbers."""

from dataclasses import replace

import numpy as np
import pytest

from flexmesh.cost import CostModel, Work, group_shape, in_flight, pipeline_time
from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.device.kernels import HBM_EFFICIENCY, LAUNCH_S
from flexmesh.cost.training.analytic import AnalyticTiming, activation_elems_per_token
from flexmesh.layout import LayerStrategy as S
from flexmesh.layout.overlap import FASTEST
from flexmesh.spec import MODEL_PRESETS, ModelSpec, parse_cluster
from flexmesh.spec.cluster import DEVICE_PRESETS, ClusterSpec
from flexmesh.spec.model import with_dtype

GB = 1e9
# 100 TFLOP/s peak at 50% for matmuls and 25% for attention; 100 GB/s NVLink at 100%; 80 GB/s per
# node network (10 GB/s per GPU) at 100%; no latency but NCCL's own inside a node (its tuning model's, which prices
# a ring collective without a measured table: a large message's Simple protocol takes 8.4 us plus 3.4 per ring step
# over NVLink); 80 GiB, nothing reserved; no measured NCCL table.
DEV = replace(DEVICE_PRESETS["A100-80GB"], name="round", peak_tflops=dict.fromkeys(("bf16", "fp16", "fp32"), 100.0),
              mm_efficiency=0.5, attn_efficiency=0.25, nvlink_gbps=100.0, node_net_gbps=80.0, intra_efficiency=1.0,
              inter_efficiency=1.0, a2a_intra_efficiency=1.0, a2a_inter_efficiency=1.0, intra_latency_us=0.0,
              inter_latency_us=0.0, memory_gib=80.0, framework_reserve_gib=0.0, allocator_headroom=0.0,
              hbm_gbps=1000.0, sms=None, comm_table="", kernel_table="")
MODEL = ModelSpec(name="m", num_layers=4, hidden=1024, num_heads=8, num_kv_heads=8, ffn_hidden=4096, vocab=1000)


def cluster(nodes=1, per_node=8):
    return ClusterSpec(nodes=nodes, devices_per_node=per_node, device=DEV)


def test_layer_compute_time_by_hand():
    # "round" has no SM count: GEMMs at peak x mm_efficiency whatever their shape, plus a
    # kernel's fixed cost; memory-bound operators at 1000 GB/s x HBM_EFFICIENCY.
    cm = CostModel(MODEL, cluster())
    lin = 2 * (4 * 1024 * 1024 + 3 * 1024 * 4096)  # q, k, v, o + SwiGLU, 2 FLOPs per weight
    tokens, sq = 4096, 2 * 2048**2
    c = cm.layer(S(), Work(tokens, sq))
    mem = tokens * (10 * 1024 + 2 * (1024 + 1024) + 3 * 4096) * 2 / (1000 * GB * HBM_EFFICIENCY)
    attn = 2 * 1024 * sq / 25e12
    fwd = lin * tokens / 50e12 + 4 * LAUNCH_S + mem + 6 * LAUNCH_S + attn + LAUNCH_S
    bwd = 2 * lin * tokens / 50e12 + 8 * LAUNCH_S + 2 * mem + 6 * LAUNCH_S + 2 * attn + 2 * LAUNCH_S
    assert c.fwd == pytest.approx(fwd)
    assert c.bwd == pytest.approx(bwd)
    rc = cm.layer(S(recompute=True), Work(tokens, sq))
    assert rc.bwd == pytest.approx(bwd + fwd)


def test_tensor_parallel_splits_compute_and_adds_sequence_parallel_collectives():
    cm = CostModel(MODEL, cluster())
    w = Work(4096, 4096 * 4096)
    c1, c4 = cm.layer(S(), w), cm.layer(S(tp=4, dp=1), w)
    # the work splits four ways; the kernels' fixed costs do not
    assert c1.fwd / 4 < c4.fwd < c1.fwd / 4 + 11 * LAUNCH_S
    # 2 all-gathers + 2 reduce-scatters of the 4096 x 1024 bf16 activation over 4 GPUs, 3/4 of it moved, each
    # NCCL's latency of a 3-step ring
    act = 4096 * 1024 * 2
    assert c4.comm_fwd == pytest.approx(4 * (0.75 * act / (100 * GB) + (8.4 + 3 * 3.4) * 1e-6))
    assert c4.comm_bwd == pytest.approx(c4.comm_fwd)


def test_all_reduce_intra_and_inter_node():
    hw = Hardware(cluster(nodes=2))
    n = 2**30
    # Inside a node: ring 2 (n-1)/n over NVLink, 14 steps of NCCL's latency.
    ring = 2 * 7 / 8 * n / (100 * GB) + (8.4 + 14 * 3.4) * 1e-6
    assert hw.collective_time("all_reduce", n, group_shape(8, 1, hw.cluster)) == pytest.approx(ring)
    # 16 ranks on 2 nodes: intra part 2*7/8*n/100GB; inter part 2*1/2*n/(8 NICs x 10 GB/s); the max.
    t = hw.collective_time("all_reduce", n, group_shape(16, 1, hw.cluster))
    assert t == pytest.approx(max(ring, n / (80 * GB)))


def test_all_to_all_across_nodes_is_bounded_by_nics():
    hw = Hardware(cluster(nodes=4))
    n = 2**28
    t = hw.collective_time("all_to_all", n, group_shape(32, 1, hw.cluster))
    # (n-k)/n = 24/32 of the buffer leaves through one 10 GB/s NIC.
    assert t == pytest.approx(max(n * 7 / 32 / (100 * GB), n * 24 / 32 / (10 * GB)))
    arr = hw.collective_time("all_to_all", np.array([n, 2 * n]), group_shape(32, 1, hw.cluster))
    assert arr[1] == pytest.approx(2 * arr[0])


def test_group_shape_strided_groups_span_nodes():
    c = ClusterSpec(nodes=4, devices_per_node=8, device=DEV)
    assert group_shape(4, 8, c).nodes == 4
    assert group_shape(4, 2, c).nodes == 1
    assert group_shape(16, 1, c).nodes == 2


@pytest.mark.parametrize("zero,expected", [(0, 2 + 4 + 12), (1, 2 + 4 + 12 / 8), (2, 2 + (4 + 12) / 8), (3, 18 / 8)])
def test_states_bytes_per_zero_stage(zero, expected):
    cm = CostModel(MODEL, cluster())
    c = cm.layer(S(dp=8, zero=zero), Work(1, 1))
    assert c.states == pytest.approx(MODEL.layer_params * expected)


@pytest.mark.parametrize("dtype,total,zero1", [("bf16", 18, 6 + 12 / 8), ("fp16", 20, 4 + 16 / 8),
                                               ("fp32", 16, 8 + 8 / 8)])
def test_state_bytes_follow_the_training_precision(dtype, total, zero1):
    """Megatron-LM's distributed-optimizer table: 18 / 20 / 16 bytes per parameter, and with the
    optimizer states sharded over d ranks 6 + 12/d, 4 + 16/d, 8 + 8/d."""
    model = with_dtype(MODEL, dtype)
    for zero, expected in ((0, total), (1, zero1)):
        c = CostModel(model, cluster()).layer(S(dp=8, zero=zero), Work(1, 1))
        assert c.states == pytest.approx(model.layer_params * expected)


def test_sharded_data_parallelism_pays_fsdp2_copies_that_no_overlap_hides():
    """FSDP2 splits every all-gather's output into the parameters and packs every reduce-scatter's
    input from the unsharded gradients on the compute stream: with every collective hidden (overlap 1,
    a long window) a ZeRO-3 layer still pays those copies, ZeRO-2 the packing, ZeRO-1 nothing."""
    cm = CostModel(MODEL, cluster())
    cm.hw.overlap = 1.0  # collectives under compute cost nothing more
    big = Work(2**20, 2**20 * 1024)  # a million tokens: every gather and reduce-scatter hides
    weights, grads = MODEL.layer_params * 2, MODEL.layer_params * 4  # bf16 weights, fp32 gradients
    copy = cm.hw.copy_time
    assert copy(2 * weights) == pytest.approx(2 * weights / (1000 * GB * HBM_EFFICIENCY) + LAUNCH_S)
    z3 = cm.layer(S(dp=8, zero=3), big, FASTEST)
    assert z3.comm_fwd == pytest.approx(copy(2 * weights))
    assert z3.comm_bwd == pytest.approx(copy(2 * weights) + copy(2 * grads))
    z2 = cm.layer(S(dp=8, zero=2), big, FASTEST)
    assert (z2.comm_fwd, z2.comm_bwd) == (0.0, pytest.approx(copy(2 * grads)))
    z1 = cm.layer(S(dp=8, zero=1), big, FASTEST)
    assert (z1.comm_fwd, z1.comm_bwd) == (0.0, 0.0)


def test_sharded_data_parallelism_buffers_as_fsdp2_allocates_them():
    """Transient bytes over ZeRO-1: ZeRO-3 holds two layers' gathered weights and one flat all-gather
    output (prefetching; one layer and the output without), and reducing every micro-batch the layer's
    unsharded gradients beside the reduce-scatter input packed from them."""
    cm = CostModel(MODEL, cluster())
    w = Work(4096, 4096 * 1024)
    weights, grads = MODEL.layer_params * 2, MODEL.layer_params * 4
    base = cm.layer(S(dp=8, zero=1), w, FASTEST).transient
    reduce = weights + grads  # unsharded bf16 gradients + the fp32 reduce-scatter input
    assert cm.layer(S(dp=8, zero=3), w, FASTEST).transient - base == pytest.approx(3 * weights + reduce)
    no_prefetch = replace(FASTEST, zero3_prefetch=False)
    assert cm.layer(S(dp=8, zero=3), w, no_prefetch).transient - base == pytest.approx(2 * weights + reduce)
    assert cm.layer(S(dp=8, zero=2), w, FASTEST).transient - base == pytest.approx(reduce)
    # reduced once per step, the gradients stay whole in the states instead: no per-layer buffers
    last = replace(FASTEST, grad_reduce="last")
    assert cm.layer(S(dp=8, zero=2), w, last).transient == pytest.approx(base)


def test_activation_memory_scales_with_tokens_tp_cp_and_recompute():
    cm = CostModel(MODEL, cluster())
    elems = activation_elems_per_token(MODEL)
    assert elems == 6 * 1024 + 2 * 1024 + 4 * 4096
    w = Work(8192, 8192**2)
    assert cm.layer(S(), w).act == pytest.approx(8192 * elems * 2)
    assert cm.layer(S(tp=2, cp=2, cp_kind="ulysses"), w).act == pytest.approx(8192 / 4 * elems * 2)
    rc = cm.layer(S(recompute=True), w)
    assert rc.act == pytest.approx(8192 * 1024 * 2)
    # one layer's activations while recomputing, on top of the buffers any layer needs while it runs
    assert rc.transient - cm.layer(S(), w).transient == pytest.approx(8192 * elems * 2)


def test_ulysses_all_to_all_volume():
    cm = CostModel(MODEL, cluster())
    w = Work(8192, 8192**2)
    c = cm.layer(S(cp=4, cp_kind="ulysses"), w)
    local = 8192 / 4
    qkv, out = local * 3 * 1024 * 2, local * 1024 * 2
    a2a = (qkv + out) * 3 / 4 / (100 * GB)
    assert c.comm_fwd == pytest.approx(a2a)


@pytest.mark.parametrize("mesh", [dict(tp=2, cp=4, cp_kind="ulysses"), dict(tp=2, cp=4, cp_kind="ring")])
def test_selective_recompute_repeats_the_context_parallel_collectives_but_not_tp(mesh):
    # The runtime checkpoints the attention core (attend: Ulysses all-to-alls, ring K/V passes); its
    # backward runs the core's forward again, the TP collectives around the projections not.
    cm = CostModel(MODEL, cluster())
    w = Work(4 * 1024, 4 * 1024**2)
    none, sac, full = (cm.layer(S(**mesh, recompute=r), w) for r in ("none", "selective", "full"))
    tp_only = cm.layer(S(tp=2), Work(w.tokens / 4, w.sq_tokens / 16))  # the same tokens per device
    cp_fwd = none.comm_fwd - tp_only.comm_fwd  # the forward's context-parallel communication
    assert cp_fwd > 0
    assert sac.comm_fwd == pytest.approx(none.comm_fwd)
    assert sac.comm_bwd == pytest.approx(none.comm_bwd + cp_fwd)
    # full recomputation repeats the TP collectives as well
    assert full.comm_bwd == pytest.approx(none.comm_bwd + none.comm_fwd)


def test_ring_hides_under_attention_when_blocks_are_long():
    cm = CostModel(MODEL, cluster())
    short, long_ = Work(4 * 256, 4 * 256**2), Work(131072, 131072**2)
    ring = S(cp=4, cp_kind="ring")
    hop = cm.hw.collective_time("send_recv", 131072 / 4 * 2 * MODEL.kv_dim * 2, group_shape(4, 1, cm.cluster))
    # K/V hop << one attention block: all of it overlaps; what the overlap does not save stays
    assert cm.layer(ring, long_).comm_fwd == pytest.approx(3 * (1 - cm.hw.overlap) * hop)
    assert cm.layer(ring, long_).comm_fwd < 0.2 * 3 * hop
    # short blocks: each hop is exposed as far as it exceeds one block of the forward's attention
    small_hop = cm.hw.collective_time("send_recv", 1024 / 4 * 2 * MODEL.kv_dim * 2, group_shape(4, 1, cm.cluster))
    block = cm.timing.layer_times(ring, short.tokens, short.sq_tokens).attention / 4
    assert cm.layer(ring, short).comm_fwd == pytest.approx(3 * cm.hw.exposed(small_hop, block))


def test_pipeline_formulas():
    assert pipeline_time("1f1b", [1, 2, 1], m=4) == pytest.approx(4 + 3 * 2)
    assert pipeline_time("gpipe", [1, 1], m=1) == pytest.approx(2)
    assert pipeline_time("interleaved", [1, 1, 1, 1], m=8, v=4) == pytest.approx(8 + 3 / 4)
    assert [in_flight("1f1b", 4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 4, 0, 2) == 2
    assert in_flight("gpipe", 4, 3, 8) == 8
    # Megatron's interleaved warm-up on rank 0 of 4 with 2 chunks: (4-1)*2 + 4 + 1 = 11 chunks = 5.5 stages.
    assert in_flight("interleaved", 4, 0, 8, v=2) == pytest.approx(5.5)


def test_evaluate_stages_adds_up_and_reports_memory():
    cm = CostModel(MODEL, cluster())
    s = S(dp=8, zero=1)
    ev = cm.evaluate_stages([[s] * 4], pp=1, pipeline_schedule="1f1b", m=2, v=1, microbatch_seqs=8,
                             seq_len=1024)
    stage = cm.stage_cost([s] * 4, 8, 1024, True, True)
    assert ev.stage_times[0] == pytest.approx(stage.time)
    assert ev.step_time >= 2 * stage.time
    assert ev.memory[0]["states"] == pytest.approx(stage.states)
    assert ev.tokens_per_s == pytest.approx(2 * 8 * 1024 / ev.step_time)
    assert 0 < ev.mfu < 0.5


def test_recompute_trades_time_for_memory_in_a_plan():
    cm = CostModel(MODEL, cluster())
    plain = cm.evaluate_stages([[S(dp=8)] * 4], 1, "1f1b", 1, 1, 8, 4096)
    rc = cm.evaluate_stages([[S(dp=8, recompute=True)] * 4], 1, "1f1b", 1, 1, 8, 4096)
    assert rc.step_time > plain.step_time
    assert rc.peak_memory < plain.peak_memory


def test_pipeline_memory_first_stage_holds_more_micro_batches():
    cm = CostModel(MODEL, cluster())
    s = S(dp=2)
    ev = cm.evaluate_stages([[s], [s], [s], [s]], 4, "1f1b", 8, 1, 2, 1024)
    acts = [m["activations"] for m in ev.memory]
    w = cm.layer_work(s, 2, 1024)
    layer, embed = cm.layer(s, w).act, cm.ends(s, w, True, False).act
    assert acts[3] == pytest.approx(layer)
    assert acts[0] == pytest.approx(4 * (layer + embed))  # 1F1B: pp - rank micro-batches in flight
    assert ev.memory[3]["logits"] > 0 and ev.memory[0]["logits"] == 0


def test_microbatch_time_matches_layer_sum_without_overlap():
    cm = CostModel(MODEL, cluster())
    s = S(tp=2, cp=2, cp_kind="ulysses")
    w = Work(8192, 3 * 2048**2 + 2048**2)
    per_layer = cm.layer(s, w)
    head = cm.ends(s, w, False, True)
    expected = MODEL.num_layers * (per_layer.fwd + per_layer.bwd + per_layer.comm_fwd + per_layer.comm_bwd)
    expected += head.fwd + head.bwd
    assert cm.microbatch_time(s, w.tokens, w.sq_tokens) == pytest.approx(expected)


def test_max_tokens_respects_budget():
    cm = CostModel(MODEL, cluster())
    s = S(cp=2, cp_kind="ulysses", zero=3)
    t = cm.max_tokens(s)
    assert t > 0
    assert cm.max_tokens(replace(s, recompute=True)) > t
    assert cm.max_tokens(replace(s, cp=4)) > t


# ---- kernels: GEMMs by shape, memory-bound operators by bytes, attention by block ----------------
def h100_kernels():
    return Hardware(ClusterSpec(nodes=1, devices_per_node=8, device=DEVICE_PRESETS["H100-80GB"])).kernels


def test_gemm_efficiency_rises_with_size_and_stays_below_the_fitted_peak():
    k = h100_kernels()  # the measured form (the device layer's) at the training rate
    assert k.gemm_measured is not None and k.mm_flops < DEVICE_PRESETS["H100-80GB"].peak_flops("bf16")
    effs = [float(k.gemm_efficiency(m, 4096, 4096)) for m in (16, 128, 1024, 8192, 65536)]
    assert effs == sorted(effs) and effs[0] < 0.1 and effs[-1] <= 1.0 and effs[-1] > 0.9
    # the tile model of a device without measured kernels (a device table of a cluster file)
    k = Hardware(ClusterSpec(1, 8, replace(DEVICE_PRESETS["H100-80GB"], kernel_table=""))).kernels
    assert k.sms == 132 and k.gemm_measured is None
    effs = [float(k.gemm_efficiency(m, 4096, 4096)) for m in (128, 1024, 8192, 65536)]
    assert effs == sorted(effs) and effs[0] < 0.3 and effs[-1] <= 1.0 and effs[-1] > 0.95
    # wave quantization: one tile more than there are SMs takes a second wave, at half the efficiency
    full, spill = k.gemm_efficiency(12 * 128, 11 * 128, 8192), k.gemm_efficiency(12 * 128 + 1, 11 * 128, 8192)
    assert full > 0.9 and spill == pytest.approx(full / 2, rel=0.05)
    # array shapes price elementwise, empty GEMMs cost nothing
    arr = k.gemm(np.array([0.0, 1024.0, 8192.0]), 4096, 4096)
    assert arr[0] == 0.0 and arr[1] == pytest.approx(k.gemm(1024.0, 4096, 4096))


def test_memory_bound_time_scales_with_bytes_and_hbm_bandwidth():
    k = h100_kernels()
    one, two = k.memory_bound(1e9, 1), k.memory_bound(2e9, 1)
    assert two - k.launch_s == pytest.approx(2 * (one - k.launch_s))
    assert one - k.launch_s == pytest.approx(1e9 / (3350e9 * HBM_EFFICIENCY))
    a40 = Hardware(ClusterSpec(1, 8, DEVICE_PRESETS["A100-40GB"])).kernels
    a80 = Hardware(ClusterSpec(1, 8, DEVICE_PRESETS["A100-80GB"])).kernels
    assert (a40.memory_bound(1e9, 0) / a80.memory_bound(1e9, 0)) == pytest.approx(2039 / 1555)


def test_attention_efficiency_falls_for_short_blocks():
    k = h100_kernels()
    effs = [k.attention_efficiency(b) for b in (100, 512, 2048, 16384)]
    assert effs == sorted(effs) and effs[0] < 0.5 and effs[-1] < 1.0


def test_ring_attention_pays_the_last_ranks_blocks_and_merges():
    spec = MODEL_PRESETS["llama3-70b"]
    cm = CostModel(spec, parse_cluster("8xH100"))
    tokens, sq = 8192.0, 8192.0**2
    attn = {cp: cm.timing.layer_times(S(cp=cp, cp_kind="ring" if cp > 1 else "none"), tokens, sq).attention
            for cp in (1, 4)}
    # contiguous slices: the last of 4 ranks computes 3.5 of the 8 blocks' work, 1.75x its share
    assert attn[4] > 1.75 * attn[1] / 4
    balanced = AnalyticTiming(spec, cm.hw, ring_balanced=True)
    assert balanced.layer_times(S(cp=4, cp_kind="ring"), tokens, sq).attention < attn[4] / 1.4


def test_small_models_lose_more_to_non_gemm_work_on_h100_than_on_a100():
    """Memory-bound operators weigh more where the peak is high against HBM, and in small models (attention
    left out: its rate is another constant, attn_efficiency, not the GEMMs' nor HBM's)."""
    from flexmesh.cost.device.layer_shapes import linear_shapes

    def non_gemm_share(model, device):
        spec = MODEL_PRESETS[model]
        cm = CostModel(spec, parse_cluster(f"8x{device}"))
        k, tokens = cm.timing.kernels, 8192.0
        gemms = sum(sum(k.linear(tokens, n, kk)) for n, kk in linear_shapes(spec, 1))
        lt = cm.timing.layer_times(S(), tokens, 0.0)
        return 1.0 - float(gemms) / float(lt.fwd + lt.bwd)
    assert non_gemm_share("llama3-8b", "H100") > non_gemm_share("llama3-8b", "A100-80GB") > 0.0
    assert non_gemm_share("llama3-8b", "H100") > non_gemm_share("llama3-70b", "H100")


def test_llama3_70b_at_8k_on_h100_plans_no_context_parallelism():
    """At 8K tokens context parallelism buys nothing the tensor-parallel layouts do not: small
    attention blocks, the ring's last rank and its merges cost what they cost."""
    from flexmesh.search import SearchRequest, SearchSpace, best_plans
    req = SearchRequest(MODEL_PRESETS["llama3-70b"], parse_cluster("128x8xH100"), 8192, 1024, top=1, mode="fast",
                        space=SearchSpace(pp=(4, 8), microbatches=(16, 32, 64)))
    best = best_plans(req, with_baselines=False).best
    assert all(s.cp == 1 for st in best.plan.stages for s in st.strategies), best.plan.layout


def test_pipeline_sends_leave_the_node_only_at_node_edges():
    """pp 8 over 4 nodes of 8 GPUs, 4 GPUs a stage (tp2-dp2): the sends of pipeline ranks 1, 3 and 5
    go to the next node and pay its network; the others stay on the node's links. A slower node network
    slows exactly those ranks."""
    from flexmesh.cost.device.hardware import GroupShape

    model = MODEL_PRESETS["llama2-7b"]
    fast = CostModel(model, parse_cluster("4x8xA100-40GB"))
    slow = CostModel(model, ClusterSpec(4, 8, replace(DEVICE_PRESETS["A100-40GB"], node_net_gbps=1.25)))
    crossing = slow.pipeline_crossings(8)
    assert crossing == (False, True, False, True, False, True, False, False)
    assert slow.pipeline_crossings(8, v=2)[-1]  # interleaved, the last rank sends on to the first
    s = S(tp=2, dp=2)
    chunks = [[s] * 4] * 8
    ev_fast = fast.evaluate_stages(chunks, 8, "1f1b", 16, 1, 2, 4096)
    ev_slow = slow.evaluate_stages(chunks, 8, "1f1b", 16, 1, 2, 4096)
    for r, crosses in enumerate(crossing):
        if crosses:
            assert ev_slow.stage_times[r] > ev_fast.stage_times[r] + 0.01
        else:
            assert ev_slow.stage_times[r] == pytest.approx(ev_fast.stage_times[r])
    nbytes = 4096 / 2 * model.hidden * model.dtype_bytes  # one sequence per data rank, each TP rank's half
    assert slow.pipeline_p2p(s, 2, 4096, 8, crosses_nodes=False) == pytest.approx(
        2 * slow.hw.collective_time("send_recv", nbytes, GroupShape(2, 2)))
    # a stage as wide as a node: every send crosses
    assert fast.pipeline_crossings(4) == (True,) * 4
