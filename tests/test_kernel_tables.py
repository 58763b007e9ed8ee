"""The device layer's kernel-true rates (``Hardware.device_kernels``) beside a training step's (``Hardware.kernels``):
the fitted constants of devices.toml, the framework terms between the two, and the fits that redo them."""

from dataclasses import replace

import numpy as np
import pytest

from flexmesh.cost.device import gemm_tables
from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.device.kernels import Kernels, MeasuredGemm, cached_memory
from flexmesh.spec.cluster import ClusterSpec, parse_cluster
from flexmesh.spec.devices import (
    ATTENTION_KERNELS,
    ATTENTION_TABLES,
    DECODE_KERNELS,
    DEVICE_PRESETS,
    GEMM_KERNELS,
    GEMM_TABLES,
    DeviceSpec,
)

FITTED = ("A100-80GB", "H100-80GB")  # the parts the end-to-end fits were made on


def hardware(name: str) -> Hardware:
    return Hardware(ClusterSpec(1, 8, DEVICE_PRESETS[name]))


def test_every_measured_system_has_kernel_constants_and_every_part_reads_its_tables():
    assert set(GEMM_TABLES) == set(ATTENTION_KERNELS) == set(ATTENTION_TABLES) == set(DECODE_KERNELS)
    assert set(GEMM_KERNELS) == set(GEMM_TABLES) | set(gemm_tables.DEEPBENCH)
    for d in DEVICE_PRESETS.values():
        gemm = d.gemm_table or d.kernel_table
        assert d.kernel_mm_efficiency == GEMM_KERNELS[gemm]["efficiency"]
        assert d.kernel_attn_efficiency == ATTENTION_KERNELS[d.kernel_table]["efficiency"]
        dev = Hardware(ClusterSpec(1, 1, d), d.peak_tflops and next(iter(d.peak_tflops))).device_kernels
        assert dev.gemm_measured is not None and dev.attn_measured is not None
        assert dev.gemm_measured.fixed_s == GEMM_KERNELS[gemm]["fixed_us"] * 1e-6  # exact: the same product
        assert dev.attn_overhead == ATTENTION_KERNELS[d.kernel_table]["overhead_keys"]
        dec = DECODE_KERNELS[d.kernel_table]
        assert dev.decode_measured is not None and dev.decode_measured.hbm_bytes_per_s == pytest.approx(
            dec["hbm_fraction"] * d.hbm_gbps * 1e9, rel=1e-12)


@pytest.mark.parametrize("name", list(DEVICE_PRESETS))
def test_a_training_step_prices_the_device_layers_kernels_at_the_framework_terms(name):
    d = DEVICE_PRESETS[name]
    dtype = "bf16" if "bf16" in d.peak_tflops else "fp16"
    hw = Hardware(ClusterSpec(1, 8, d), dtype)
    peak = d.peak_flops(dtype)
    # one device layer: a training step's kernels are the device layer's forms, the very objects serving prices with
    dev, step = hw.device_kernels, hw.kernels
    assert step.gemm_measured is dev.gemm_measured is not None and step.attn_measured is dev.attn_measured is not None
    assert step.decode_measured is dev.decode_measured
    # at the end-to-end fits' rates: the device layer's kernel rates times the framework terms
    # (a power-capped part, the T4, at the clock it sustains: the same factor on both)
    clock = hw.clock
    assert (clock == 1.0) == (not d.sustained_tflops) and 0 < clock <= 1
    assert step.mm_flops == pytest.approx(peak * clock * d.mm_efficiency, rel=1e-12)
    assert step.attn_flops == pytest.approx(peak * clock * d.attn_efficiency, rel=1e-12)
    assert dev.mm_flops == pytest.approx(peak * clock * d.kernel_mm_efficiency, rel=1e-12)
    assert dev.mm_flops * d.framework_mm == pytest.approx(step.mm_flops, rel=1e-12)
    assert dev.attn_flops * d.framework_attn == pytest.approx(step.attn_flops, rel=1e-12)
    # both price memory-bound kernels alike (the copies, norms and optimizer steps)
    # exact: the same streaming-kernel formula
    assert dev.memory_bound(1e9) == step.memory_bound(1e9) == hw.copy_time(1e9)


@pytest.mark.parametrize("name", FITTED)
def test_the_kernels_run_faster_than_a_training_step_reaches_where_the_fit_absorbed_its_overheads(name):
    d, hw = DEVICE_PRESETS[name], hardware(name)
    assert 0.5 < d.framework_mm < 1.0 and 0.5 < d.framework_attn < 1.0
    for m, n, k in ((8192, 8192, 8192), (4096, 14336, 4096), (16384, 4096, 4096)):
        assert hw.device_kernels.gemm(m, n, k) < hw.kernels.gemm(m, n, k)
    flops = 2.0 * 8192**2 * 32 * 128
    assert hw.device_kernels.attention(flops, 8192.0) < hw.kernels.attention(flops, 8192.0)
    # H100's fit absorbs more than A100's: the end-to-end refit went to 0.624 where its kernels reach 0.82
    assert DEVICE_PRESETS["H100-80GB"].framework_mm < DEVICE_PRESETS["A100-80GB"].framework_mm


def test_a_device_without_a_kernel_fit_has_no_framework_term():
    base = DEVICE_PRESETS["A100-80GB"]
    fields = {f: getattr(base, f) for f in ("name", "peak_tflops", "memory_gib", "hbm_gbps", "nvlink_gbps",
                                            "node_net_gbps", "intra_latency_us", "inter_latency_us", "mm_efficiency",
                                            "attn_efficiency", "intra_efficiency", "inter_efficiency",
                                            "a2a_intra_efficiency", "a2a_inter_efficiency", "framework_reserve_gib",
                                            "allocator_headroom", "sms")}
    own = DeviceSpec(**fields)
    hw = Hardware(ClusterSpec(1, 8, own))
    assert own.framework_mm == own.framework_attn == 1.0
    assert hw.device_kernels == hw.kernels and hw.kernels.gemm_measured is None  # the tile model at its own rates


def test_the_measured_gemm_form_pays_compute_and_memory_softly_and_its_envelope_stays_below():
    g = MeasuredGemm(fixed_s=2e-6, hbm_bytes_per_s=2e12, power=2.4, per_k_s=0.25e-9)
    k = Kernels(mm_flops=800e12, attn_flops=500e12, hbm_bytes_per_s=3e12, sms=132, gemm_measured=g)
    m = np.array([1, 64, 1024, 8192, 0])
    n, kk = np.full(5, 4096), np.full(5, 4096)
    t = k.gemm(m, n, kk)
    compute = 2.0 * m * n * kk / 800e12
    memory = (m * kk + kk * n + m * n) * 2 / 2e12
    hard = np.maximum(compute, memory) + 2e-6 + 0.25e-9 * kk
    assert (t[:4] >= hard[:4]).all() and (t[:4] <= hard[:4] + np.minimum(compute, memory)[:4]).all()
    assert t[4] == 0.0 and k.gemm(0, 4096, 4096) == 0.0  # no tokens, no kernel
    assert float(k.gemm(64, 4096, 4096)) == pytest.approx(float(t[1]))  # scalars as arrays
    # no tile or wave steps: one more row never costs a whole wave
    assert k.gemm(129, 4096, 4096) / k.gemm(128, 4096, 4096) < 1.01
    e = k.envelope()
    assert (e.gemm(m, n, kk) <= t).all() and float(e.gemm(64, 8, 8) * 2) == pytest.approx(float(e.gemm(128, 8, 8)))


def test_from_one_wave_up_the_measured_form_pays_its_share_of_the_last_waves_idle_sms():
    from flexmesh.cost.device.kernels import WAVE_TILE

    def gemm(tail, sms=132):  # compute-bound: no memory, fixed or K-loop cost
        g = MeasuredGemm(fixed_s=0.0, hbm_bytes_per_s=1e30, power=2.0, per_k_s=0.0, wave_tail=tail)
        return Kernels(mm_flops=800e12, attn_flops=1.0, hbm_bytes_per_s=1e30, sms=sms, gemm_measured=g).gemm

    m, n, k = 18 * WAVE_TILE[0], 11 * WAVE_TILE[1], 8192  # 198 tiles on 132 SMs: 1.5 waves, the last half idle
    plain = 2.0 * m * n * k / 800e12
    assert gemm(0.0)(m, n, k) == pytest.approx(plain, rel=1e-9)
    assert gemm(1.0)(m, n, k) == pytest.approx(plain * 2.0 / 1.5, rel=1e-9)  # whole waves
    assert gemm(0.4)(m, n, k) == pytest.approx(plain * (1.0 + 0.4 * 0.5 / 1.5), rel=1e-9)
    assert float(gemm(0.4)(np.array([m]), np.array([n]), np.array([k]))[0]) == pytest.approx(gemm(0.4)(m, n, k))
    # below one wave the libraries fill the SMs (split-K, smaller tiles): no term; nor whole waves, nor without SMs
    assert gemm(1.0)(WAVE_TILE[0], WAVE_TILE[1], k) == gemm(0.0)(WAVE_TILE[0], WAVE_TILE[1], k)
    assert gemm(1.0)(12 * WAVE_TILE[0], 11 * WAVE_TILE[1], k) == pytest.approx(gemm(0.0)(12 * 128, 11 * 256, k))
    assert gemm(1.0, sms=None)(m, n, k) == gemm(0.0)(m, n, k)
    assert gemm(-3.0)(m, n, k) == gemm(0.0)(m, n, k) and gemm(5.0)(m, n, k) == gemm(1.0)(m, n, k)  # clipped to 0-1


def test_the_cache_holds_the_tables_six_weights_and_their_one_input():
    from flexmesh.cost.device.kernels import TABLE_WEIGHTS

    def gemv(weights):  # memory-bound; a 96 MB cache four times as fast as DRAM
        g = MeasuredGemm(fixed_s=0.0, hbm_bytes_per_s=1e12, power=2.0, per_k_s=0.0, cache_bytes=96e6,
                         cache_speedup=4.0, cache_steepness=12.0, weights=weights)
        return Kernels(mm_flops=1e18, attn_flops=1.0, hbm_bytes_per_s=1e12, sms=None, gemm_measured=g).gemm

    n = k = 4096  # a 32 MB weight: the cache holds it alone, not six of it
    assert gemv(1)(1, n, k) < 0.3 * gemv(TABLE_WEIGHTS)(1, n, k)
    assert gemv(TABLE_WEIGHTS)(1, n, k) == pytest.approx((k + n * k + n) * 2 / 1e12, rel=0.05)
    m, n = 4096, 32  # a 32 MB input beside a tiny weight: cached, however many weights
    assert gemv(TABLE_WEIGHTS)(m, n, k) == pytest.approx(gemv(1)(m, n, k), rel=0.01)
    assert gemv(TABLE_WEIGHTS)(m, n, k) < 0.3 * (m * k + k * n + m * n) * 2 / 1e12
    dev = hardware("L40S").device_kernels.gemm_measured
    assert dev is not None and dev.weights == TABLE_WEIGHTS and dev.wave_tail == GEMM_KERNELS["l40s"]["wave_tail"]


def test_measured_attention_calls_pay_their_fixed_and_per_key_costs():
    hw = hardware("H100-80GB")
    dev, a = hw.device_kernels, ATTENTION_KERNELS["h100_sxm"]
    flops = 2.0 * 4096**2 * 32 * 128
    one, two = dev.attention(flops, 4096.0, calls=1), dev.attention(flops, 4096.0, calls=2)
    assert two - one == pytest.approx((a["fixed_us"] * 1e-6 + a["per_key_ns"] * 1e-9 * 4096), rel=1e-9)
    assert dev.attention(0.0, 4096.0) == 0.0
    # the envelope keeps attention linear in FLOPs over the block: no calls' costs
    assert dev.envelope().attention(flops, 4096.0, calls=7) < one


def test_decode_attention_is_memory_bound_with_a_fixed_cost_a_call_and_a_cost_a_sequence_head():
    hw = hardware("H100-80GB")
    dev, d = hw.device_kernels, DECODE_KERNELS["h100_sxm"]
    one, two = dev.decode_attention(1e9, 256), dev.decode_attention(2e9, 256)
    assert two - one == pytest.approx(1e9 / (d["hbm_fraction"] * 3350e9), rel=1e-9)  # bytes at the fitted rate
    assert dev.decode_attention(1e9, 512) - one == pytest.approx(256 * d["per_pair_ns"] * 1e-9, rel=1e-9)
    assert dev.decode_attention(1e9, 256, calls=2) - one == pytest.approx(d["fixed_us"] * 1e-6, rel=1e-9)
    assert dev.decode_attention(0.0, 0) == 0.0
    # a device without a fit reads the bytes at its HBM rate, a launch a call
    tiles = replace(hw.kernels, decode_measured=None)
    assert tiles.decode_attention(1e9, 256) == pytest.approx(1e9 / tiles.hbm_bytes_per_s + 3e-6)


def test_a_working_set_the_cache_holds_is_read_at_the_cache_rate_and_one_far_past_it_at_dram_rate():
    assert cached_memory(1e6, 1e12, 32e6, 2.0, 4.0) == pytest.approx(0.5e-6, rel=1e-5)
    assert cached_memory(1e10, 1e12, 32e6, 2.0, 4.0) == pytest.approx(1e-2, rel=1e-8)
    sizes = np.geomspace(1e5, 1e10, 50)
    t = cached_memory(sizes, 1e12, 32e6, 2.0, 4.0)
    assert (np.diff(t) > 0).all() and (t <= sizes / 1e12).all() and (t >= sizes / 2e12).all()
    # no cache term: none fitted, or a fitted cache no faster than DRAM
    for cache, speedup in ((0.0, 2.0), (-5e6, 2.0), (32e6, 1.0), (32e6, 0.9)):
        assert cached_memory(1e6, 1e12, cache, speedup, 4.0) == 1e6 / 1e12
    # a steepness below 1 counts as 1: the cached fraction falls at least as fast as cache / bytes
    # exact: a steepness below 1 is 1: the same operations
    assert cached_memory(1e9, 1e12, 32e6, 2.0, 0.2) == cached_memory(1e9, 1e12, 32e6, 2.0, 1.0)


def test_decode_reads_kv_the_l2_cache_holds_above_the_dram_rate_on_the_l40s():
    hw, d = hardware("L40S"), DECODE_KERNELS["l40s"]
    dev = hw.device_kernels.decode_measured
    assert dev is not None and dev.cache_bytes == d["cache_mb"] * 1e6 and d["cache_speedup"] > 1.0
    kv = hw.device_kernels.decode_attention
    small, large = 32e6, 1e9  # within the L2 cache (96 MB), far past it
    fixed = kv(1.0, 8) - 1.0 / dev.hbm_bytes_per_s
    assert kv(small, 8) - fixed < small / (864e9)  # faster than the GDDR6's datasheet rate
    assert kv(large, 8) - fixed == pytest.approx(large / dev.hbm_bytes_per_s, rel=1e-6)
    # the cache is the L40S's own L2: the L4, which takes the L40S's table, keeps no cache term
    l4 = hardware("L4").device_kernels
    assert l4.decode_measured is not None and l4.decode_measured.cache_speedup == 1.0
    assert l4.gemm_measured is not None and l4.gemm_measured.cache_speedup == 1.0


def test_training_prices_the_same_through_the_cost_model():
    from flexmesh.cost import CostModel
    from flexmesh.spec import parse_model

    cm = CostModel(parse_model("llama2-7b"), parse_cluster("8xH100"))
    mm = DEVICE_PRESETS["H100-80GB"].mm_efficiency
    # exact: the same product
    assert cm.timing.kernels.mm_flops == cm.hw.kernels.mm_flops == cm.hw.peak_flops * mm


def test_training_and_serving_call_the_same_device_functions(monkeypatch):
    """One code path: a training step and a serving iteration on the same hardware price their GEMMs, attention and
    collectives through the same device-layer functions and the same measured forms."""
    from flexmesh.cost import CostModel
    from flexmesh.cost.inference.analytic import AnalyticIteration
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.spec import parse_model

    calls: dict[str, list] = {"gemm": [], "attention": [], "collective": []}
    gemm, attention, collective = Kernels._gemm_measured, Kernels.attention, Hardware.collective_time

    def spy_gemm(self, g, *args):  # noqa: ANN001, ANN002, ANN202
        calls["gemm"].append((who, g))
        return gemm(self, g, *args)

    def spy_attention(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls["attention"].append((who, self.attn_measured))
        return attention(self, *args, **kwargs)

    def spy_collective(self, *args):  # noqa: ANN001, ANN002, ANN202
        calls["collective"].append((who, self))
        return collective(self, *args)

    monkeypatch.setattr(Kernels, "_gemm_measured", spy_gemm)
    monkeypatch.setattr(Kernels, "attention", spy_attention)
    monkeypatch.setattr(Hardware, "collective_time", spy_collective)
    # on Ampere the runtime's FlashAttention-2 is the tables' kernel (on Hopper it has its own measured form)
    model, cluster = parse_model("llama2-7b"), parse_cluster("8xA100-80GB")
    hw = Hardware(cluster)
    who = "training"
    cm = CostModel(model, cluster, hw)
    cm.timing.layer_times(LayerStrategy(tp=2, dp=4), 4096.0, 4096.0**2)
    cm.evaluate_stages([[LayerStrategy(tp=2, dp=4)] * 4], 1, "1f1b", 2, 1, 8, 4096)
    who = "serving"
    it = AnalyticIteration(model, hw, tp=2)
    it.iteration_s([(512, 0), (1, 300)])
    for kind in calls:
        by = {w for w, _ in calls[kind]}
        assert by == {"training", "serving"}, (kind, by)
    # the same measured objects: the device layer's own, not a copy per half
    assert {id(g) for _, g in calls["gemm"]} == {id(hw.device_kernels.gemm_measured)}
    assert {id(a) for _, a in calls["attention"]} == {id(hw.device_kernels.attn_measured)}
    assert {id(h) for _, h in calls["collective"]} == {id(hw)}


def test_a_fit_recovers_the_constants_a_synthetic_table_was_made_with(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    from flexmesh.cost.device.gemm_tables import fit_gemm, gemm_kernels
    from flexmesh.spec.devices import KernelTable

    truth = {"efficiency": 0.8, "fixed_us": 3.0, "hbm_fraction": 0.85, "power": 2.5, "per_k_ns": 0.2,
             "cache_mb": 32.0, "cache_speedup": 2.0, "cache_steepness": 4.0, "wave_tail": 0.5}
    table = KernelTable(tflops=700.0, peak_tflops=1000.0, architecture="hopper", hbm_gbps=3000.0, sms=132)
    # working sets on both sides of the cache's 32 MB; not all powers of two, so the last wave's idle share varies
    dims = [1, 16, 128, 256, 768, 1536, 3072, 5120, 8192]
    m, n, k = (np.array(x, dtype=float) for x in zip(*[(a, b, c) for a in dims for b in dims[2:] for c in dims[2:]]))
    ms = gemm_kernels(truth, 1000.0, 3000.0, 132).gemm(m, n, k) * 1e3
    folder = tmp_path / "data" / "x" / "gemm" / "vllm" / "0.1.0"
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"gemm_dtype": ["bfloat16"] * len(m), "m": m.astype(int), "n": n.astype(int),
                             "k": k.astype(int), "latency": ms}), folder / "gemm_perf.parquet")
    got = fit_gemm(tmp_path, "x", table)
    assert got.fitted_rows + got.held_rows == len(m) and got.fitted_rows == (len(m) + 1) // 2
    for name, v in truth.items():
        # the cache's steepness is the least determined: its rows are the few working sets near 32 MB
        assert got.values[name] == pytest.approx(v, rel=0.15 if name == "cache_steepness" else 0.05), name


def test_recorded_kernel_constants_match_the_installed_tables():
    """One system's fits redone (A100's, the smallest tables; ``--fit`` redoes every system's)."""
    pytest.importorskip("pyarrow")
    from flexmesh.cost.device import attention_tables, decode_tables, gemm_tables

    systems = gemm_tables.systems_dir()
    if systems is None:
        pytest.skip("aiconfigurator-core is not installed (pip install 'flexmesh[tables]')")
    for fit, tables, recorded in ((gemm_tables.fit_gemm, GEMM_TABLES, GEMM_KERNELS),
                                  (attention_tables.fit_attention, ATTENTION_TABLES, ATTENTION_KERNELS),
                                  (decode_tables.fit_decode, GEMM_TABLES, DECODE_KERNELS)):
        got = fit(systems, "a100_sxm", tables["a100_sxm"])
        assert got.values == pytest.approx(recorded["a100_sxm"], rel=0.01)


def test_deepbench_fits_redo_and_price_the_held_out_rows_better_than_a_borrowed_table():
    """The V100's and T4's GEMM fits redone from DeepBench's table (no aiconfigurator-core needed), and on the rows
    they were not fitted to, nearer DeepBench's timings than the A100's fit scaled to the part's datasheet."""
    for system, (gpu, name) in gemm_tables.DEEPBENCH.items():
        got = gemm_tables.fit_deepbench(gemm_tables.DEEPBENCH_CSV, system)
        assert got.values == pytest.approx(GEMM_KERNELS[system], rel=0.01, abs=1e-6)
        part = replace(DEVICE_PRESETS[name], sustained_tflops={})  # DeepBench's short runs
        assert part.gemm_table == system
        borrowed = replace(part, gemm_table="", kernel_mm_efficiency=GEMM_KERNELS[part.kernel_table]["efficiency"])
        m, n, k, t = gemm_tables.deepbench_rows(gemm_tables.DEEPBENCH_CSV, gpu).T
        held = ~gemm_tables.fitted_half(len(t))
        own, other = (float(np.median(np.abs(Hardware(ClusterSpec(1, 1, d), "fp16").device_kernels.gemm(
            m[held], n[held], k[held]) / t[held] - 1))) for d in (part, borrowed))
        assert own <= 0.10 < other
