"""Published mixed-GPU runs (flexmesh.cost.training.mixed_runs): each one's plan is expressible and priced as its
system ran it, stage by stage on its devices; AMP's partitions with a stage of no layer included."""

from __future__ import annotations

import math

import pytest

from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.training.mixed import MixedCosts, evaluate_groups
from flexmesh.cost.training.mixed_runs import MEGATRON_V1, published_runs, relay_runs, replay, run_plan
from flexmesh.cost.training.parts import Parts
from flexmesh.search.check import check_groups
from flexmesh.spec import parse_cluster


def test_every_run_is_a_plan_of_its_batch_and_layers_on_its_devices():
    runs = published_runs()
    assert {r.system for r in runs} == {"AMP", "Sailor"} and len(runs) == 43 + 47 + 8
    for run in runs + relay_runs():
        plan, cluster = run_plan(run)
        assert plan.global_batch == run.global_batch == sum(g.share for g in plan.groups)
        assert all(g.num_microbatches == run.microbatches and g.microbatch_size == run.micro_batch
                   for g in plan.groups)
        assert run.stages[0][0] == 0 and run.stages[-1][1] == run.model.num_layers
        for d, g in enumerate(plan.groups):  # replica d's stage p on the devices the system names
            assert [cluster.device_of(b[0]).name for b in g.blocks] == [run.devices[p][d] for p in range(run.pp)]
        assert math.isfinite(run.seconds) != (run in relay_runs())


def test_amp_runs_its_last_stages_on_the_t4_node_in_deepspeeds_rank_order():
    a1 = next(r for r in published_runs() if r.name == "A1")  # pp 4, dp 4: ranks 12-15, the T4 node, hold stage 3
    assert a1.devices == (("V100-16GB",) * 4,) * 3 + (("T4",) * 4,)
    assert a1.stages == ((0, 5), (5, 12), (12, 18), (18, 24))  # DeepSpeed's specs 0-7 | 7-14 | ...: embedding + 5
    plan, _ = run_plan(a1)
    assert [g.blocks[3] for g in plan.groups] == [(12,), (13,), (14,), (15,)]


def test_amps_relay_partitions_price_a_stage_that_only_passes_activations_on():
    """AMP's partitions of the embedding alone, then a transpose alone (no transformer layer), failed to run; flexmesh
    expresses them and prices the relay's sends and nothing else."""
    for run in relay_runs():
        assert run.stages[:3] == ((0, 0), (0, 0), (0, 1))
        plan, cluster = run_plan(run)
        assert check_groups(plan, run.model, cluster, MixedCosts(run.model, cluster, parts=Parts(stack=MEGATRON_V1)))
        ev = evaluate_groups(plan, MixedCosts(run.model, cluster, parts=Parts(stack=MEGATRON_V1)))
        embedding, relay, layer = ev.replicas[0].stages[:3]
        assert relay.memory["states"] == 0 and 0 < relay.time < layer.time
        assert "[0,0) relay" in plan.layout


def test_a_slower_device_in_the_last_stage_slows_the_step():
    from dataclasses import replace

    a1 = next(r for r in published_runs() if r.name == "A1")
    all_v100 = replace(a1, devices=(("V100-16GB",) * 4,) * 4, name="A1 on V100")
    assert replay(a1) > replay(all_v100) > 0


def test_the_t4_runs_its_tensor_cores_at_the_clock_its_power_cap_sustains():
    """NVIDIA's forum measurement (devices.toml): about 24 TFLOP/s on a 4096^3 fp16 GEMM, not the datasheet's 65."""
    hw = Hardware(parse_cluster("4xT4"), "fp16")
    assert 2 * 4096 ** 3 / hw.device_kernels.gemm(4096, 4096, 4096) / 1e12 == pytest.approx(24.0, rel=0.02)
    assert 0.3 < hw.clock < 0.7  # DeepBench's T4 table reaches 62% of peak in short runs: 24 TFLOP/s is 0.6 of that
    v100 = Hardware(parse_cluster("4xV100-16GB"), "fp16")
    assert v100.clock == 1.0 and v100.device_kernels.gemm(4096, 4096, 4096) < hw.device_kernels.gemm(4096, 4096, 4096)


def test_the_l4_runs_its_tensor_cores_at_the_rate_measured_on_one():
    """torch.mm 4096^3 on an L4 (devices.toml's source): 54.9 TFLOP/s bf16 and 53.0 fp16, not the 77 the L40S's
    table scaled to the L4's datasheet gives; the L40S itself keeps its table's rate."""
    for dtype, rate in (("bf16", 54.9), ("fp16", 53.0)):
        hw = Hardware(parse_cluster("4xL4"), dtype)
        assert 2 * 4096 ** 3 / hw.device_kernels.gemm(4096, 4096, 4096) / 1e12 == pytest.approx(rate, rel=0.02)
        assert hw.clock < 0.8
    assert Hardware(parse_cluster("4xL40S")).clock == 1.0


def test_collectives_over_pcie_alone_run_at_the_measured_share_of_the_link(tmp_path):
    """A GeForce node (no peer-to-peer over PCIe) all-reduces at its measured share of PCIe (devices.toml); a
    datacenter PCIe part keeps NVLink's share; a cluster file may give its own node's."""
    from flexmesh.cost.device.hardware import GroupShape
    from flexmesh.spec.cluster import parse_mixed_cluster

    nbytes, shape = 1e9, GroupShape(4, 4)
    for name, share in (("RTX-4090", 0.56), ("RTX-2080Ti", 0.25)):
        hw = Hardware(parse_cluster(f"4x{name}"), "fp16")
        d = hw.cluster.device
        assert d.pcie_efficiency == share
        ring = 2 * 3 / 4 * nbytes / (d.pcie_gbps * 1e9 * share)  # hierarchical ring inside one node, no latency
        assert hw.collective_time("all_reduce", nbytes, shape) == pytest.approx(ring, rel=0.01)
    a100 = parse_cluster("4xA100-PCIe-80GB").device
    assert a100.pcie_efficiency == 0.0  # Vidur's measured A100 PCIe pairs (bench/tp_scaling.py) run at NVLink's share
    node = tmp_path / "node.toml"
    node.write_text('nodes = 1\ndevices_per_node = 4\ndevice = { base = "RTX-4090", pcie_efficiency = 0.69 }\n')
    own = parse_mixed_cluster(str(node))
    fast = Hardware(own.groups[0], "fp16").collective_time("all_reduce", nbytes, shape)
    assert fast < Hardware(parse_cluster("4xRTX-4090"), "fp16").collective_time("all_reduce", nbytes, shape)


def test_deepspeeds_pipeline_engine_leaves_the_gradient_all_reduce_exposed():
    from dataclasses import replace

    from flexmesh.cost.training.model import CostModel
    from flexmesh.layout.stack import DEEPSPEED_PIPE, FRAMEWORKS
    from flexmesh.spec import parse_model

    model, cluster = parse_model("llama2-7b"), parse_cluster("1x8xA100-80GB")
    overlapped = CostModel(model, cluster)
    after = CostModel(model, cluster, parts=Parts(stack=replace(MEGATRON_V1, framework=DEEPSPEED_PIPE)))
    assert FRAMEWORKS["deepspeed-pipe"] is DEEPSPEED_PIPE and MEGATRON_V1.framework is DEEPSPEED_PIPE
    assert float(overlapped.exposed_sync(1.0, 4.0, layers=4)) == pytest.approx(0.13)  # hidden under the backward
    assert float(after.exposed_sync(1.0, 4.0, layers=4)) == 1.0


def test_fp32_gradient_reduction_moves_four_bytes_a_parameter_where_gradients_are_kept_in_two():
    from dataclasses import replace

    from flexmesh.cost.training.mixed_runs import RUN_STACKS
    from flexmesh.cost.training.model import CostModel
    from flexmesh.cost.training.work import Work
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.spec import parse_model
    from flexmesh.spec.model import with_dtype

    cluster, s, work = parse_cluster("2x8xA100-80GB"), LayerStrategy(dp=16), Work.uniform(1, 2048)
    wide = replace(MEGATRON_V1, fp32_grad_reduce=True)
    assert "fp32 gradient reduction" in wide.label and "gradient" not in MEGATRON_V1.label
    for dtype, factor in (("fp16", 2.0), ("bf16", 1.0)):  # bf16 runs keep fp32 gradients already
        model = with_dtype(parse_model("llama2-7b"), dtype)
        plain, fp32 = (CostModel(model, cluster, parts=Parts(stack=st)).layer(s, work) for st in (MEGATRON_V1, wide))
        assert fp32.grad_sync / plain.grad_sync == pytest.approx(factor, rel=0.05)  # a 400 MB all-reduce: bandwidth
        assert fp32.states == plain.states  # the gradients are kept as before
    # AMP's runs reduce so (its DeepSpeed config), Sailor's fp32 runs need not; a run without data parallelism
    # reduces nothing across replicas and is priced the same
    assert RUN_STACKS["AMP"].fp32_grad_reduce and not RUN_STACKS["Sailor"].fp32_grad_reduce
    amp = {r.name: r for r in published_runs() if r.system == "AMP"}
    assert replay(amp["H1"]) > replay(amp["H1"], MEGATRON_V1)
    assert amp["A12"].dp == 1 and replay(amp["A12"]) == pytest.approx(replay(amp["A12"], MEGATRON_V1), rel=1e-9)
