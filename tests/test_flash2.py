"""FlashAttention-2 where an architecture's fastest fused attention is another kernel (flexmesh.cost.device.flash2):
the runtime's stack prices it, from measurements the code can refit; other stacks and architectures do not move."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from flexmesh.cost import CostModel
from flexmesh.cost.device.flash2 import PASSES, fit, flash2_kernels, main
from flexmesh.cost.training.calibrate import FUSED_STACK, PUBLISHED_RUNS
from flexmesh.cost.training.parts import Parts
from flexmesh.layout import LayerStrategy as S
from flexmesh.layout.stack import RUNTIME_STACK, Stack
from flexmesh.profile.model import sweep
from flexmesh.spec import parse_cluster, parse_model
from flexmesh.spec.devices import FLASH2

ROOT = Path(__file__).resolve().parent.parent


def priced_as(cost: CostModel, stack: Stack) -> CostModel:
    """``cost`` pricing layers as ``stack`` runs them."""
    return cost.replace(parts=Parts(stack=stack))


def test_recorded_fits_are_what_the_samples_give():
    assert main() == 0
    entry = FLASH2["hopper"]
    for side in PASSES:
        eff, overhead = fit(entry, side)
        assert eff == pytest.approx(entry[f"{side}_efficiency"], rel=5e-3)
        assert overhead == pytest.approx(entry[f"{side}_overhead_keys"], rel=5e-3)


def _layer(cluster: str, stack: Stack, length: int, model: str = "llama2-7b", tokens: int = 16384):
    """One layer's attention over ``tokens`` packed as documents of ``length`` (as bench/attention_kernel.py
    measured it: 16,384 tokens per call)."""
    cm = priced_as(CostModel(parse_model(model), parse_cluster(cluster)), stack)
    return cm.timing.attention_times(S(), float(tokens), float(tokens) * length)


@pytest.mark.parametrize("length", [512, 2048, 16384])
def test_runtime_attention_is_slower_than_the_fused_kernel_on_hopper_only(length):
    fused_f, fused_b = _layer("8xH100-80GB", FUSED_STACK, length)
    fa2_f, fa2_b = _layer("8xH100-80GB", RUNTIME_STACK, length)
    assert fa2_f > 1.4 * fused_f and fa2_b > 1.9 * fused_b  # measured: 1.6-5x forward, 2.2-7x backward
    assert fa2_b / fa2_f > fused_b / fused_f  # FlashAttention-2's backward lags its forward there
    # Ampere's measured fused kernel is FlashAttention-2 already: the same price
    # exact: the same kernel rates: the same price
    assert _layer("8xA100-80GB", RUNTIME_STACK, length) == _layer("8xA100-80GB", FUSED_STACK, length)


def test_the_fit_prices_its_samples_within_its_own_error():
    """In-sample by construction (the samples are the fit's): the price per document length follows
    the measured curve, short documents far slower than long ones."""
    entry = FLASH2["hopper"]
    lengths = entry["doc_lengths"]
    for side, rates in (("fwd", entry["fwd_tflops"]), ("bwd", entry["bwd_tflops"])):
        for i, length in enumerate(lengths):
            measured = float(np.mean([r[i] for r in rates]))
            fwd, bwd = _layer("1xH100-80GB", RUNTIME_STACK, length)
            # llama2-7b: q_dim 4096; 16,384 tokens as documents of ``length``
            flops = 2 * 4096 * 16384 * length * (1 if side == "fwd" else 2)
            priced = flops / (fwd if side == "fwd" else bwd) / 1e12
            assert priced == pytest.approx(measured, rel=0.2), (side, length)


def test_plans_price_the_runtime_by_default_and_other_stacks_on_request():
    default = CostModel(parse_model("llama2-7b"), parse_cluster("8xH100-80GB"))
    assert default.timing.stack == RUNTIME_STACK
    a = default.timing.layer_times(S(dp=8), 8192.0, 8192.0**2)
    b = priced_as(default, FUSED_STACK).timing.layer_times(S(dp=8), 8192.0, 8192.0**2)
    assert a.fwd > b.fwd and a.bwd > b.bwd and a.attention > b.attention


def test_published_runs_keep_the_fused_stack():
    for run in PUBLISHED_RUNS:
        # the fused attention kernel; Llama 3's rows also recompute pointwise ops (llm-foundry's MPT runs
        # FlashAttention's Triton kernel, priced as flash2)
        if run.attention != "unfused" and run.framework.name == "megatron":
            assert run.cost_model().timing.stack == replace(FUSED_STACK, pointwise_recompute=run.pointwise_recompute)
            assert run.cost_model().timing.stack.attention == "fused"


def test_gpu_profile_rows_are_long_enough_to_time_the_gpu():
    cpu, gpu = sweep(False), sweep(False, gpu=True)
    assert min(sum(r) for r in gpu["rows"]) >= 1024 and max(sum(r) for r in gpu["rows"]) >= 16384
    for cfg in (cpu, gpu, sweep(True), sweep(True, gpu=True)):  # the whole model is timed over several rows
        assert sum(sum(r) <= cfg["whole_max_tokens"] for r in cfg["rows"]) >= 3


@pytest.mark.slow
def test_attention_bench_runs_on_cpu():
    out = subprocess.run([sys.executable, "-m", "bench.attention_kernel", "--cpu", "--no-record", "--repeat", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert "measured / fused price" in out.stdout and "measured / flash2 price" in out.stdout
    assert out.stdout.count("| sdpa |") == 6


@pytest.mark.parametrize("architecture", ["hopper", "ampere"])
def test_the_envelope_keeps_the_per_tile_cost_and_stays_below_and_additive(architecture):
    """The schedulers' lower bounds price attention by the envelope: never above the kernel's price,
    additive over documents (so packing cannot beat it), and with FlashAttention-2's large per-tile cost
    kept (a bound without it is 4x loose at 512 tokens)."""
    from flexmesh.cost.device.kernels import Kernels

    k = flash2_kernels(Kernels(mm_flops=600e12, attn_flops=500e12, hbm_bytes_per_s=3e12, sms=132), architecture,
                       989.5e12)
    env = k.envelope()
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(1, 20000, size=rng.integers(1, 9)).astype(float)
        tokens, sq = lengths.sum(), (lengths**2).sum()
        for backward in (False, True):
            alone = sum(float(env.attention(2.0 * x * x, x, 0.0, backward)) for x in lengths)
            packed = float(env.attention(2.0 * sq, sq / tokens, 0.0, backward))
            assert packed == pytest.approx(alone, rel=1e-9)
            assert packed <= sum(float(k.attention(2.0 * x * x, x, 0.0, backward)) for x in lengths) * (1 + 1e-12)
    untiled = replace(env, attn_overhead=0.0, attn_bwd_overhead=0.0)
    assert float(env.attention(1e12, 512.0)) > (1.5 if architecture == "hopper" else 1.1) * float(
        untiled.attention(1e12, 512.0))
