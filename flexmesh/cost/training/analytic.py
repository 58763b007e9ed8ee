"""Layer timing kernel by kernel, bytes counted tensor by tensor: the cost model's default.

Times come from a :class:`~flexmesh.cost.device.kernels.Kernels` (the :class:`~flexmesh.cost.Hardware`'s:
datasheet SMs, peak and HBM bandwidth with fitted efficiencies; for a hardware profile its measured
throughputs, without tile quantization). Sources of the counts:

- Every matmul of a layer with its own shape on each device (:func:`linear_shapes`): rows are the
  tokens of the tp group's sequence shard (sequence parallelism gathers them), columns and reduction
  split by tp as Megatron-LM splits them (2104.04473); backward is the input-gradient and the
  weight-gradient GEMM of each. Causal flash attention: 2 x q_dim FLOPs per layer per squared token
  forward, twice that backward, at an efficiency falling for short blocks (context parallelism makes
  them); ring attention's slowest rank, its per-hop kernels and the merge of partial outputs.
- Memory-bound operators (:func:`memory_bytes_per_token`): norms, residual adds, rotary, activation,
  and at the head softmax + cross entropy over the vocabulary; read + write once each forward
  (fused kernels, as Megatron-LM runs them), twice the bytes backward.
- Full recomputation charges the forward once more inside the backward (:meth:`AnalyticTiming.recompute_time`).
- Bytes per parameter (weights, gradients, optimizer states) by training precision, as Megatron-LM's
  distributed-optimizer notes tabulate them: bf16 weights with fp32 gradients 2 + 4 + 12 (fp32 main
  weights, Adam m and v); fp16 weights and gradients 2 + 2 + 16 (fp32 main weights and main
  gradients, m, v); fp32 4 + 4 + 8 (Adam m and v only). ZeRO-1 shards the optimizer states, ZeRO-2
  also the gradients, ZeRO-3 all of them (ZeRO, 1910.02054).
- Saved activations per token per layer, with flash-style attention (no s^2 term, no mask) and
  sequence parallelism dividing everything by tp (Korthikanti et al., 2205.05198, adapted to
  SwiGLU/GQA; counted tensor by tensor in :func:`activation_elems_per_token`). Full recomputation
  keeps only the layer input. Selective recomputation (the attention core only, 2205.05198 section
  5) keeps the same count: what it saves there are the s^2 scores, softmax and dropout mask of
  unfused attention, which flash-style attention never stores; the core's output is the output
  projection's input, and its softmax statistics are left out of the count either way. So here it
  only adds the attention forward to the backward; a model profile prices what the runtime keeps.
- Logits: bf16 logits + fp32 softmax saved by the vocab-parallel cross entropy: 6 bytes per logit.
- Optimizer step: Adam's HBM traffic per parameter over the achievable HBM bandwidth.

>>> from flexmesh.cost.device.hardware import Hardware
>>> from flexmesh.layout.strategy import LayerStrategy
>>> from flexmesh.spec import parse_cluster, parse_model
>>> t = AnalyticTiming(parse_model("llama2-7b"), Hardware(parse_cluster("8xA100-80GB")))
>>> t.activation_bytes_per_token(LayerStrategy(tp=2), recompute=False)  # 76800 elements x 2 B / tp
76800.0
>>> t.state_bytes_per_param()
(2, 4, 12)
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import numpy as np

from flexmesh.cost.device.flash2 import flash2_kernels
from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.device.kernels import Kernels
from flexmesh.cost.device.layer_shapes import linear_shapes, pointwise_elems_per_token
from flexmesh.cost.training.experts import (
    ExpertParallel,
    expert_gemm_times,
    moe_activation_elems,
    moe_fraction,
    moe_memory_bytes,
)
from flexmesh.cost.training.timing import LayerTimes
from flexmesh.cost.training.work import NO_WINDOW, Amount, ring_hops
from flexmesh.layout.stack import RUNTIME_STACK, Stack
from flexmesh.layout.strategy import LayerStrategy, Recompute
from flexmesh.spec.model import ModelSpec

# (weight, gradient, optimizer-state) bytes per parameter by training precision (Megatron-LM,
# docs/source/api-guide/dist_optimizer.md, "fp16 param, fp16 grads 20; bf16 param, fp32 grads 18;
# fp32 param, fp32 grads 16"): bf16 accumulates and reduces gradients in fp32 (Megatron-LM's default).
STATE_BYTES = {"bf16": (2, 4, 12), "fp16": (2, 2, 16), "fp32": (4, 4, 8)}
LOGIT_BYTES = 6
# Of a layer's saved activations (activation_elems_per_token), x hidden per token: the two norm inputs
# and the inputs of the QKV and MLP-up GEMMs, which tensor parallelism without sequence parallelism
# keeps whole on every tp rank (2205.05198 section 4.2.1); dropout keeps two one-byte masks of hidden
# size (after attention and after the MLP). Norms and residual adds (2 x 2h + 2 x 3h bytes moved per
# token, memory_bytes_per_token) likewise run on every tp rank.
REPLICATED_ACT_ELEMS = 4
# With the pointwise operators recomputed (Stack.pointwise_recompute) the GEMM inputs are not kept: the
# two norm inputs alone.
REPLICATED_ACT_ELEMS_POINTWISE = 2
DROPOUT_MASKS = 2
REPLICATED_MEMORY_ELEMS = 10
# Adam step traffic per parameter (time = bytes / achievable HBM bandwidth): mixed precision reads
# the fp32 weight, grad, m, v (16 B) and writes weight, m, v and the 2-byte copy (14 B); fp16 also
# reads its fp16 gradient into the fp32 main gradient (2 + 4 B); fp32 reads 16 B and writes 12 B.
OPTIM_TRAFFIC_BYTES = {"bf16": 30, "fp16": 36, "fp32": 28}
# Streaming kernels of a layer's forward (and as many backward): 2 norms, 2 residual adds, rotary,
# activation (Megatron-LM's fused kernels: fused RMSNorm/LayerNorm, bias-dropout-add, rope, SwiGLU).
LAYER_MEMORY_KERNELS = 6
# Of those, what a stack recomputing the pointwise operators runs again in backward: 2 norms, rotary, activation.
POINTWISE_KERNELS = 4
# Ring attention merges each hop's partial output into an fp32 accumulator (read the accumulator and
# the block, write the accumulator: 3 x 4 bytes per output element), and backward accumulates dq,
# dk, dv in fp32 (read + write: 8 bytes per element), as the runtime's ring does.
RING_MERGE_FWD_BYTES = 12
RING_MERGE_BWD_BYTES = 8


def memory_bytes_per_token(model: ModelSpec, experts: ExpertParallel | None = None) -> float:
    """Bytes the memory-bound operators of one layer's forward move per token (before dividing by tp x cp).

    Two norms (read + write h), two residual adds (read 2h, write h), rotary on q and k (read + write),
    activation (SwiGLU: read gate and up, write ffn; GeLU: read and write ffn).

    >>> from flexmesh.spec import MODEL_PRESETS
    >>> memory_bytes_per_token(MODEL_PRESETS["llama2-7b"])  # (4h + 6h + 2(q + kv) + 3 ffn) x 2 B
    180736
    """
    h, b = model.hidden, model.dtype_bytes
    norms_rotary, act = pointwise_elems_per_token(model)
    if model.is_moe:  # dense MLPs on the dense layers, experts' kernels on the others (flexmesh.cost.training.experts)
        f = moe_fraction(model)
        return (norms_rotary + 6 * h + (1 - f) * act) * b + f * moe_memory_bytes(model, experts or ExpertParallel())
    return (norms_rotary + 6 * h + act) * b


def activation_elems_per_token(model: ModelSpec, fused_swiglu: bool = False,
                               experts: ExpertParallel | None = None, pointwise_recompute: bool = False) -> float:
    """Elements one layer saves for backward per token (before dividing by tp and cp).

    Attention block: norm input, qkv input, q, k, v, attention output (saved by the kernel and by
    the output projection). MLP block: norm input, fc input, and for SwiGLU the gate and up outputs,
    the activation output and the down-projection input (GeLU: fc1 output and activation output);
    a fused SwiGLU (``fused_swiglu``, flexmesh.layout.stack) recomputes the activation output. With
    the pointwise operators recomputed (``pointwise_recompute``) the norms' outputs (the qkv and fc
    inputs), the activation output and the down-projection input are not kept (an MoE layer's experts
    keep what they keep: flexmesh.cost.training.experts).

    >>> from flexmesh.spec import MODEL_PRESETS
    >>> activation_elems_per_token(MODEL_PRESETS["llama2-7b"])  # 6h + 2kv + 4ffn
    76800
    >>> activation_elems_per_token(MODEL_PRESETS["llama2-7b"], pointwise_recompute=True)  # 4h + 2kv + 2ffn
    46592
    """
    h = model.hidden
    kept_inputs = 1 if pointwise_recompute else 2  # per block: the norm input (and the GEMM input)
    attn = kept_inputs * h + 2 * model.q_dim + 2 * model.kv_dim
    up = (2 if model.activation == "swiglu" else 1) * model.ffn_hidden
    if pointwise_recompute:
        dense = up
    else:
        dense = ((3 if fused_swiglu else 4) if model.activation == "swiglu" else 2) * model.ffn_hidden
    if model.is_moe:  # the norm input, then the dense layers' MLP or the experts' (flexmesh.cost.training.experts)
        f = moe_fraction(model)
        return attn + kept_inputs * h + (1 - f) * dense + f * moe_activation_elems(model, experts or ExpertParallel())
    return attn + kept_inputs * h + dense


class AnalyticTiming:
    """:class:`~flexmesh.cost.training.timing.LayerTiming` of ``model`` from FLOPs over ``hardware``'s throughput."""

    def __init__(self, model: ModelSpec, hardware: Hardware, ring_balanced: bool = False,
                 stack: Stack = RUNTIME_STACK, experts: ExpertParallel | None = None):
        self.model = model
        self.experts = experts or ExpertParallel()  # how a mixture of experts' experts run (cost.experts)
        self.stack = stack  # how the stack runs a layer where stacks differ (flexmesh.layout.stack)
        # Ring attention slicing: False, contiguous slices as the runtime cuts them (the last rank does
        # the most work); True, 2 x cp chunks paired so every rank does the same (Llama 3, 2407.21783).
        self.ring_balanced = ring_balanced
        self.hw = hardware
        self.dtype = model.dtype
        self.act_elems = activation_elems_per_token(model, stack.fused_swiglu, self.experts, stack.pointwise_recompute)
        # A measured machine (a hardware profile) has no datasheet tiles: its throughputs as measured.
        self.kernels: Kernels = getattr(hardware, "kernels", None) or Kernels(
            mm_flops=hardware.matmul_flops, attn_flops=hardware.attn_flops, hbm_bytes_per_s=hardware.hbm_bytes_per_s,
            sms=None, attn_overhead=0.0, launch_s=0.0, dtype_bytes=model.dtype_bytes)
        device = getattr(getattr(hardware, "cluster", None), "device", None)
        if stack.attention == "flash2" and device is not None and self.dtype in ("bf16", "fp16"):
            self.kernels = flash2_kernels(self.kernels, device.architecture, hardware.peak_flops)
        if stack.framework.gemm_share != 1.0:  # the stack's share of the family's GEMM rate (Framework)
            self.kernels = replace(self.kernels, mm_flops=hardware.matmul_flops * stack.framework.gemm_share)
        self.mem_bytes = memory_bytes_per_token(model, self.experts)
        # What recomputing the pointwise operators moves again per token (the dense MLPs' activation alone:
        # experts keep what they keep)
        norms_rotary, act = pointwise_elems_per_token(model)
        dense = 1.0 - moe_fraction(model) if model.is_moe else 1.0
        self.pointwise_bytes = (norms_rotary + dense * act) * model.dtype_bytes
        self.windows = model.attention_windows if model.sliding_window is not None else NO_WINDOW
        self._scalar_layer = lru_cache(maxsize=None)(self._layer_times)

    def check_model(self, model: ModelSpec) -> None:
        """Raise ValueError unless ``model`` is the one this timing was built for (any dtype)."""
        if replace(model, dtype=self.dtype) != self.model:
            raise ValueError(f"this AnalyticTiming was built for model {self.model.name!r}, not {model.name!r}")

    def source(self, hardware_source: str) -> str:
        """The hardware's: FLOPs add no source of their own."""
        return hardware_source

    def layer_times(self, s: LayerStrategy, tokens: Amount, sq_tokens: Amount) -> LayerTimes:
        """Each matmul by its shape, the memory-bound operators by their bytes, attention by its
        blocks; backward input- and weight-gradient GEMMs, plus the recomputed forward."""
        if isinstance(tokens, np.ndarray) or isinstance(sq_tokens, np.ndarray):
            return self._layer_times(s, tokens, sq_tokens)
        # Scalars (the search): what data parallelism and ZeRO do not change, computed once (experts
        # depend on the data ranks they spread over).
        dp = s.dp if self.model.is_moe else 1
        return self._scalar_layer(LayerStrategy(tp=s.tp, cp=s.cp, cp_kind=s.cp_kind, recompute=s.recompute, dp=dp),
                                  float(tokens), float(sq_tokens))

    def _layer_times(self, s: LayerStrategy, tokens: Amount, sq_tokens: Amount) -> LayerTimes:
        k = self.kernels
        rows = tokens / s.cp  # GEMM rows: the tp group's shard of the sequence, gathered
        gemm_f = gemm_b = 0.0
        dense = 1.0 - moe_fraction(self.model) if self.model.is_moe else 1.0  # the MLP GEMMs' share
        for i, (n, red) in enumerate(linear_shapes(self.model, s.tp)):
            f, b = k.linear(rows, n, red)
            share = dense if i >= 2 else 1.0
            gemm_f, gemm_b = gemm_f + share * f, gemm_b + share * b
        if self.model.is_moe:  # each tp rank routes its slice of the sequence; experts over every rank
            f, b = expert_gemm_times(k, self.model, rows / s.tp, self.experts, s.dp * s.cp * s.tp)
            gemm_f, gemm_b = gemm_f + (1.0 - dense) * f, gemm_b + (1.0 - dense) * b
        local = tokens / (s.tp * s.cp) * self.mem_bytes  # sequence parallel: each device its tokens
        if s.tp > 1 and not self.stack.sequence_parallel:  # norms and residual adds on every tp rank
            local = local + tokens / s.cp * (1.0 - 1.0 / s.tp) * REPLICATED_MEMORY_ELEMS * self.model.hidden \
                * self.model.dtype_bytes
        mem_f = k.memory_bound(local, LAYER_MEMORY_KERNELS)
        mem_b = k.memory_bound(2 * local, LAYER_MEMORY_KERNELS)
        attn_f, attn_b = self.attention_times(s, tokens, sq_tokens)
        fwd = gemm_f + mem_f + attn_f
        if self.stack.pointwise_recompute and not s.recompute:  # the norms, rotary and activation again
            mem_b = mem_b + k.memory_bound(tokens / (s.tp * s.cp) * self.pointwise_bytes, POINTWISE_KERNELS)
        bwd = gemm_b + mem_b + attn_b + self.recompute_time(s, fwd, attn_f)
        return LayerTimes(fwd=fwd, bwd=bwd, attention=attn_f)

    def recompute_time(self, s: LayerStrategy, fwd: Amount, attention: Amount) -> Amount:
        """The forward repeated inside the backward (the one place it is charged): all of ``fwd``
        under full recomputation, the attention core's forward (``attention``, the forward's
        attention part) under selective recomputation, else nothing."""
        if s.recompute is Recompute.SELECTIVE:
            return attention
        return fwd if s.recompute else 0.0 * attention

    def attention_times(self, s: LayerStrategy, tokens: Amount, sq_tokens: Amount) -> tuple[Amount, Amount]:
        """(forward, backward) seconds of one layer's attention on each device of a tp x cp group.

        Blocks are sequences of the micro-batch's mean length ``sq_tokens / tokens`` (exact for equal
        lengths); Ulysses attends over whole sequences with ``heads / cp`` heads, ring attention over
        ``cp`` blocks of ``length / cp`` per pass, one kernel and one merge per block. With contiguous
        slices (as the runtime cuts them) the ring's last rank computes its diagonal block and all
        ``hops`` blocks before it while the first computes one: the ring runs at the last rank's pace,
        ``2 - 1 / (hops + 1)`` times the mean rank's attention (``2 - 1 / cp`` without a window).
        """
        m, k = self.model, self.kernels
        flops = m.layer_attn_flops_per_sq_token * sq_tokens / (s.tp * s.cp)
        length = sq_tokens / (np.maximum(tokens, 1e-9) if isinstance(tokens, np.ndarray) else max(tokens, 1e-9))
        if self.stack.attention == "unfused":
            return self.unfused_attention_times(s, tokens, length)
        if s.cp > 1 and s.cp_kind == "ring":
            block = length / s.cp
            hops = s.cp - 1.0 if self.windows == NO_WINDOW else ring_hops(s.cp, block, self.windows)
            if not self.ring_balanced:
                flops = flops * (2.0 - 1.0 / (hops + 1.0))
            calls = hops + 1.0
            rows = tokens / s.cp
            merge_f = k.memory_bound(hops * rows * m.q_dim / s.tp * RING_MERGE_FWD_BYTES, hops)
            merge_b = k.memory_bound(hops * rows * (m.q_dim + 2 * m.kv_dim) / s.tp * RING_MERGE_BWD_BYTES, hops)
        else:
            block, calls, merge_f, merge_b = length, 1.0, 0.0, 0.0
        fwd = k.attention(flops, block, calls) + merge_f
        bwd = k.attention(2 * flops, block, 2 * calls, backward=True) + merge_b
        return fwd, bwd

    def unfused_attention_times(self, s: LayerStrategy, tokens: Amount, length: Amount) -> tuple[Amount, Amount]:
        """(forward, backward) seconds of attention as separate kernels over the whole ``s x s`` scores
        (Megatron-LM before flash attention: baddbmm, fused scale-mask-softmax, dropout, bmm), each
        device's heads stacked: the batched GEMMs by shape at ``mm_efficiency`` (roofline: at a head
        dimension of 64-128 they are bound by writing the scores), the softmax and dropout passes by
        the bytes they move. Forward: ``Q K^T`` (rows x length x head_dim), softmax (read and write
        the scores), dropout (read, write, a one-byte mask), ``P V``; backward: ``dP = dO V^T``,
        ``dV = P^T dO``, dropout and softmax backward (softmax reads probabilities and gradient, writes
        one), ``dQ = dS K``, ``dK = dS^T Q``. No constant of its own: nothing fitted to unfused runs."""
        m, k = self.model, self.kernels
        rows = tokens * m.num_heads / (s.tp * s.cp)  # every local head's queries, stacked
        scores = rows * length
        b = m.dtype_bytes
        dropout = (2 * b + 1) * scores if self.stack.dropout else 0.0 * scores
        passes = 2.0 if self.stack.dropout else 1.0
        fwd = (k.gemm(rows, length, m.head_dim) + k.gemm(rows, m.head_dim, length)
               + k.memory_bound(2 * b * scores + dropout, passes))
        bwd = (k.gemm(rows, length, m.head_dim) + 3 * k.gemm(rows, m.head_dim, length)
               + k.memory_bound(3 * b * scores + dropout, passes))
        return fwd, bwd

    def embedding_times(self, s: LayerStrategy, tokens: Amount) -> tuple[Amount, Amount]:
        """No time: a lookup moves ``2 h`` bytes per token, less than a tenth of one layer's memory-bound
        bytes (:func:`memory_bytes_per_token`), and has no FLOPs to count."""
        return 0.0, 0.0

    def head_times(self, s: LayerStrategy, tokens: Amount) -> tuple[Amount, Amount]:
        """Final norm, the LM head GEMM over the device's vocabulary shard, softmax + cross entropy."""
        m, k = self.model, self.kernels
        rows = tokens / s.cp
        f, b = k.linear(rows, m.vocab / s.tp, m.hidden)
        norm = tokens / (s.tp * s.cp) * 4 * m.hidden * m.dtype_bytes
        ce = rows * m.vocab / s.tp * self.stack.framework.cross_entropy_bytes
        return f + k.memory_bound(norm + ce, 2), b + k.memory_bound(2 * norm + ce, 2)

    def activation_bytes_per_token(self, s: LayerStrategy, recompute: bool) -> float:
        """:func:`activation_elems_per_token` (the layer input alone when recomputed) / (tp x cp); without
        sequence parallelism the norm inputs, the inputs of the column-parallel GEMMs and the dropout
        masks are whole on every tp rank (Korthikanti et al. 2205.05198, eq. 2: ``10 + 24 / t``)."""
        m, sp = self.model, self.stack.sequence_parallel or s.tp == 1
        b = m.dtype_bytes
        if recompute:
            return m.hidden * b / (s.cp * (s.tp if sp else 1))
        masks = DROPOUT_MASKS * m.hidden if self.stack.dropout else 0  # one byte per element
        replicated = (REPLICATED_ACT_ELEMS_POINTWISE if self.stack.pointwise_recompute else REPLICATED_ACT_ELEMS) \
            * m.hidden * b
        return ((self.act_elems * b - replicated) / s.tp + (replicated + masks) / (s.tp if sp else 1)) / s.cp

    def activation_bytes(self, s: LayerStrategy, tokens: float, recompute: bool) -> float:
        """As :meth:`activation_bytes_per_token`, for ``tokens`` of the micro-batch."""
        return tokens * self.activation_bytes_per_token(s, recompute)

    def mask_bytes(self, s: LayerStrategy, tokens: float, sq_tokens: float = 0.0) -> float:
        """Unfused attention's ``s x s`` scores kept for backward (``sq_tokens``: the micro-batch's squared
        sequence lengths summed), per head, split over tp (x cp): the softmax output, and with dropout
        its one-byte mask and its output (2205.05198: ``5 a s^2 b``). Nothing for fused (flash-style)
        attention, the runtime's, nor when the core is recomputed (selective recomputation)."""
        if self.stack.fused or s.recompute is Recompute.SELECTIVE:
            return 0.0
        per_score = self.model.dtype_bytes + ((1 + self.model.dtype_bytes) if self.stack.dropout else 0)
        return self.model.num_heads * sq_tokens * per_score / (s.tp * s.cp)

    def carried_bytes(self, s: LayerStrategy, prefix: float, tokens: float) -> float:
        """The prefix's keys and values, which a flash-style kernel keeps for the later piece's
        backward: 2 x kv heads x head dim per prefix token, split over tp x cp."""
        m = self.model
        return 2.0 * m.num_kv_heads * m.head_dim * prefix * m.dtype_bytes / (s.tp * s.cp)

    def embedding_activation_bytes(self, s: LayerStrategy, tokens: float) -> float:
        """The embedding output, split over tp x cp (sequence parallel; over cp alone without it)."""
        tp = s.tp if self.stack.sequence_parallel else 1
        return tokens / s.cp / tp * self.model.hidden * self.model.dtype_bytes

    def logit_bytes(self, s: LayerStrategy, tokens: float) -> float:
        """:data:`LOGIT_BYTES` per logit of the device's tokens and vocabulary shard."""
        return tokens / s.cp * self.model.vocab / s.tp * LOGIT_BYTES

    def state_bytes_per_param(self) -> tuple[float, float, float]:
        """:data:`STATE_BYTES` of the model's dtype."""
        return STATE_BYTES[self.model.dtype]

    def optimizer_s_per_param(self) -> float:
        """:data:`OPTIM_TRAFFIC_BYTES` of the model's dtype over the achievable HBM bandwidth."""
        return OPTIM_TRAFFIC_BYTES[self.model.dtype] / self.kernels.hbm_bytes_per_s

    def stage_fixed_s(self) -> float:
        """0: no published measurement gives a stack's framework time per pipeline chunk, and a
        datasheet has none to count (each kernel's launch is in its time); a model profile measures it."""
        return 0.0
