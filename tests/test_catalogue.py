"""The device catalogue (presets/devices.toml): every GPU people mix, its precisions, its node's links,
its kernel efficiency and where each comes from; plans in the precision a device can train in."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from flexmesh.cli import main
from flexmesh.cost import CostModel, Work
from flexmesh.cost.device.hardware import GroupShape, Hardware
from flexmesh.errors import SpecError
from flexmesh.layout import LayerStrategy as S
from flexmesh.spec import parse_cluster, parse_model
from flexmesh.spec.cluster import (
    ATTENTION_TABLES,
    DEVICE_PRESETS,
    GEMM_TABLES,
    INTRA_LINKS,
    ClusterSpec,
    device,
    preset_of_gpu,
)
from flexmesh.spec.devices import COMM_TABLES, GEMM_KERNELS

# The plans these tests check, not the policy `plan` recommends for them (its simulated steps: tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_recommendation")

ISSUE_DEVICES = ("V100-16GB", "V100-32GB", "T4", "A10", "A10G", "L4", "L40S", "A30", "RTX-2080Ti", "TITAN-RTX",
                 "RTX-3090", "RTX-4090", "A100-PCIe-40GB", "A100-PCIe-80GB", "A100-40GB", "A100-80GB", "H100-PCIe",
                 "H100-80GB", "H200", "B200", "GH200")


def test_every_device_people_mix_has_a_cited_entry():
    assert set(ISSUE_DEVICES) <= set(DEVICE_PRESETS)
    for name, d in DEVICE_PRESETS.items():
        assert len(d.source) > 40 and ("datasheet" in d.source or "whitepaper" in d.source or "AWS" in d.source), name
        assert d.architecture in ("volta", "turing", "ampere", "ada", "hopper", "blackwell"), name
        assert d.sms and d.intra_link in INTRA_LINKS and d.efficiency_source, name
        assert d.peak_tflops["fp16"] > d.peak_tflops["fp32"] > 0, name
        # what joins a node: NVSwitch and the DGX-1 mesh join all 8, bridges pairs, PCIe none
        assert d.nvlink_domain == {"nvlink-bridge": 2, "pcie": 1}.get(d.intra_link, d.nvlink_domain), name
        assert d.nvlink_domain >= 4 or d.pcie_gbps > 0, name


def test_precisions_follow_the_architecture():
    for name, d in DEVICE_PRESETS.items():
        old = d.architecture in ("volta", "turing")
        assert ("bf16" in d.peak_tflops) != old and ("tf32" in d.peak_tflops) != old, name
    # GeForce parts run fp16/bf16 with fp32 accumulation at half their fp16-accumulate rate
    assert device("RTX-4090").peak_tflops["bf16"] == pytest.approx(165.2)
    assert device("RTX-3090").peak_tflops["bf16"] == pytest.approx(71.0)


def test_kernel_efficiencies_are_fits_scaled_by_measured_tables():
    h100, a100 = device("H100-80GB"), device("A100-80GB")
    for name, table, fitted in (("H200", "h200_sxm", h100), ("B200", "b200_sxm", h100), ("L40S", "l40s", a100),
                                ("L4", "l40s", a100)):
        own = "h100_sxm" if fitted is h100 else "a100_sxm"
        ratio = GEMM_TABLES[table].efficiency / GEMM_TABLES[own].efficiency
        assert device(name).mm_efficiency == pytest.approx(fitted.mm_efficiency * ratio)
        assert table in device(name).efficiency_source
    assert device("B200").mm_efficiency < h100.mm_efficiency  # its GEMMs reach a smaller fraction of its peak
    # attention: one fit (FlexSP's A100) scaled by every part's measured attention table
    for name, table in (("H100-80GB", "h100_sxm"), ("H200", "h200_sxm"), ("B200", "b200_sxm"), ("L4", "l40s")):
        ratio = ATTENTION_TABLES[table].efficiency / ATTENTION_TABLES["a100_sxm"].efficiency
        assert device(name).attn_efficiency == pytest.approx(a100.attn_efficiency * ratio)
        assert f"measured attention of {table}" in device(name).efficiency_source
    # FlashAttention-3 on Hopper reaches more of its peak than FlashAttention-2 on Ampere and Ada
    assert device("H100-80GB").attn_efficiency > a100.attn_efficiency > device("L40S").attn_efficiency
    assert device("V100-32GB").attn_efficiency == a100.attn_efficiency  # no Volta table: assumed
    # the fitted parts keep their fit; parts of an architecture nobody measured say it is assumed
    assert device("A100-40GB").mm_efficiency == a100.mm_efficiency
    assert "assumed" in device("RTX-2080Ti").efficiency_source and "assumed" not in a100.efficiency_source
    # a part with a GEMM table of its own (DeepBench's): the A100's framework term over its own kernels' rate
    for name, gemm in (("V100-32GB", "v100_deepbench"), ("T4", "t4_deepbench")):
        d = device(name)
        ratio = GEMM_KERNELS[gemm]["efficiency"] / GEMM_KERNELS["a100_sxm"]["efficiency"]
        assert d.mm_efficiency == pytest.approx(a100.mm_efficiency * ratio) and gemm in d.efficiency_source
        assert d.framework_mm == pytest.approx(a100.framework_mm)


def test_bridged_pairs_run_over_nvlink_and_larger_groups_over_pcie():
    gib = float(2**30)
    bridged = Hardware(parse_cluster("8xA100-PCIe-80GB"))
    # the SXM part priced by the same model (its measured table set aside): only the links differ
    switched = Hardware(ClusterSpec(1, 8, replace(device("A100-80GB"), comm_table="")))
    pair, four = GroupShape(2, 2), GroupShape(4, 4)
    # a pair on its bridge is as fast as on NVSwitch (same NVLink 3 bandwidth)
    assert bridged.collective_time("all_reduce", gib, pair) == pytest.approx(
        switched.collective_time("all_reduce", gib, pair))
    # four GPUs leave the bridge: PCIe Gen4, ~10x slower than NVLink 3 at 300 GB/s
    slow = bridged.collective_time("all_reduce", gib, four) / switched.collective_time("all_reduce", gib, four)
    assert slow == pytest.approx(300.0 / 32.0, rel=0.01)
    pcie = Hardware(parse_cluster("8xL40S"))
    # a large message: NCCL's Simple protocol, its base latency and one PCIe hop (NVIDIA/nccl's tuning model)
    assert pcie.collective_time("all_gather", gib, pair) == pytest.approx(
        gib / 2 / (32e9 * pcie.comm.ring_intra_eff) + (8.4 + 5.7) * 1e-6)


def test_small_collectives_without_a_table_cost_nccls_latency_per_ring_step():
    """A part without a measured table prices a small message's ring as NCCL's tuner does: its LL protocol's base
    latency plus one hop per ring step, a PCIe hop dearer than an NVLink one; large messages take the Simple protocol
    at the full bandwidth."""
    pcie = Hardware(parse_cluster("8xL40S"))
    bridged = Hardware(parse_cluster("8xA100-PCIe-80GB"))
    tiny = 64.0  # bytes: latency alone
    for k in (2, 4, 8):  # 2 (k - 1) steps of an all-reduce over PCIe, 1.0 us each, after LL's 6.6 us
        assert pcie.collective_time("all_reduce", tiny, GroupShape(k, k)) == pytest.approx(
            (6.6 + 2 * (k - 1) * 1.0) * 1e-6, rel=0.01)
    # the bridged pair runs its ring over NVLink (0.6 us a hop), four of those GPUs over PCIe
    assert bridged.collective_time("all_reduce", tiny, GroupShape(2, 2)) == pytest.approx((6.6 + 2 * 0.6) * 1e-6,
                                                                                          rel=0.01)
    assert bridged.collective_time("all_reduce", tiny, GroupShape(4, 4)) == pytest.approx((6.6 + 6 * 1.0) * 1e-6,
                                                                                          rel=0.01)
    # time grows with the message and never falls; LL's quarter bandwidth gives way to Simple's at large sizes
    sizes = np.geomspace(64, 2**30, 40)
    times = pcie.collective_time("all_reduce", sizes, GroupShape(4, 4))
    assert np.all(np.diff(times) > 0)
    bw = pcie.comm.intra_bytes_per_s(4) * pcie.comm.ring_intra_eff
    assert times[-1] == pytest.approx(1.5 * 2**30 / bw + (8.4 + 6 * 5.7) * 1e-6, rel=1e-6)


def test_tensor_parallel_plans_prefer_the_bridge():
    """Over PCIe-only or bridged nodes the planner keeps tensor parallelism within what NVLink joins."""
    model = parse_model("llama2-7b")
    cm = CostModel(model, parse_cluster("8xA100-PCIe-80GB"))
    w = Work(4096, 4096.0**2)
    t2, t4 = (cm.layer(S(tp=t, dp=8 // t), w) for t in (2, 4))
    assert t4.comm_fwd / t2.comm_fwd > 5  # beyond the pair, every TP collective runs over PCIe


def test_training_precision_sets_peak_and_states():
    w = Work(8192, 8192.0**2)
    a100 = parse_cluster("8xA100-80GB")
    bf16 = CostModel(parse_model("llama2-7b"), a100).layer(S(), w)
    fp32 = CostModel(parse_model("llama2-7b@fp32"), a100).layer(S(), w)
    assert fp32.fwd / bf16.fwd > 8  # CUDA-core fp32 (19.5 TFLOP/s) against bf16 Tensor Cores (312)
    assert fp32.states / bf16.states == pytest.approx(16 / 18)


def test_devices_without_bf16_plan_in_fp16_and_say_how(capsys, tmp_path):
    assert main(["plan", "--model", "gpt:8:1024:16", "--cluster", "8xV100-32GB", "--seq-len", "1024",
                 "--global-batch", "32", "--top", "1"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "V100-32GB cannot train in bf16 (volta has no bf16 Tensor Cores)" in err and "@fp16" in err
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt:8:1024:16@fp16", "--cluster", "8xV100-32GB", "--seq-len", "1024",
                 "--global-batch", "32", "--top", "1", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["predicted"]["step_time_s"] > 0
    # the plan records the precision it was planned in: --check and simulate read it back without --model
    assert written["model"] == "gpt:8:1024:16@fp16"
    capsys.readouterr()
    assert main(["plan", "--check", str(out)]) == 0 and "valid" in capsys.readouterr().out
    assert main(["plan", "--model", "gpt:8:1024:16@fp16", "--cluster", "2x4xT4", "--seq-len", "512",
                 "--global-batch", "16", "--top", "1"]) == 0


def test_gpt_models_take_precision_and_head_tying_from_the_command_line():
    tied, untied = parse_model("gpt:24:2048:16:50257"), parse_model("gpt:24:2048:16:50257:untied")
    assert tied.tie_embeddings and not untied.tie_embeddings
    assert untied.total_params - tied.total_params == 50257 * 2048
    assert parse_model("gpt:24:2048:16@fp32").dtype == "fp32" and parse_model("tiny@fp16").dtype == "fp16"
    with pytest.raises(SpecError, match="@bf16, @fp16 or @fp32"):
        parse_model("tiny@fp8")


@pytest.mark.parametrize("driver, preset", [
    ("Tesla V100-SXM2-16GB", "V100-16GB"), ("NVIDIA A10G", "A10G"), ("NVIDIA A10", "A10"), ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA H100 PCIe", "H100-PCIe"), ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA GeForce RTX 3090", "RTX-3090"), ("NVIDIA A100-PCIE-40GB", "A100-PCIe-40GB"),
])
def test_driver_names_find_their_preset(driver, preset):
    assert preset_of_gpu(driver) == preset


def test_gemm_table_medians_over_common_shapes(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    from flexmesh.cost.device.gemm_tables import medians

    def table(system, rows):
        folder = tmp_path / "data" / system / "gemm" / "vllm" / "0.1.0"
        folder.mkdir(parents=True)
        cols = list(zip(*rows))
        pq.write_table(pa.table({"gemm_dtype": list(cols[0]), "m": list(cols[1]), "n": list(cols[2]),
                                 "k": list(cols[3]), "latency": list(cols[4])}), folder / "gemm_perf.parquet")

    big = 8192
    flops_ms = 2 * big**3 / 1e12 / 1e-3  # ms at 1 TFLOP/s
    table("a", [("bfloat16", big, big, big, flops_ms / 100), ("bfloat16", 4096, big, big, 1.0),
                ("fp8", big, big, big, 1e-9), ("bfloat16", 64, big, big, 1e-9)])
    table("b", [("bfloat16", big, big, big, flops_ms / 300)])
    got = {t.system: t for t in medians(tmp_path, ["a", "b"])}
    # only the shape both measured counts; fp8 rows and small GEMMs never do
    assert got["a"].shapes == 1 and got["a"].tflops == pytest.approx(100.0)
    assert got["b"].tflops == pytest.approx(300.0)


def test_recorded_medians_match_the_installed_tables():
    pytest.importorskip("pyarrow")
    from flexmesh.cost.device.gemm_tables import main as redo
    from flexmesh.cost.device.gemm_tables import systems_dir

    if systems_dir() is None:
        pytest.skip("aiconfigurator-core is not installed (pip install 'flexmesh[tables]')")
    assert redo([]) == 0


def test_attention_table_medians_keep_long_bf16_prefill_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    from flexmesh.cost.device.attention_tables import medians

    cols = ("kernel_source", "batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim", "attn_dtype",
            "kv_cache_dtype", "window_size", "latency")

    def table(system, rows):
        folder = tmp_path / "data" / system / "attention" / "vllm" / "0.1.0"
        folder.mkdir(parents=True)
        pq.write_table(pa.table(dict(zip(cols, map(list, zip(*rows))))), folder / "context_attention_perf.parquet")

    s = 8192
    ms_at_1 = 2 * s * s * 32 * 128 / 1e12 / 1e-3  # one causal pass of 32 heads at 1 TFLOP/s, ms
    keep = ("fa", 1, s, 32, 8, 128, "bfloat16", "bfloat16", 0)
    table("a", [(*keep, ms_at_1 / 200),
                # left out: a decode kernel, fp8 keys and values, a sliding window, short and other-dim rows
                ("fa_decode", 1, s, 32, 8, 128, "bfloat16", "bfloat16", 0, 1e-9),
                ("fa", 1, s, 32, 8, 128, "bfloat16", "fp8", 0, 1e-9),
                ("fa", 1, s, 32, 8, 128, "bfloat16", "bfloat16", 128, 1e-9),
                ("fa", 1, 1024, 32, 8, 128, "bfloat16", "bfloat16", 0, 1e-9),
                ("fa", 1, s, 32, 8, 64, "bfloat16", "bfloat16", 0, 1e-9),
                ("fa", 2, s, 32, 8, 128, "bfloat16", "bfloat16", 0, 1.0)])  # not in b's table
    table("b", [("fa3", *keep[1:], ms_at_1 / 500)])
    got = {t.system: t for t in medians(tmp_path, ["a", "b"])}
    assert got["a"].shapes == 1 and got["a"].tflops == pytest.approx(200.0) and got["a"].table.endswith(" fa")
    assert got["b"].tflops == pytest.approx(500.0) and got["b"].table.endswith(" fa3")
    table("c", [(*keep, 1.0), ("other", *keep[1:], 1.0)])  # two prefill kernels: which one a part runs is unclear
    with pytest.raises(ValueError, match="expected one bf16 prefill kernel"):
        medians(tmp_path, ["a", "c"])


def test_recorded_attention_medians_match_the_installed_tables():
    pytest.importorskip("pyarrow")
    from flexmesh.cost.device.attention_tables import main as redo
    from flexmesh.cost.device.gemm_tables import systems_dir

    if systems_dir() is None:
        pytest.skip("aiconfigurator-core is not installed (pip install 'flexmesh[tables]')")
    assert redo([]) == 0


def test_nccl_tables_are_read_as_bytes_and_median_seconds(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    import tomllib

    from flexmesh.cost.device.comm_tables import curves, newest_table, to_toml

    rows = [("all_reduce", 8, "half", 1024, 0.010), ("all_reduce", 8, "half", 1024, 0.030),
            ("all_reduce", 8, "half", 1024, 0.020), ("all_reduce", 8, "half", 4096, 0.040),
            ("all_reduce", 8, "int8", 1024, 0.001), ("alltoall", 8, "half", 1024, 0.001)]
    for version in ("2.9.1", "2.27.3"):  # the newest version's table is the one read
        folder = tmp_path / "data" / "x_sxm" / "comm" / "nccl" / version
        folder.mkdir(parents=True)
        cols = list(zip(*rows))
        pq.write_table(pa.table({"op_name": list(cols[0]), "num_gpus": list(cols[1]), "nccl_dtype": list(cols[2]),
                                 "message_size": list(cols[3]), "latency": list(cols[4])}),
                       folder / "nccl_perf.parquet")
    path = newest_table(tmp_path, "x_sxm")
    assert path.parent.name == "2.27.3"
    got = curves(path)
    # fp16 only (2 bytes an element), all-to-all left to its fitted efficiency, the median of repeats (ms -> s)
    assert got == {"all_reduce": {8: ([2048, 8192], [pytest.approx(20e-6), pytest.approx(40e-6)])}}
    # an engine's own all-reduce: its graphed and eager rows apart, another framework's kernel left out, each curve
    # made non-decreasing by the least-squares fit in log time (a slow single timing pooled with the next)
    from flexmesh.cost.device.comm_tables import engine_tables

    engine = [("vllm_graph", 2, 128, 0.004), ("vllm_graph", 2, 256, 0.016), ("vllm_graph", 2, 512, 0.004),
              ("vllm_eager", 2, 128, 0.020), ("vllm_eager", 2, 256, 0.021), ("TRTLLM", 2, 128, 0.001)]
    folder = tmp_path / "data" / "x_sxm" / "comm" / "vllm" / "0.24.0"
    folder.mkdir(parents=True)
    cols = list(zip(*engine))
    pq.write_table(pa.table({"kernel_source": list(cols[0]), "allreduce_dtype": ["bfloat16"] * len(engine),
                             "num_gpus": list(cols[1]), "message_size": list(cols[2]), "latency": list(cols[3])}),
                   folder / "custom_allreduce_perf.parquet")
    tables = engine_tables(tmp_path, "x_sxm")
    assert set(tables) == {"vllm"} and tables["vllm"][0].endswith("vllm/0.24.0/custom_allreduce_perf.parquet")
    vllm = tables["vllm"][1]
    assert set(vllm) == {"vllm_graph", "vllm_eager"} and vllm["vllm_graph"][2][0] == [256, 512, 1024]
    # 4, 16, 4 us: the slow middle timing pooled with the next, at their geometric mean
    assert vllm["vllm_graph"][2][1] == pytest.approx([4e-6, 8e-6, 8e-6], rel=1e-9)
    back = tomllib.loads(to_toml({"x_sxm": ("t", got)}, {"x_sxm": tables}))
    assert back["x_sxm"]["all_reduce"]["8"] == {"bytes": [2048, 8192], "us": [20.0, 40.0]}
    assert back["x_sxm"]["vllm_table"] == tables["vllm"][0] and back["x_sxm"]["vllm_eager"]["2"]["us"] == [20.0, 21.0]


def test_recorded_nccl_tables_match_the_installed_ones():
    pytest.importorskip("pyarrow")
    from flexmesh.cost.device.comm_tables import main as redo
    from flexmesh.cost.device.gemm_tables import systems_dir

    if systems_dir() is None:
        pytest.skip("aiconfigurator-core is not installed (pip install 'flexmesh[tables]')")
    assert redo([]) == 0


def test_the_uniform_baseline_runs_on_the_clusters_own_network(tmp_path):
    """A mixed cluster joined by 10 Gb/s Ethernet: the one-layout baseline over all of it is priced on
    that link, not on the slowest device's datacenter NICs."""
    from flexmesh.search.baselines import uniform_cluster
    from flexmesh.spec.cluster import parse_mixed_cluster

    f = tmp_path / "cluster.toml"
    f.write_text('[[groups]]\nnodes = 1\ndevices_per_node = 4\ndevice = "RTX-3090"\n\n'
                 '[[groups]]\nnodes = 2\ndevices_per_node = 4\ndevice = "A100-PCIe-40GB"\n\n'
                 '[links.0-1]\ngbps = 1.25\nlatency_us = 50.0\n')
    u = uniform_cluster(parse_mixed_cluster(str(f)))
    assert u.device.name == "RTX-3090" and u.world_size == 12
    assert u.device.node_net_gbps == 1.25 and u.device.inter_latency_us == 50.0


def test_explain_says_where_the_devices_numbers_come_from(capsys):
    assert main(["plan", "--model", "tiny", "--cluster", "8xL40S", "--seq-len", "1024", "--global-batch", "16",
                 "--top", "1", "--explain", "--attention", "unfused"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "device L40S (ada, pcie), bf16 peak 362.05 TFLOP/s; GEMM efficiency 0.549, attention 0.443" in out
    assert "measured GEMMs of l40s / a100_sxm" in out and "NVIDIA L40S datasheet" in out
    assert "measured attention of l40s / a100_sxm" in out
    assert "layers priced as another stack runs them: unfused attention" in out
    assert ("collectives inside a node: 32 GB/s x 0.69 + NCCL's tuning model's latency per ring step (no measured "
            "table") in out
    assert main(["plan", "--model", "tiny", "--cluster", "8xH100", "--seq-len", "1024", "--global-batch", "16",
                 "--top", "1", "--explain"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "collectives inside a node: measured NCCL times of a h100_sxm node by message size" in out
    assert "framework: no fixed cost per micro-batch or pipeline stage beyond each kernel's 3 us launch" in out


def test_measured_parts_take_ring_collectives_inside_a_node_from_their_nccl_tables():
    h100 = Hardware(parse_cluster("8xH100"))
    for n in (2, 4, 8):
        sizes, seconds = COMM_TABLES["h100_sxm"]["all_reduce"][n]
        for b, t in list(zip(sizes, seconds))[::5]:
            assert h100.collective_time("all_reduce", float(b), GroupShape(n, n)) == pytest.approx(t)
    # between sizes: monotone; mid-size messages reach a smaller bus bandwidth than large ones
    grid = np.geomspace(1e3, 2e9, 40)
    times = h100.collective_time("all_gather", grid, GroupShape(8, 8))
    assert np.all(np.diff(times) >= 0)
    bus = {b: 7 / 8 * b / h100.collective_time("all_gather", b, GroupShape(8, 8)) for b in (2.0**24, 2.0**29)}
    assert bus[2.0**24] < 0.8 * bus[2.0**29]
    # all-reduce over NVLink SHARP beats twice an all-gather at large sizes, as measured
    assert h100.collective_time("all_reduce", 2.0**29, GroupShape(8, 8)) < \
        2 * h100.collective_time("all_gather", 2.0**29, GroupShape(8, 8))
    # a group size not measured: the nearest measured one, scaled by the ring's volume
    six = h100.collective_time("all_gather", 2.0**26, GroupShape(6, 6))
    assert six == pytest.approx(h100.collective_time("all_gather", 2.0**26, GroupShape(8, 8)) * (5 / 6) / (7 / 8))
    # across nodes the NICs bound it as before; all-to-all keeps its fitted efficiency
    two_nodes = h100.collective_time("all_gather", 2.0**30, GroupShape(16, 8))
    assert two_nodes > h100.collective_time("all_gather", 2.0**30, GroupShape(8, 8))
    untabled = Hardware(ClusterSpec(1, 8, replace(device("H100-80GB"), comm_table="")))
    # exact: no table for all-to-all: the same formula both ways
    assert h100.collective_time("all_to_all", 2.0**26, GroupShape(8, 8)) == \
        untabled.collective_time("all_to_all", 2.0**26, GroupShape(8, 8))
    assert h100.collective_time("all_gather", 2.0**26, GroupShape(8, 8)) != \
        untabled.collective_time("all_gather", 2.0**26, GroupShape(8, 8))


def test_a_cluster_file_that_changes_a_nodes_links_sets_the_measured_table_aside(tmp_path):
    keep = tmp_path / "keep.toml"
    keep.write_text('nodes = 1\ndevices_per_node = 8\ndevice = { base = "H100-80GB", node_net_gbps = 50.0 }\n')
    slow = tmp_path / "slow.toml"
    slow.write_text('nodes = 1\ndevices_per_node = 8\ndevice = { base = "H100-80GB", nvlink_gbps = 64.0 }\n')
    assert parse_cluster(str(keep)).device.comm_table == "h100_sxm"
    assert parse_cluster(str(slow)).device.comm_table == ""
    gib = float(2**30)
    assert Hardware(parse_cluster(str(slow))).collective_time("all_reduce", gib, GroupShape(8, 8)) > \
        5 * Hardware(parse_cluster(str(keep))).collective_time("all_reduce", gib, GroupShape(8, 8))
    bad = tmp_path / "bad.toml"
    bad.write_text('nodes = 1\ndevices_per_node = 8\ndevice = { base = "H100-80GB", comm_table = "h900" }\n')
    with pytest.raises(SpecError, match="comm_table must be one of"):
        parse_cluster(str(bad))
