"""The memory model: the budget formula, transient buffers, and published layouts that really ran.

The fitting-set sources (Megatron-LM 2104.04473, Llama 3 2407.21783, FlexSP 2412.01523) publish no
peak memory per layout; what they say is that their layouts ran on 80 GB parts. Those statements are
what is checked here: an estimate within 10% of a published peak cannot be tested from them (see
docs/cost-model.md, "Memory"). Korthikanti et al. (2205.05198) is held out for evaluation.
"""

from dataclasses import replace

import pytest

from flexmesh.cost import CostModel, Work
from flexmesh.cost.training.calibrate import PUBLISHED_RUNS
from flexmesh.cost.training.memory import (
    CUBLAS_WORKSPACE_BYTES,
    TE_USERBUFFERS,
    fit_fragmentation,
    gemm_workspace_bytes,
)
from flexmesh.layout import LayerStrategy as S
from flexmesh.layout.overlap import Overlap
from flexmesh.spec import MODEL_PRESETS, parse_cluster
from flexmesh.units import GIB

MODEL = MODEL_PRESETS["llama2-7b"]
# Llama 3 405B ran without activation checkpointing at 8K (2407.21783, section 3.3.2): micro-batch of one
# sequence, TP 8 x PP 16, chunks of one layer (one layer fewer on the first and last stage leaves the
# first chunk with the embedding alone and the last with the head alone: 8 chunks per rank), gradients
# accumulated in fp32 over micro-batches before the reduce-scatter (section 3.3.4), so kept unsharded
# (ZeRO-1 states here are the same bytes). Priced so (calibrate.PublishedRun.end_chunks, Megatron's warm-up
# with N = pp), rank 1 holds 141 one-layer chunks in flight. Its stack "proactively deallocate[d] tensors
# that will not be used for future computation"; what it kept per layer is not published: priced as what a
# layer keeps when it recomputes its pointwise operators (PublishedRun.pointwise_recompute), 66 GiB at 8K and
# 61 at 16K GPUs and 131K against 78.9 usable; an eager layer keeping every intermediate tensor would need
# 103 and 95 (test_llama3_fits_only_without_the_pointwise_intermediates).
LLAMA3 = [r for r in PUBLISHED_RUNS if r.name.startswith("llama3-")]


def test_budget_is_capacity_less_context_over_fragmentation():
    d = parse_cluster("8xH100").device
    assert d.usable_memory_bytes == pytest.approx((d.memory_gib - d.framework_reserve_gib) * GIB)
    frag = replace(d, allocator_headroom=0.08, framework_reserve_gib=1.5)
    assert frag.usable_memory_bytes == pytest.approx((d.memory_gib - 1.5) / 1.08 * GIB)
    cm = CostModel(MODEL, parse_cluster("8xH100"))
    assert cm.memory_budget == d.usable_memory_bytes  # exact: the cost model reads the device's budget


def test_fragmentation_fit_recovers_a_known_fraction():
    cm = CostModel(MODEL, parse_cluster("8xH100"))
    context = 0.76 * GIB
    observations = []
    for s in (S(dp=8, zero=1), S(tp=2, dp=4, zero=3), S(tp=8, recompute=True)):
        ev = cm.evaluate_stages([[s] * MODEL.num_layers], 1, "1f1b", 4, 1, s.dp, 4096)
        observations.append((ev.peak_memory, 1.07 * ev.peak_memory + context, context))
    assert fit_fragmentation(observations) == pytest.approx(0.07)
    assert fit_fragmentation([]) is None


def test_transient_buffers_are_counted_tensor_by_tensor():
    cm = CostModel(MODEL, parse_cluster("8xH100"))
    w = Work(8192, 8192.0**2)
    base = cm.layer(S(dp=8), w).transient
    assert base == pytest.approx(gemm_workspace_bytes(MODEL, S(dp=8), 8192))
    assert base == pytest.approx(8192 * 2 * MODEL.ffn_hidden * 2 + CUBLAS_WORKSPACE_BYTES)
    gathered = 8192 * MODEL.hidden * 2  # the sequence-parallel all-gather output
    tp = cm.layer(S(tp=2, dp=4), w)
    assert tp.transient == pytest.approx(gemm_workspace_bytes(MODEL, S(tp=2), 8192) + gathered)
    ub = cm.layer(S(tp=2, dp=4), w, Overlap(tp_comm=True))
    assert ub.transient - tp.transient == pytest.approx((TE_USERBUFFERS - 1) * gathered)


@pytest.mark.parametrize("run", PUBLISHED_RUNS, ids=lambda r: r.name)
def test_published_layouts_that_ran_are_judged_to_fit(run):
    ev = run.predict()
    assert ev.fits, (run.name, ev.peak_memory / GIB, ev.budget / GIB)
    capacity = run.cluster().device.memory_gib * GIB
    assert ev.device_peak_memory <= capacity  # what the device shows stays under what it has


def test_a_layout_that_cannot_fit_is_rejected():
    # Megatron-LM's 145.6B layout (2104.04473, Table 1) without its pipeline: the states alone are
    # 18 bytes x 145.6e9 / 8 = 305 GiB per device.
    run = next(r for r in PUBLISHED_RUNS if r.name == "gpt-145.6b")
    ev = replace(run, pp=1, gpus=run.gpus // run.pp).predict()
    assert not ev.fits and ev.peak_memory > 18 * run.model.total_params / 8 * 0.99


@pytest.mark.parametrize("run", LLAMA3, ids=lambda r: r.name)
def test_llama3_fits_only_without_the_pointwise_intermediates(run):
    """What the fit of the Llama 3 rows assumes, and that it matters: kept as an eager layer keeps its
    tensors, the layout would not have run; the recomputation costs under 1% of the step."""
    lean, eager = run.predict(), replace(run, pointwise_recompute=False).predict()
    assert run.pointwise_recompute and lean.fits and not eager.fits
    assert eager.peak_memory - lean.peak_memory > 0.3 * eager.peak_memory
    assert 1.0 < lean.step_time / eager.step_time < 1.01
