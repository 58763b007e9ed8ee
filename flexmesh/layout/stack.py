"""How the training stack runs a layer, where stacks differ and the plan does not say.

flexmesh's runtime runs FlashAttention-2 (``flash2``: PyTorch's varlen kernel or the flash-attn 2
package; on Hopper slower than the FlashAttention-3-class kernels that Transformer Engine and cuDNN run,
the ``fused`` stacks: flexmesh.cost.device.flash2), tensor parallelism with sequence parallelism and no
dropout; Megatron-LM before 2022, DeepSpeed and others may run unfused attention (the ``s x s`` scores
in memory), tensor parallelism without sequence parallelism (norms, dropouts and
the inputs of the column-parallel GEMMs replicated on every tp rank) and dropout (a one-byte mask per
dropped element); Megatron-LM and Transformer Engine fuse SwiGLU and recompute its silu in backward
(one ffn-wide tensor per token fewer); a compiled layer (torch.compile's min-cut partitioner) keeps
only the GEMMs' and attention's outputs and the residual stream, and recomputes the pointwise operators
in backward. :class:`Stack` says which, for
pricing such a run (``flexmesh.cost.training.parts.Parts.stack``, ``flexmesh plan --attention unfused
--no-sequence-parallel --dropout --fused-swiglu --recompute-pointwise``): the activation bytes then
follow Korthikanti et al., 2205.05198, section 4, and unfused attention is timed kernel by kernel
(:meth:`flexmesh.cost.training.analytic.AnalyticTiming.unfused_attention_times`).

>>> RUNTIME_STACK.label, Stack(attention="unfused", sequence_parallel=False, dropout=True).label
('flash2 attention, sequence parallel', 'unfused attention, no sequence parallelism, dropout')
"""

from __future__ import annotations

from dataclasses import dataclass

# "fused": the fastest fused (flash-style) attention each architecture has, as the measured kernel tables
# price it (FlashAttention-2 on Ampere and Ada, FlashAttention-3 on Hopper); "flash2": FlashAttention-2
# everywhere (flexmesh's runtime); "unfused": the softmax of the whole s x s scores kept for backward.
ATTENTION_KERNELS = ("fused", "flash2", "unfused")


@dataclass(frozen=True)
class Framework:
    """What a training stack spends above the device layer's kernels, where stacks differ: named per stack,
    each term with its source (docs/cost-model.md, "The device layer's kernels and the framework terms above it").

    ``gemm_share``: the share of the family's training GEMM rate (``DeviceSpec.mm_efficiency``, fitted on
    Megatron-class stacks) the stack's GEMMs reach in a step, fitted on the stack's published runs
    (``python -m flexmesh.cost.training.calibrate``); ``cross_entropy_bytes``: bytes the softmax and cross entropy move
    per logit, forward and backward together, counted from the kernels the stack runs.
    """

    name: str
    gemm_share: float = 1.0
    cross_entropy_bytes: float = 6.0
    source: str = ""
    # Whether the once-per-step gradient all-reduce runs under the last backward, bucket by bucket (PyTorch DDP,
    # FSDP, Megatron-Core's overlap_grad_reduce), or after it (DeepSpeed's pipeline engine, Megatron-LM v1's DDP)
    grad_sync_overlapped: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.gemm_share <= 1.5:
            raise ValueError(f"gemm_share must be in (0, 1.5], got {self.gemm_share}")
        if self.cross_entropy_bytes < 0:
            raise ValueError(f"cross_entropy_bytes must be >= 0, got {self.cross_entropy_bytes}")


# Megatron-LM's vocab-parallel cross entropy: read the bf16 logit, write the fp32 softmax (forward); read the
# softmax, write the bf16 gradient (backward). Megatron-LM, Transformer Engine and Llama 3's stack; the family fits
# (Megatron-LM 2104.04473 on A100, Llama 3 2407.21783 on H100) were made on such stacks, so their share is 1.
MEGATRON = Framework("megatron", source="the family fits' own stacks (flexmesh.cost.training.calibrate)")
# flexmesh's runtime: chunked linear cross entropy (flexmesh.runtime.model.loss), priced as Megatron-LM's; its H200
# steps were predicted within 3% at the H100 family's fit (bench/gpu.py).
FLEXMESH = Framework("flexmesh", source="bench/gpu.py on an H200 at the H100 family's fit")
# PyTorch's F.cross_entropy on bf16 logits under autocast (eager, as llm-foundry's MPT runs it): the fp32 upcast
# (read 2, write 4), log_softmax (read 4, write 4); backward the nll gradient (write 4), log_softmax's backward (read
# 4 + 4, write 4) and the downcast (read 4, write 2): 36 bytes per logit.
EAGER_CROSS_ENTROPY_BYTES = 36.0
# llm-foundry's MPT on Composer and PyTorch FSDP (FULL_SHARD, eager): its GEMM share fitted on llm-foundry's
# published throughputs at 2048 tokens on A100 and H100 against the family fits (calibrate.fit_share).
LLM_FOUNDRY = Framework("llm-foundry", gemm_share=0.888, cross_entropy_bytes=EAGER_CROSS_ENTROPY_BYTES,
                        source="mosaicml/llm-foundry scripts/train/benchmarking/README.md, bf16 tables at 2048 tokens")
# DeepSpeed's pipeline engine (PipelineModule, as Megatron-DeepSpeed and AMP's and Sailor's runs train): its
# TrainSchedule all-reduces the gradients after the last micro-batch's backward (deepspeed/runtime/pipe/schedule.py,
# ReduceGrads), not under it; its kernels are the layers' own (Megatron-LM's), priced at the family rate.
DEEPSPEED_PIPE = Framework("deepspeed-pipe", grad_sync_overlapped=False,
                           source="deepspeed/runtime/pipe/schedule.py: TrainSchedule, ReduceGrads after the backward")
FRAMEWORKS = {f.name: f for f in (FLEXMESH, MEGATRON, LLM_FOUNDRY, DEEPSPEED_PIPE)}


@dataclass(frozen=True)
class Stack:
    attention: str = "fused"  # one of ATTENTION_KERNELS
    sequence_parallel: bool = True  # with tp > 1: norms, dropouts and residuals split over the tp ranks
    dropout: bool = False  # hidden and attention dropout: a one-byte mask per element kept for backward
    # SwiGLU as one kernel that keeps the gate and up outputs and recomputes silu in backward (Megatron-LM's
    # bias_swiglu, Transformer Engine's LayerNormMLP): 3 x ffn elements kept per token, not 4
    fused_swiglu: bool = False
    # Norms, rotary and the MLP activation recomputed in backward from what the GEMMs keep anyway (torch.compile's
    # min-cut partitioner does so by default; Megatron-Core's recompute_modules name the norms, "layernorm", and
    # MoE activations, "moe_act"): per token the layer input and the mid-layer residual (the norms' inputs),
    # q, k, v, the attention output, and the MLP's up outputs (2 x ffn for SwiGLU), no GEMM input of its own
    pointwise_recompute: bool = False
    framework: Framework = FLEXMESH  # the time above the kernels (Framework)
    # Gradients reduced over the data-parallel ranks in fp32 whatever dtype they are kept in: 4 bytes a parameter
    # in the all-reduce (reduce-scatter) and its buffer. DeepSpeed's "fp32_allreduce", Megatron-LM's
    # --accumulate-allreduce-grads-in-fp32 on fp16 runs (bf16 runs keep fp32 gradients anyway: STATE_BYTES).
    fp32_grad_reduce: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_KERNELS)}, got {self.attention!r}")

    @property
    def fused(self) -> bool:
        """Flash-style attention: no ``s x s`` scores kept."""
        return self.attention != "unfused"

    @property
    def label(self) -> str:
        parts = [f"{self.attention} attention", "sequence parallel" if self.sequence_parallel
                 else "no sequence parallelism"]
        parts += (["dropout"] if self.dropout else []) + (["fused SwiGLU"] if self.fused_swiglu else [])
        parts += ["pointwise ops recomputed"] if self.pointwise_recompute else []
        parts += ["fp32 gradient reduction"] if self.fp32_grad_reduce else []
        parts += [f"{self.framework.name} framework"] if self.framework.name not in ("megatron", "flexmesh") else []
        return ", ".join(parts)


RUNTIME_STACK = Stack(attention="flash2")
