"""Saved activations per layer against Korthikanti et al. (2205.05198, section 4, Table 2) for the cases
they cover: GPT layers (GeLU MLP of 4h, multi-head attention, 16-bit), unfused attention, dropout, tensor
parallelism with and without sequence parallelism, selective recomputation."""

from __future__ import annotations

import json

import pytest
from helpers import flat_model_profile

from flexmesh.cli import main
from flexmesh.cost import CostModel, Work
from flexmesh.cost.training.parts import Parts
from flexmesh.errors import SpecError
from flexmesh.layout import LayerStrategy as S
from flexmesh.layout.stack import RUNTIME_STACK, Stack
from flexmesh.layout.strategy import Recompute
from flexmesh.profile.timing import ProfiledTiming
from flexmesh.spec import MODEL_PRESETS, parse_cluster, parse_model

# The plans these tests check, not the policy `plan` recommends for them (its simulated steps: tests/conftest.py).
pytestmark = pytest.mark.usefixtures("no_recommendation")

MEGATRON = Stack(attention="unfused", sequence_parallel=False, dropout=True)
GPT_22B = "gpt:48:6144:64"  # Korthikanti et al.'s 22B model (Table 3)


def priced_as(cost: CostModel, stack: Stack) -> CostModel:
    """``cost`` pricing layers as ``stack`` runs them."""
    return cost.replace(parts=Parts(stack=stack))


def layer_act(stack: Stack, tp: int, s: int, recompute=Recompute.NONE) -> float:
    cm = priced_as(CostModel(parse_model(GPT_22B), parse_cluster("8xA100-80GB")), stack)
    return cm.layer(S(tp=tp, dp=8 // tp, recompute=recompute), Work(s, float(s) ** 2)).act


@pytest.mark.parametrize("s", [2048, 8192])
@pytest.mark.parametrize("t", [1, 2, 8])
def test_activation_bytes_follow_the_published_formulas(s, t):
    h, a = 6144, 64  # one sequence of s tokens (b = 1)
    sbh = s * h
    no_sp = sbh * (10 + 24 / t + 5 * a * s / (h * t))  # eq. 2 (t = 1: eq. 1, sbh (34 + 5as/h))
    sp = sbh / t * (34 + 5 * a * s / h)  # eq. 4
    selective = sbh / t * 34  # section 5
    assert layer_act(MEGATRON, t, s) == pytest.approx(no_sp, rel=0.05)
    with_sp = Stack(attention="unfused", dropout=True)
    assert layer_act(with_sp, t, s) == pytest.approx(sp, rel=0.05)
    assert layer_act(with_sp, t, s, Recompute.SELECTIVE) == pytest.approx(selective, rel=0.05)
    # flexmesh's runtime: fused attention, no dropout masks: the 32 of the 34
    assert layer_act(Stack(), t, s) == pytest.approx(sbh / t * 32, rel=1e-9)


def test_without_sequence_parallelism_norms_run_on_every_tp_rank():
    w = Work(4096, 4096.0**2)
    base = CostModel(parse_model("llama2-7b"), parse_cluster("8xA100-80GB"))
    no_sp = priced_as(base, Stack(sequence_parallel=False))
    assert no_sp.layer(S(tp=4, dp=2), w).fwd > base.layer(S(tp=4, dp=2), w).fwd
    # exact: without tp the same terms, priced by the same code
    assert no_sp.layer(S(dp=8), w).fwd == base.layer(S(dp=8), w).fwd  # no tp: nothing to replicate


def test_a_profile_prices_this_runtime_and_no_other_stack():
    mp = flat_model_profile()
    cm = CostModel(MODEL_PRESETS["tiny"], parse_cluster("2xA100-80GB"), timing=ProfiledTiming(mp))
    assert priced_as(cm, RUNTIME_STACK) is cm  # the runtime's own stack: the profile as it is
    with pytest.raises(SpecError, match="drop --model-profile"):
        priced_as(cm, MEGATRON)


def test_the_command_line_prices_another_stack(tmp_path, capsys):
    """A plan that fits flexmesh's runtime does not fit a stack that keeps the s x s scores."""
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt:24:2048:16", "--cluster", "8xA100-80GB", "--seq-len", "4096",
                 "--global-batch", "64", "--top", "1", "--out", str(plan)]) == 0
    capsys.readouterr()
    check = ["plan", "--check", str(plan), "--model", "gpt:24:2048:16", "--json"]
    assert main(check) == 0
    ours = json.loads(capsys.readouterr().out)
    assert ours["valid"] and max(ours["peak_memory_gib"]) < 79.2
    assert main(check + ["--fused-swiglu"]) == 0  # GeLU layers: the flag changes nothing
    # exact: the same plan priced by the same code
    assert json.loads(capsys.readouterr().out)["peak_memory_gib"] == ours["peak_memory_gib"]
    assert main(check + ["--attention", "unfused", "--no-sequence-parallel", "--dropout"]) == 2
    assert "GiB on stage 0 but the device has" in capsys.readouterr().err


def test_unfused_attention_is_priced_kernel_by_kernel():
    """Scores written and read by every pass: time per token grows with the length, dropout adds two
    passes, and at long sequences it is slower than flash-style attention."""
    cm = CostModel(parse_model(GPT_22B), parse_cluster("8xA100-80GB"))
    megatron, no_dropout = priced_as(cm, MEGATRON), priced_as(cm, Stack(attention="unfused"))

    def attention(c, s, tokens=8192):
        return c.timing.attention_times(S(tp=8), float(tokens), float(tokens) * s)

    f2, b2 = attention(megatron, 2048)
    f8, b8 = attention(megatron, 8192)
    assert 3.0 < f8 / f2 < 4.0 and 3.0 < b8 / b2 < 4.0  # the score traffic is linear in s per token
    assert attention(no_dropout, 2048)[0] < f2
    assert attention(cm, 8192)[0] < f8 / 2  # flash attention skips the masked half and stores nothing


def test_a_fused_swiglu_keeps_one_ffn_wide_tensor_less():
    """Megatron-LM's bias_swiglu and Transformer Engine keep the gate and up outputs and recompute silu in
    backward: ffn elements fewer per token than the runtime's separate kernels; GeLU layers are as they were."""
    llama = CostModel(parse_model("llama2-7b"), parse_cluster("8xA100-80GB"))
    fused = priced_as(llama, Stack(fused_swiglu=True))
    m = llama.model
    for s in (S(dp=8), S(tp=4, dp=2)):
        saved = llama.activation_bytes_per_token(s, layers=1) - fused.activation_bytes_per_token(s, layers=1)
        assert saved == pytest.approx(m.ffn_hidden * m.dtype_bytes / s.tp)
    gpt = CostModel(parse_model(GPT_22B), parse_cluster("8xA100-80GB"))
    assert priced_as(gpt, Stack(fused_swiglu=True)).activation_bytes_per_token(S(tp=8), layers=1) == \
        gpt.activation_bytes_per_token(S(tp=8), layers=1)
    assert Stack(fused_swiglu=True).label == "fused attention, sequence parallel, fused SwiGLU"


def test_recomputing_the_pointwise_operators_keeps_the_gemm_outputs_alone():
    """A compiled layer (torch.compile's partitioner) keeps the norm inputs, q, k, v, the attention output
    and the MLP's up outputs, and pays for it in backward alone: the norms', rotary's and activation's bytes
    moved again."""
    llama = CostModel(parse_model("llama2-7b"), parse_cluster("8xA100-80GB"))
    lean = priced_as(llama, Stack(pointwise_recompute=True))
    m = llama.model
    h, kv, ffn, b = m.hidden, m.kv_dim, m.ffn_hidden, m.dtype_bytes
    for s in (S(dp=8), S(tp=4, dp=2)):
        kept = lean.activation_bytes_per_token(s, layers=1)
        assert kept == pytest.approx((2 * h + 2 * m.q_dim + 2 * kv + 2 * ffn) * b / s.tp)
        assert kept < 0.65 * llama.activation_bytes_per_token(s, layers=1)
    # without sequence parallelism the two norm inputs stay whole on every tp rank, nothing else
    no_sp = priced_as(llama, Stack(pointwise_recompute=True, sequence_parallel=False))
    assert no_sp.activation_bytes_per_token(S(tp=4, dp=2), layers=1) == pytest.approx(
        (2 * h + (2 * m.q_dim + 2 * kv + 2 * ffn) / 4) * b)
    w = Work(4096, 4096.0**2)
    base, redo = llama.layer(S(tp=2, dp=4), w), lean.layer(S(tp=2, dp=4), w)
    assert redo.fwd == base.fwd  # exact: the same GEMM terms, priced by the same code
    moved = 4096 / 2 * (4 * h + 2 * (m.q_dim + kv) + 3 * ffn) * b  # 2 norms, rotary on q and k, SwiGLU
    k = lean.timing.kernels  # four more streaming kernels, each with its launch
    assert redo.bwd - base.bwd == pytest.approx(moved / k.hbm_bytes_per_s + 4 * k.launch_s)
    # fully recomputed layers keep their input alone whatever the stack, and recompute nothing more
    full = S(tp=2, dp=4, recompute=True)
    # exact: a layer computed in full prices the same either way
    assert lean.layer(full, w).bwd == llama.layer(full, w).bwd
    assert lean.activation_bytes_per_token(full, layers=1) == llama.activation_bytes_per_token(full, layers=1)
    assert Stack(pointwise_recompute=True).label == "fused attention, sequence parallel, pointwise ops recomputed"


def test_plan_prices_the_pointwise_recomputing_stack_from_the_command_line(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama2-7b", "--cluster", "8xA100-80GB", "--seq-len", "4096",
                 "--global-batch", "32", "--top", "1", "--out", str(plan)]) == 0
    capsys.readouterr()
    check = ["plan", "--check", str(plan), "--model", "llama2-7b", "--json"]
    peaks = []
    for extra in ([], ["--recompute-pointwise"]):
        assert main(check + extra) == 0
        peaks.append(max(json.loads(capsys.readouterr().out)["peak_memory_gib"]))
    assert peaks[1] < peaks[0]
