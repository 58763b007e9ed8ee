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
from flexmesh.layout.stack import Stack
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

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    def published_step_time(self) -> float:
        m, B, s = self.model, self.global_batch, self.seq_len
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

    def cost_model(self, params: dict[str, float] | None = None) -> CostModel:
        """The cost model of this run's hardware and stack: the presets, with the fitted ``mm_efficiency``
        replaced by ``params``'s where given."""
        p = params or {}
        dev = DEVICE_PRESETS[self.device]
        if "mm_efficiency" in p:
            dev = replace(dev, mm_efficiency=p["mm_efficiency"])
        hw = Hardware(self.cluster(dev), self.model.dtype)
        stack = MEGATRON_2021 if self.attention == "unfused" else \
            replace(FUSED_STACK, pointwise_recompute=self.pointwise_recompute)
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
        m = self.global_batch // self.dp
        return self.cost_model(params).evaluate_stages(chunks, self.pp, self.pipeline_schedule, m,
                                                       self.virtual_stages, self.dp, self.seq_len)

    def log_error(self, params: dict[str, float] | None = None) -> float:
        """log(predicted / published) step time."""
        return math.log(self.predict(params).step_time / self.published_step_time())


# Megatron-LM's layers in 2021 (2104.04473): unfused attention (flash attention came in 2022), tensor
# parallelism without sequence parallelism (2205.05198 came later), GPT's hidden and attention dropout.
MEGATRON_2021 = Stack(attention="unfused", sequence_parallel=False, dropout=True)
FUSED_STACK = Stack(attention="fused")
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


# FlexSP (2412.01523): all-to-all bandwidth on A100 nodes by group size, GB/s (400 Gb/s IB per node).
FLEXSP_A2A_GBPS = {2: 119.0, 4: 104.0, 8: 96.0, 16: 10.3, 32: 5.9, 64: 4.9}
FLEXSP_NODE_NET_GBPS = 50.0  # 400 Gb/s
# FlexSP (2412.01523): 7B model on A100-40GB, per-micro-batch attention coefficient, s / token^2.
FLEXSP_7B_A_S_PER_SQ_TOKEN = 5.1e-9


# The measured GEMM table of each family's fitted part (presets/devices.toml [gemm_tables]).
_FAMILY_TABLE = {"A100": "a100_sxm", "H100": "h100_sxm"}

# The constants fitted per GPU family on its fitting rows, with their bounds.
FITTED = {"A100": ("mm_efficiency",), "H100": ("mm_efficiency",)}
BOUNDS = {"mm_efficiency": (0.3, 0.98)}

R = TypeVar("R")


def fitting_rows(family: str) -> list[PublishedRun]:
    """The fitting set's published runs on ``family`` GPUs (A100 or H100)."""
    return [r for r in PUBLISHED_RUNS if r.family == family]


def fit_runs(runs: Sequence[PublishedRun], names: Sequence[str]) -> dict[str, float]:
    """Least squares on log(predicted / published) step time over ``runs``, in the one constant of
    ``names`` (the others keep their preset values)."""
    (name,) = names
    lo, hi = BOUNDS[name]
    res = minimize_scalar(lambda e: sum(r.log_error({name: e}) ** 2 for r in runs), bounds=(lo, hi),
                          method="bounded", options={"xatol": 1e-5})
    return {name: float(res.x)}


def fit_efficiencies(family: str) -> dict[str, float]:
    """The fitted constants of ``family`` (:data:`FITTED`) on its fitting rows."""
    return fit_runs(fitting_rows(family), FITTED[family])


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


def leave_one_out_ratios(family: str) -> list[float]:
    """Per fitting row of ``family``: predicted / published throughput, with the constants refitted
    without that row."""
    names = FITTED[family]
    return [1.0 + e for e in leave_one_out(fitting_rows(family), lambda rs: fit_runs(rs, names),
                                           lambda r, p: _ratio(r, p) - 1.0)]


# The other family whose source predicts a family's rows when its own source is left out.
OTHER_FAMILY = {"A100": "H100", "H100": "A100"}


def transferred_params(family: str) -> dict[str, float]:
    """The fitted constants of ``family`` without its own source: the other family's fitted
    ``mm_efficiency`` scaled by the two parts' measured GEMM tables (as the catalogue scales a part
    without a fit, :func:`flexmesh.spec.cluster.catalogue_efficiency`)."""
    other = OTHER_FAMILY[family]
    own_table = _FAMILY_TABLE[family]
    mm = catalogue_efficiency(fit_efficiencies(other)["mm_efficiency"], GEMM_TABLES[own_table],
                              GEMM_TABLES[_FAMILY_TABLE[other]])
    return {"mm_efficiency": mm}


def leave_one_source_out_ratios(family: str) -> list[float]:
    """Per fitting row of ``family``: predicted / published throughput with none of the row's source
    in any fit (:func:`transferred_params`). Each family here has one source, so leaving out the row's
    source leaves out the family's whole fitting set."""
    p = transferred_params(family)
    return [_ratio(r, p) for r in fitting_rows(family)]


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
        loo = leave_one_out_ratios(family) if with_loo else [float("nan")] * len(runs)
        loso = leave_one_source_out_ratios(family) if with_loo else [float("nan")] * len(runs)
        for r, lo, so in zip(runs, loo, loso, strict=True):
            ratio = _ratio(r, None)
            pub = r.published_tokens_per_gpu()
            cp = f" cp{r.cp}" if r.cp > 1 else ""
            rows.append({"run": r.name, "device": r.device, "family": family,
                         "layout": f"tp{r.tp}{cp} pp{r.pp} dp{r.dp}", "published_tokens_per_gpu": pub,
                         "predicted_tokens_per_gpu": pub * ratio, "ratio": ratio, "loo_ratio": lo, "loso_ratio": so,
                         "source": r.source})
    return rows


def error_summary(rows: list[dict], key: str) -> dict[str, tuple[float, float]]:
    """Per family: (median, worst) of ``|row[key] - 1|``."""
    out = {}
    for family in ("A100", "H100"):
        errs = [abs(r[key] - 1.0) for r in rows if r["family"] == family]
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
    fa, fh = fit_efficiencies("A100"), fit_efficiencies("H100")
    fits.add_row("A100 mm_efficiency", f"{fa['mm_efficiency']:.3f}", f"{a100.mm_efficiency:.3f}", _MEGATRON)
    fits.add_row("H100 mm_efficiency", f"{fh['mm_efficiency']:.3f}", f"{h100.mm_efficiency:.3f}", _LLAMA3)
    fits.add_row("attn_efficiency", f"{fit_attn_efficiency():.3f}", f"{a100.attn_efficiency:.3f}", "FlexSP 7B profile")
    fits.add_row("a2a_intra_efficiency", f"{intra:.3f}", f"{a100.a2a_intra_efficiency:.3f}", "FlexSP all-to-all")
    fits.add_row("a2a_inter_efficiency", f"{inter:.3f}", f"{a100.a2a_inter_efficiency:.3f}", "FlexSP all-to-all")
    con.print(fits)
    rows = calibration_table()
    runs = Table(title="Fitting rows: per-GPU throughput, predicted / published in sample, leave-one-out and "
                       "leave-one-source-out")
    for c in ("run", "device", "layout", "published tok/s/GPU", "predicted", "in-sample", "leave-one-out",
              "leave-one-source-out"):
        runs.add_column(c, justify="right" if c not in ("run", "device", "layout") else "left")
    for row in rows:
        runs.add_row(row["run"], row["device"], row["layout"], f"{row['published_tokens_per_gpu']:.0f}",
                     f"{row['predicted_tokens_per_gpu']:.0f}", f"{row['ratio']:.3f}", f"{row['loo_ratio']:.3f}",
                     f"{row['loso_ratio']:.3f}")
    con.print(runs)
    for family in ("A100", "H100"):
        p = transferred_params(family)
        con.print(f"leave-one-source-out {family}: " + ", ".join(f"{k} {v:.3f}" for k, v in p.items())
                  + f" (from the {OTHER_FAMILY[family]} fit and the measured GEMM tables)")
    for key, what in (("ratio", "in sample"), ("loo_ratio", "leave-one-out"), ("loso_ratio", "leave-one-source-out")):
        summary = error_summary(rows, key)
        con.print(f"{what}: " + ", ".join(f"{f} median {m:.1%} worst {w:.1%}" for f, (m, w) in summary.items()))


if __name__ == "__main__":
    main()
