"""Fits of the cost model's few fitted constants to a named fitting set, and leave-one-out errors.

Run ``python -m flexmesh.cost.training.calibrate`` to redo every fit, print it beside the preset values, and
print each fitting row's published throughput next to its in-sample prediction and its
leave-one-out prediction (refit without the row, predict it).

The fitting set (nothing else is fitted to):

- Megatron-LM, 2104.04473, Table 1 (A100, nine runs of 1.7B to 1T parameters): the A100
  ``mm_efficiency`` (largest-GEMM fraction of peak, :mod:`flexmesh.cost.device.kernels`), by least squares
  on log step time. Those 2021 runs' layers are priced as Megatron-LM ran them then
  (:data:`MEGATRON_2021`: unfused attention, tensor parallelism without sequence parallelism,
  dropout), the unfused attention kernel by kernel with no constant of its own.
- Llama 3, 2407.21783, Table 4 (H100, three runs of 405B, one with context parallelism 16 at 131K
  tokens): the H100 ``mm_efficiency``.
- FlexSP, 2412.01523: ``attn_efficiency`` from the quadratic coefficient of a 7B model on A100
  (per-micro-batch time ``a * s^2 + b * s``, ``a = 5.1e-6 ms/token^2``); the all-to-all
  efficiencies from its measured all-to-all bandwidth on A100 nodes with 400 Gb/s InfiniBand per
  node (GB/s by group size 2: 119, 4: 104, 8: 96, 16: 10.3, 32: 5.9, 64: 4.9).

Kept out of it for evaluation (never fitted to): the Megatron-LM repository's H100 scaling table,
Korthikanti et al. 2205.05198, MT-NLG 2201.11990, BLOOM 2211.05100, torchtitan's and llm-foundry's
published figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
from scipy.optimize import minimize_scalar

from flexmesh.cost.device.hardware import Hardware, group_shape
from flexmesh.cost.training.analytic import AnalyticTiming
from flexmesh.cost.training.evaluation import Evaluation
from flexmesh.cost.training.model import CostModel
from flexmesh.cost.training.parts import Parts
from flexmesh.layout.enums import CPKind
from flexmesh.layout.stack import LLM_FOUNDRY, MEGATRON, Framework, Stack
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.cluster import DEVICE_PRESETS, GEMM_TABLES, ClusterSpec, catalogue_efficiency
from flexmesh.spec.model import MODEL_PRESETS, ModelSpec, gpt


@dataclass(frozen=True)
class PublishedRun:
    """A published training run: model, cluster, layout and the throughput its authors report."""

    name: str
    source: str
    model: ModelSpec
    device: str
    gpus: int
    tp: int
    pp: int
    global_batch: int  # sequences
    seq_len: int
    tflops_per_gpu: float  # as published
    recompute: bool
    zero: int = 0
    cp: int = 1
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    # "unfused": Megatron-LM's 2021 layers (MEGATRON_2021: attention as separate kernels over the whole
    # s x s scores, no sequence parallelism, dropout); "fused": flash-style kernels, the fastest each
    # architecture has (FUSED_STACK: the measured tables' kernels, FlashAttention-3-class on Hopper, as
    # Transformer Engine and cuDNN run them; which kernel each published run used is not published).
    attention: str = "fused"
    # How the authors counted FLOPs: "megatron" = 96 B s l h^2 (1 + s/6h + V/16lh), which includes
    # the recomputed forward and non-causal attention; "model" = flexmesh's ModelSpec.model_flops.
    flops: str = "megatron"
    # Context-parallel attention balanced over the ranks (2 x cp chunks paired), as Llama 3's is.
    cp_balanced: bool = False
    # The first chunk holds only the embedding and the last only the head (Llama 3's pipeline).
    end_chunks: bool = False
    # The stack keeps no more than the GEMMs' and attention's outputs and the residual stream, recomputing the
    # pointwise operators in backward (Stack.pointwise_recompute; fused attention only).
    pointwise_recompute: bool = False
    # What the stack spends above the kernels (flexmesh.layout.stack.Framework): Megatron-class stacks for the
    # family fits' rows, LLM_FOUNDRY for llm-foundry's.
    framework: Framework = MEGATRON
    micro_batch: int = 1  # sequences per micro-batch on each data-parallel replica
    # Throughput as published (tokens per second per GPU), where the source gives it rather than FLOP/s
    tokens_per_gpu_s: float | None = None
    table: str = ""  # the source's table, where it has several (leave-one-table-out)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    def published_step_time(self) -> float:
        m, B, s = self.model, self.global_batch, self.seq_len
        if self.tokens_per_gpu_s is not None:
            return B * s / (self.gpus * self.tokens_per_gpu_s)
        if self.flops == "megatron":
            h, L, V = m.hidden, m.num_layers, m.vocab
            total = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
        else:
            total = m.model_flops(B * s, B * float(s) ** 2)
        return total / (self.gpus * self.tflops_per_gpu * 1e12)

    def published_tokens_per_gpu(self) -> float:
        return self.global_batch * self.seq_len / self.published_step_time() / self.gpus

    @property
    def family(self) -> str:
        return "A100" if self.device.startswith("A100") else "H100"

    def cluster(self, device=None) -> ClusterSpec:
        dev = device or DEVICE_PRESETS[self.device]
        return ClusterSpec(nodes=self.gpus // 8, devices_per_node=8, device=dev)

    @property
    def stack(self) -> Stack:
        """How the run's stack runs a layer and what it spends above the kernels."""
        if self.attention == "unfused":
            return MEGATRON_2021
        return Stack(attention=self.attention, pointwise_recompute=self.pointwise_recompute, framework=self.framework)

    def cost_model(self, params: dict[str, float] | None = None) -> CostModel:
        """The cost model of this run's hardware and stack: the presets, with the fitted ``mm_efficiency``
        (the family's) and ``gemm_share`` (the run's framework's) replaced by ``params``'s where given."""
        p = params or {}
        dev = DEVICE_PRESETS[self.device]
        if "mm_efficiency" in p:
            dev = replace(dev, mm_efficiency=p["mm_efficiency"])
        hw = Hardware(self.cluster(dev), self.model.dtype)
        stack = self.stack
        if "gemm_share" in p and stack.framework.gemm_share != p["gemm_share"]:
            stack = replace(stack, framework=replace(stack.framework, gemm_share=p["gemm_share"]))
        return CostModel(self.model, hw.cluster, hw, AnalyticTiming(self.model, hw, self.cp_balanced, stack),
                         parts=Parts(stack=stack))

    def strategy(self) -> LayerStrategy:
        kind = CPKind.RING if self.cp > 1 else CPKind.NONE
        return LayerStrategy(tp=self.tp, cp=self.cp, cp_kind=kind, dp=self.dp, zero=self.zero,
                             recompute=self.recompute)

    def predict(self, params: dict[str, float] | None = None) -> Evaluation:
        """The cost model's prediction for this run's layout (one micro-batch = one sequence per replica)."""
        s = self.strategy()
        ends = 2 if self.end_chunks else 0
        L, n = self.model.num_layers, self.pp * self.virtual_stages - ends
        chunks = [[s] * (L // n + (1 if i < L % n else 0)) for i in range(n)]
        chunks = [[], *chunks, []] if ends else chunks
        m = self.global_batch // (self.dp * self.micro_batch)
        return self.cost_model(params).evaluate_stages(chunks, self.pp, self.pipeline_schedule, m,
                                                       self.virtual_stages, self.dp * self.micro_batch, self.seq_len)

    def log_error(self, params: dict[str, float] | None = None) -> float:
        """log(predicted / published) step time."""
        return math.log(self.predict(params).step_time / self.published_step_time())


# Megatron-LM's layers in 2021 (2104.04473): unfused attention (flash attention came in 2022), tensor
# parallelism without sequence parallelism (2205.05198 came later), GPT's hidden and attention dropout.
MEGATRON_2021 = Stack(attention="unfused", sequence_parallel=False, dropout=True, framework=MEGATRON)
FUSED_STACK = Stack(attention="fused", framework=MEGATRON)
_MEGATRON = "Narayanan et al., Megatron-LM, 2104.04473, Table 1 (A100 SXM 80GB, seq 2048, vocab 51200)"
# Llama 3's pipeline (2407.21783, section 3.3.2): one transformer layer fewer on the first and the last
# stage, so that "the first model chunk on the first stage has only the embedding, and the last model
# chunk on the last stage has only output projection and loss": chunks of one layer, (126 + 2) / 16 = 8
# per pipeline rank. Not published: N, the micro-batches a chunk runs in a row (priced as Megatron's
# interleaved schedule, N = pp). Its layers ran at 8K "without activation checkpointing" once Meta's stack
# "proactively deallocate[d] tensors that will not be used for future computation"; what a layer keeps is
# not published: priced as the least a layer keeps without recomputing a GEMM or attention (the pointwise
# operators recomputed, as torch.compile's partitioner does: Stack.pointwise_recompute), which fits
# (tests/test_memory_model.py); keeping every intermediate tensor, as an eager layer does, would not.
V_LLAMA3 = 8
_LLAMA3 = "Llama 3 herd of models, 2407.21783, Table 4 (H100 SXM, bf16 MFU)"
# Llama 3.1 405B shape from its published config.json.
_LLAMA3_405B = ModelSpec(name="llama3.1-405b", num_layers=126, hidden=16384, num_heads=128, num_kv_heads=8,
                         ffn_hidden=53248, vocab=128256, max_position=131072, rope_theta=500000.0)

PUBLISHED_RUNS: tuple[PublishedRun, ...] = tuple(
    PublishedRun(f"gpt-{p}", _MEGATRON, gpt(L, h, a, 51200, name=f"gpt-{p}"), "A100-80GB", n, tp, pp, B, 2048, tf,
                 recompute=True, attention="unfused")
    for p, a, h, L, tp, pp, n, B, tf in (
        ("1.7b", 24, 2304, 24, 1, 1, 32, 512, 137),
        ("3.6b", 32, 3072, 30, 2, 1, 64, 512, 138),
        ("7.5b", 32, 4096, 36, 4, 1, 128, 512, 142),
        ("18.4b", 48, 6144, 40, 8, 1, 256, 1024, 135),
        ("39.1b", 64, 8192, 48, 8, 2, 512, 1536, 138),
        ("76.1b", 80, 10240, 60, 8, 4, 1024, 1792, 140),
        ("145.6b", 96, 12288, 80, 8, 8, 1536, 2304, 148),
        ("310.1b", 128, 16384, 96, 8, 16, 1920, 2160, 155),
        ("1008b", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    )
) + (
    PublishedRun("llama3-405b-8k", _LLAMA3, _LLAMA3_405B, "H100-80GB", 8192, 8, 16, 2048, 8192, 430,
                 recompute=False, zero=1, flops="model", pipeline_schedule="interleaved", virtual_stages=V_LLAMA3,
                 end_chunks=True, pointwise_recompute=True),
    PublishedRun("llama3-405b-16k", _LLAMA3, _LLAMA3_405B, "H100-80GB", 16384, 8, 16, 2048, 8192, 400,
                 recompute=False, zero=1, flops="model", pipeline_schedule="interleaved", virtual_stages=V_LLAMA3,
                 end_chunks=True, pointwise_recompute=True),
    # 16M tokens per batch of 131,072-token sequences (128 sequences); CP 16, load-balanced (all-gather
    # based in the paper; priced as a balanced ring).
    PublishedRun("llama3-405b-131k-cp16", _LLAMA3, _LLAMA3_405B, "H100-80GB", 16384, 8, 16, 128, 131072, 380,
                 recompute=False, zero=1, cp=16, flops="model", pipeline_schedule="interleaved",
                 virtual_stages=V_LLAMA3, cp_balanced=True, end_chunks=True, pointwise_recompute=True),
)

# llm-foundry's published throughputs (the second source of each family): MPT models trained by Composer on PyTorch
# FSDP (FULL_SHARD, bf16, eager), every row at 2048 tokens of the bf16 tables of A100 80GB and H100 80GB, as
# (model, GPUs, micro-batch, gradient accumulation, global batch, activation checkpointing, tokens/s per GPU).
# MPT's shapes from llm-foundry's scripts/train/yamls/pretrain/mpt-*.yaml (d_model, n_layers, n_heads; vocabulary
# 50368, expansion ratio 4, no biases, learned positions), which the tables' parameter counts reproduce. Their
# attention (attn_impl: triton) is FlashAttention's Triton kernel, FlashAttention-2's algorithm without Hopper's
# instructions: priced as FlashAttention-2 (flexmesh.cost.device.flash2).
_LLM_FOUNDRY = "llm-foundry, scripts/train/benchmarking/README.md (mosaicml/llm-foundry)"
_MPT = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12), "1b": (24, 2048, 16),
        "3b": (32, 2560, 20), "7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 56), "70b": (80, 8192, 64)}
_LLM_FOUNDRY_TABLES = {
    ("H100-80GB", "H100 80GB BF16"): (
        ("70b", 64, 8, 4, 2048, True, 1039), ("70b", 32, 2, 16, 1024, True, 882), ("30b", 32, 14, 3, 1344, True, 2308),
        ("30b", 16, 10, 3, 480, True, 2263), ("30b", 8, 3, 21, 504, True, 2002), ("13b", 64, 2, 1, 128, False, 4800),
        ("13b", 32, 2, 1, 64, False, 4811), ("13b", 16, 2, 1, 32, False, 4767), ("13b", 8, 2, 1, 16, False, 4792),
        ("7b", 8, 6, 1, 48, False, 10643), ("3b", 64, 6, 3, 1152, False, 22525), ("3b", 32, 6, 3, 576, False, 23021),
        ("3b", 16, 10, 3, 480, False, 24142), ("1b", 64, 20, 1, 1280, False, 44402),
        ("1b", 32, 20, 1, 640, False, 45130), ("1b", 16, 20, 1, 320, False, 46037), ("1b", 8, 14, 1, 112, False, 45455),
        ("760m", 32, 24, 1, 768, False, 67971), ("760m", 16, 24, 1, 384, False, 68551),
        ("760m", 8, 24, 2, 384, False, 63147)),
    ("A100-80GB", "A100 80GB with 1600 Gbps node-node interconnect (RoCE)"): (
        ("70b", 64, 8, 4, 2048, True, 410), ("70b", 32, 2, 16, 1024, True, 373), ("30b", 8, 3, 21, 504, True, 916),
        ("13b", 8, 2, 3, 48, False, 2262), ("7b", 8, 6, 2, 96, False, 4641), ("3b", 8, 10, 2, 160, False, 10811),
        ("1b", 8, 14, 4, 448, False, 20513), ("760m", 8, 24, 2, 384, False, 32434),
        ("350m", 8, 32, 2, 512, False, 58782), ("125m", 8, 40, 2, 640, False, 142830),
        ("125m", 8, 32, 2, 512, False, 141737)),
}


def _mpt(size: str) -> ModelSpec:
    layers, hidden, heads = _MPT[size]
    return replace(gpt(layers, hidden, heads, 50368, name=f"mpt-{size}"), linear_bias=False)


PUBLISHED_RUNS += tuple(
    PublishedRun(f"mpt-{size}-{gpus}x{device.split('-')[0]}-mb{mb}", _LLM_FOUNDRY, _mpt(size), device, gpus, 1, 1,
                 batch, 2048, 0.0, recompute=ckpt, zero=3, attention="flash2", flops="model", framework=LLM_FOUNDRY,
                 micro_batch=mb, tokens_per_gpu_s=tps, table=table)
    for (device, table), rows in _LLM_FOUNDRY_TABLES.items()
    for size, gpus, mb, accumulation, batch, ckpt, tps in rows
)

# FlexSP (2412.01523): all-to-all bandwidth on A100 nodes by group size, GB/s (400 Gb/s IB per node).
FLEXSP_A2A_GBPS = {2: 119.0, 4: 104.0, 8: 96.0, 16: 10.3, 32: 5.9, 64: 4.9}
FLEXSP_NODE_NET_GBPS = 50.0  # 400 Gb/s
# FlexSP (2412.01523): 7B model on A100-40GB, per-micro-batch attention coefficient, s / token^2.
FLEXSP_7B_A_S_PER_SQ_TOKEN = 5.1e-9


# The measured GEMM table of each family's fitted part (presets/devices.toml [gemm_tables]).
_FAMILY_TABLE = {"A100": "a100_sxm", "H100": "h100_sxm"}

# The constants fitted on the published runs, with their bounds: each family's mm_efficiency (on its
# Megatron-class rows) and each other framework's gemm_share (on its rows, at the family fits).
BOUNDS = {"mm_efficiency": (0.3, 0.98), "gemm_share": (0.5, 1.2)}
FAMILIES = ("A100", "H100")

R = TypeVar("R")


def fitting_rows(family: str) -> list[PublishedRun]:
    """The fitting set's published runs on ``family`` GPUs (A100 or H100)."""
    return [r for r in PUBLISHED_RUNS if r.family == family]


def _fit_one(runs: Sequence[PublishedRun], name: str, params: Callable[[PublishedRun, float], dict[str, float]]) \
        -> float:
    """Least squares on log(predicted / published) step time over ``runs`` in one constant, ``params(run, x)``
    the run's constants at ``x``."""
    lo, hi = BOUNDS[name]
    res = minimize_scalar(lambda x: sum(r.log_error(params(r, x)) ** 2 for r in runs), bounds=(lo, hi),
                          method="bounded", options={"xatol": 1e-5})
    return float(res.x)


def _reference(run: PublishedRun) -> bool:
    """A row of the stacks the family fits are made on (gemm_share 1 by definition)."""
    return run.framework.name == MEGATRON.name


def fit_constants(runs: Sequence[PublishedRun]) -> dict[str, float]:
    """Every constant the published runs fit, from ``runs`` alone: each family's ``mm_efficiency`` (keys "A100",
    "H100") and each other framework's ``gemm_share`` (keyed by its name).

    1. a family's mm_efficiency on its Megatron-class rows;
    2. a framework's share on its rows of the families step 1 fitted;
    3. a family without Megatron-class rows: its mm_efficiency on its other frameworks' rows at their shares;
    4. a family with neither: the other family's fit scaled by the two parts' measured GEMM tables (as the catalogue
       prices a part without a fit, :func:`flexmesh.spec.cluster.catalogue_efficiency`).

    A framework none of ``runs`` shows is priced as the reference stacks (share 1): an unseen stack."""
    out: dict[str, float] = {}
    for family in FAMILIES:
        ref = [r for r in runs if r.family == family and _reference(r)]
        if ref:
            out[family] = _fit_one(ref, "mm_efficiency", lambda r, x: {"mm_efficiency": x})
    for name in sorted({r.framework.name for r in runs if not _reference(r)}):
        rows = [r for r in runs if r.framework.name == name and r.family in out]
        if rows:
            out[name] = _fit_one(rows, "gemm_share", lambda r, x: {"mm_efficiency": out[r.family], "gemm_share": x})
    for family in FAMILIES:
        rows = [r for r in runs if r.family == family and not _reference(r) and r.framework.name in out]
        if family not in out and rows:
            out[family] = _fit_one(rows, "mm_efficiency",
                                   lambda r, x: {"mm_efficiency": x, "gemm_share": out[r.framework.name]})
    for family in FAMILIES:
        other = OTHER_FAMILY[family]
        if family not in out and other in out:
            out[family] = catalogue_efficiency(out[other], GEMM_TABLES[_FAMILY_TABLE[family]],
                                               GEMM_TABLES[_FAMILY_TABLE[other]])
    return out


def run_params(run: PublishedRun, constants: dict[str, float]) -> dict[str, float]:
    """``run``'s constants from :func:`fit_constants`' (an unseen framework at share 1)."""
    p = {"mm_efficiency": constants[run.family]}
    if not _reference(run):
        p["gemm_share"] = constants.get(run.framework.name, 1.0)
    return p


def fit_efficiencies(family: str) -> dict[str, float]:
    """The fitted ``mm_efficiency`` of ``family`` on its Megatron-class fitting rows."""
    return {"mm_efficiency": fit_constants(PUBLISHED_RUNS)[family]}


def fit_share(name: str = LLM_FOUNDRY.name) -> float:
    """The ``gemm_share`` of framework ``name`` on its published rows at the family fits."""
    return fit_constants(PUBLISHED_RUNS)[name]


def leave_one_out(rows: Sequence[R], fit: Callable[[list[R]], dict[str, float]],
                  error: Callable[[R, dict[str, float]], float]) -> list[float]:
    """Per row, ``error(row, fit(every other row))``: how well a fit predicts a row it never saw.

    >>> rows = [(1.0, 2.0), (2.0, 4.0), (3.0, 9.0)]  # y = c x, fitted as the mean of y / x
    >>> fit = lambda rs: {"c": sum(y / x for x, y in rs) / len(rs)}
    >>> [round(e, 3) for e in leave_one_out(rows, fit, lambda r, p: p["c"] * r[0] / r[1] - 1)]
    [0.25, 0.25, -0.333]
    """
    return [error(row, fit([r for j, r in enumerate(rows) if j != i])) for i, row in enumerate(rows)]


def _ratio(run: PublishedRun, params: dict[str, float] | None) -> float:
    """Predicted / published tokens per second (1 / the step-time ratio)."""
    return math.exp(-run.log_error(params))


def _held_out_ratios(runs: Sequence[PublishedRun], same: Callable[[PublishedRun, PublishedRun], bool]) -> list[float]:
    """Per run: predicted / published throughput with every constant fitted on the runs ``same`` does not pair
    with it."""
    fits: dict[tuple, dict[str, float]] = {}
    out = []
    for run in runs:
        kept = tuple(i for i, r in enumerate(PUBLISHED_RUNS) if not same(run, r))
        if kept not in fits:
            fits[kept] = fit_constants([PUBLISHED_RUNS[i] for i in kept])
        out.append(_ratio(run, run_params(run, fits[kept])))
    return out


def leave_one_out_ratios(family: str) -> list[float]:
    """Per fitting row of ``family``: predicted / published throughput, with the constants refitted
    without that row."""
    return _held_out_ratios(fitting_rows(family), lambda run, r: r is run)


# The other family whose source predicts a family's rows when its own sources are left out.
OTHER_FAMILY = {"A100": "H100", "H100": "A100"}


def transferred_params(family: str) -> dict[str, float]:
    """The fitted constants of ``family`` without any row of its own: the other family's fitted
    ``mm_efficiency`` scaled by the two parts' measured GEMM tables (as the catalogue scales a part
    without a fit, :func:`flexmesh.spec.cluster.catalogue_efficiency`)."""
    return {"mm_efficiency": fit_constants([r for r in PUBLISHED_RUNS if r.family != family])[family]}


def leave_one_source_out_ratios(family: str) -> list[float]:
    """Per fitting row of ``family``: predicted / published throughput with no row of the row's source (its
    publication, every table of it) in any fit: the family's other source fits what it can (:func:`fit_constants`)."""
    return _held_out_ratios(fitting_rows(family), lambda run, r: r.source == run.source)


def leave_one_table_out_ratios(family: str) -> list[float]:
    """As :func:`leave_one_source_out_ratios` leaving out only the row's table: a source measured on both families
    (llm-foundry) predicts one family's table from the other's through the device layer."""
    return _held_out_ratios(fitting_rows(family), lambda run, r: r.source == run.source and r.table == run.table)


def fit_attn_efficiency() -> float:
    """Attention efficiency on A100 from FlexSP's quadratic coefficient for a 7B model."""
    model = MODEL_PRESETS["llama2-7b"]
    flops_per_sq = 3 * model.num_layers * model.layer_attn_flops_per_sq_token
    return flops_per_sq / FLEXSP_7B_A_S_PER_SQ_TOKEN / DEVICE_PRESETS["A100-40GB"].peak_flops("bf16")


def fit_a2a_efficiency() -> tuple[float, float]:
    """(intra, inter) all-to-all efficiencies reproducing FlexSP's measured bandwidths."""
    base = DEVICE_PRESETS["A100-40GB"]
    nbytes = 2**28

    def bandwidths(intra: float, inter: float) -> dict[int, float]:
        dev = replace(base, a2a_intra_efficiency=intra, a2a_inter_efficiency=inter, node_net_gbps=FLEXSP_NODE_NET_GBPS,
                      intra_latency_us=0.0, inter_latency_us=0.0)
        hw = Hardware(ClusterSpec(nodes=8, devices_per_node=8, device=dev))
        return {n: nbytes / hw.collective_time("all_to_all", nbytes, group_shape(n, 1, hw.cluster)) / 1e9
                for n in FLEXSP_A2A_GBPS}

    # Each efficiency scales its own regime's bandwidth linearly: fit each in log space.
    unit = bandwidths(1.0, 1.0)
    intra = [math.log(FLEXSP_A2A_GBPS[n] / unit[n]) for n in FLEXSP_A2A_GBPS if n <= 8]
    inter = [math.log(FLEXSP_A2A_GBPS[n] / unit[n]) for n in FLEXSP_A2A_GBPS if n > 8]
    return math.exp(float(np.mean(intra))), math.exp(float(np.mean(inter)))


def calibration_table(with_loo: bool = True) -> list[dict]:
    """Each fitting row: published and predicted tokens/s per GPU with the presets (in sample), the
    ratio, and with ``with_loo`` the leave-one-out ratio (constants refitted without the row) and the
    leave-one-source-out ratio (no constant fitted to the row's source)."""
    rows = []
    for family in ("A100", "H100"):
        runs = fitting_rows(family)
        nan = [float("nan")] * len(runs)
        loo = leave_one_out_ratios(family) if with_loo else nan
        loso = leave_one_source_out_ratios(family) if with_loo else nan
        loto = leave_one_table_out_ratios(family) if with_loo else nan
        for r, lo, so, to in zip(runs, loo, loso, loto, strict=True):
            ratio = _ratio(r, None)
            pub = r.published_tokens_per_gpu()
            cp = f" cp{r.cp}" if r.cp > 1 else ""
            rows.append({"run": r.name, "device": r.device, "family": family,
                         "layout": f"tp{r.tp}{cp} pp{r.pp} dp{r.dp}", "published_tokens_per_gpu": pub,
                         "predicted_tokens_per_gpu": pub * ratio, "ratio": ratio, "loo_ratio": lo, "loso_ratio": so,
                         "loto_ratio": to, "source": r.source, "framework": r.framework.name})
    return rows


def error_summary(rows: list[dict], key: str, framework: str | None = None) -> dict[str, tuple[float, float]]:
    """Per family: (median, worst) of ``|row[key] - 1|`` (over ``framework``'s rows alone where given)."""
    out = {}
    for family in FAMILIES:
        errs = [abs(r[key] - 1.0) for r in rows if r["family"] == family and framework in (None, r["framework"])]
        out[family] = (float(np.median(errs)), float(max(errs)))
    return out


def main() -> None:
    from rich.table import Table

    from flexmesh.console import plain_console

    con = plain_console()
    fits = Table(title="Fitted constants (redo of the preset values) and their fitting rows")
    for c in ("constant", "fit", "preset", "fitted on"):
        fits.add_column(c)
    intra, inter = fit_a2a_efficiency()
    a100, h100 = DEVICE_PRESETS["A100-80GB"], DEVICE_PRESETS["H100-80GB"]
    fit = fit_constants(PUBLISHED_RUNS)
    fits.add_row("A100 mm_efficiency", f"{fit['A100']:.3f}", f"{a100.mm_efficiency:.3f}", _MEGATRON)
    fits.add_row("H100 mm_efficiency", f"{fit['H100']:.3f}", f"{h100.mm_efficiency:.3f}", _LLAMA3)
    fits.add_row("llm-foundry gemm_share", f"{fit[LLM_FOUNDRY.name]:.3f}", f"{LLM_FOUNDRY.gemm_share:.3f}",
                 _LLM_FOUNDRY)
    fits.add_row("attn_efficiency", f"{fit_attn_efficiency():.3f}", f"{a100.attn_efficiency:.3f}", "FlexSP 7B profile")
    fits.add_row("a2a_intra_efficiency", f"{intra:.3f}", f"{a100.a2a_intra_efficiency:.3f}", "FlexSP all-to-all")
    fits.add_row("a2a_inter_efficiency", f"{inter:.3f}", f"{a100.a2a_inter_efficiency:.3f}", "FlexSP all-to-all")
    con.print(fits)
    rows = calibration_table()
    runs = Table(title="Fitting rows: per-GPU throughput, predicted / published in sample, leave-one-out and "
                       "leave-one-source-out")
    for c in ("run", "device", "layout", "published tok/s/GPU", "predicted", "in-sample", "leave-one-out",
              "leave-one-source-out", "leave-one-table-out"):
        runs.add_column(c, justify="right" if c not in ("run", "device", "layout") else "left")
    for row in rows:
        runs.add_row(row["run"], row["device"], row["layout"], f"{row['published_tokens_per_gpu']:.0f}",
                     f"{row['predicted_tokens_per_gpu']:.0f}", f"{row['ratio']:.3f}", f"{row['loo_ratio']:.3f}",
                     f"{row['loso_ratio']:.3f}", f"{row['loto_ratio']:.3f}")
    con.print(runs)
    for key, what in HELD_OUT:
        for framework in (None, MEGATRON.name, LLM_FOUNDRY.name):
            summary = error_summary(rows, key, framework)
            con.print(f"{what}{'' if framework is None else f' ({framework} rows)'}: "
                      + ", ".join(f"{f} median {m:.1%} worst {w:.1%}" for f, (m, w) in summary.items()))


# The error columns of calibration_table and what each holds out.
HELD_OUT = (("ratio", "in sample"), ("loo_ratio", "leave-one-out"), ("loso_ratio", "leave-one-source-out"),
            ("loto_ratio", "leave-one-table-out"))


if __name__ == "__main__":
    main()
