"""Fits of the device presets' efficiencies to published measurements, and the check against them.

Run ``python -m flexmesh.cost.calibrate`` to redo every fit and print it beside the preset values
and the published runs' predicted-vs-published throughput.

Fits (each from a named source):

- ``mm_efficiency`` per GPU family: least squares on log(predicted / published) step time over
  published end-to-end training runs with their published layouts (:data:`PUBLISHED_RUNS`). The
  A100 runs (2021) used unfused attention; its efficiency is fitted jointly and used only for them.
- ``attn_efficiency``: FlexSP's profile of a 7B model on A100 (2412.01523): per-micro-batch time
  ``a * s^2 + b * s`` with ``a = 5.1e-6 ms/token^2``; the model's causal attention FLOPs per
  squared token (fwd + bwd) over ``a`` gives the achieved attention throughput.
- ``a2a_intra_efficiency`` / ``a2a_inter_efficiency``: FlexSP's measured all-to-all bandwidth on
  A100 nodes with 400 Gb/s InfiniBand per node (GB/s by group size 2: 119, 4: 104, 8: 96, 16: 10.3,
  32: 5.9, 64: 4.9), bandwidth being the per-rank buffer over the time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import minimize, minimize_scalar

from flexmesh.cost.evaluation import Evaluation
from flexmesh.cost.hardware import Hardware, group_shape
from flexmesh.cost.model import CostModel
from flexmesh.layout.enums import CPKind
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.cluster import DEVICE_PRESETS, ClusterSpec
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
    # "unfused": attention as separate kernels over the whole s x s matrix (before flash-style fused
    # kernels): twice the causal FLOPs at UNFUSED_ATTN_EFFICIENCY, whose softmax and masking passes
    # are memory-bound; "fused": flash-style kernels skipping the upper triangle (the preset).
    attention: str = "fused"
    # How the authors counted FLOPs: "megatron" = 96 B s l h^2 (1 + s/6h + V/16lh), which includes
    # the recomputed forward and non-causal attention; "model" = flexmesh's ModelSpec.model_flops.
    flops: str = "megatron"

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

    def cluster(self, device=None) -> ClusterSpec:
        dev = device or DEVICE_PRESETS[self.device]
        return ClusterSpec(nodes=self.gpus // 8, devices_per_node=8, device=dev)

    def predict(self, device=None, unfused_attn_efficiency: float | None = None) -> Evaluation:
        """The cost model's prediction for this run's layout (one micro-batch = one sequence per replica)."""
        dev = device or DEVICE_PRESETS[self.device]
        if self.attention == "unfused":
            dev = replace(dev, attn_efficiency=(unfused_attn_efficiency or UNFUSED_ATTN_EFFICIENCY) / 2)
        cost = CostModel(self.model, self.cluster(dev))
        kind = CPKind.RING if self.cp > 1 else CPKind.NONE
        s = LayerStrategy(tp=self.tp, cp=self.cp, cp_kind=kind, dp=self.dp, zero=self.zero, recompute=self.recompute)
        L, n = self.model.num_layers, self.pp * self.virtual_stages
        chunks = [[s] * (L // n + (1 if i < L % n else 0)) for i in range(n)]
        m = self.global_batch // self.dp
        return cost.evaluate_stages(chunks, self.pp, self.pipeline_schedule, m, self.virtual_stages, self.dp,
                                    self.seq_len)


_MEGATRON = "Narayanan et al., Megatron-LM, 2104.04473, Table 1 (A100 SXM 80GB, seq 2048, vocab 51200)"
# Not published: the number of interleaved chunks per pipeline rank; the paper describes an interleaved
# schedule over 16 stages of a 126-layer model. Assumed: about two layers per chunk.
V_LLAMA3 = 4
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
                 recompute=False, zero=1, flops="model", pipeline_schedule="interleaved", virtual_stages=V_LLAMA3),
    PublishedRun("llama3-405b-16k", _LLAMA3, _LLAMA3_405B, "H100-80GB", 16384, 8, 16, 2048, 8192, 400,
                 recompute=False, zero=1, flops="model", pipeline_schedule="interleaved", virtual_stages=V_LLAMA3),
)

# Fitted with the A100 mm_efficiency by fit_efficiencies("A100"); used only to predict the 2021 runs.
UNFUSED_ATTN_EFFICIENCY = 0.129

# FlexSP (2412.01523): all-to-all bandwidth on A100 nodes by group size, GB/s (400 Gb/s IB per node).
FLEXSP_A2A_GBPS = {2: 119.0, 4: 104.0, 8: 96.0, 16: 10.3, 32: 5.9, 64: 4.9}
FLEXSP_NODE_NET_GBPS = 50.0  # 400 Gb/s
# FlexSP (2412.01523): 7B model on A100-40GB, per-micro-batch attention coefficient, s / token^2.
FLEXSP_7B_A_S_PER_SQ_TOKEN = 5.1e-9


def _family_devices(family: str) -> list[str]:
    return [n for n in DEVICE_PRESETS if n.startswith(family) or (family == "H100" and n == "H200")]


def fit_efficiencies(family: str) -> dict[str, float]:
    """Least-squares fit on log step time over the published runs on ``family`` GPUs.

    Fits ``mm_efficiency``, and ``unfused_attn_efficiency`` too where the family's runs used unfused
    attention (the A100 runs of 2104.04473).
    """
    runs = [r for r in PUBLISHED_RUNS if r.device in _family_devices(family)]
    unfused = any(r.attention == "unfused" for r in runs)

    def loss(x) -> float:
        err = 0.0
        for r in runs:
            dev = replace(DEVICE_PRESETS[r.device], mm_efficiency=float(x[0]))
            pred = r.predict(dev, unfused_attn_efficiency=float(x[1]) if unfused else None)
            err += math.log(pred.step_time / r.published_step_time()) ** 2
        return err

    if unfused:
        res = minimize(loss, x0=[0.6, 0.1], method="Nelder-Mead", bounds=[(0.2, 0.95), (0.01, 0.95)],
                       options={"xatol": 1e-5, "fatol": 1e-9})
        return {"mm_efficiency": float(res.x[0]), "unfused_attn_efficiency": float(res.x[1])}
    res = minimize_scalar(lambda e: loss([e]), bounds=(0.2, 0.95), method="bounded", options={"xatol": 1e-5})
    return {"mm_efficiency": float(res.x)}


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


def calibration_table() -> list[dict]:
    """Each published run: published and predicted tokens/s per GPU and their ratio, with presets."""
    rows = []
    for r in PUBLISHED_RUNS:
        ev = r.predict()
        pred = r.global_batch * r.seq_len / ev.step_time / r.gpus
        pub = r.published_tokens_per_gpu()
        rows.append({"run": r.name, "device": r.device, "layout": f"tp{r.tp} pp{r.pp} dp{r.dp}",
                     "published_tokens_per_gpu": pub, "predicted_tokens_per_gpu": pred, "ratio": pred / pub,
                     "source": r.source})
    return rows


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    fits = Table(title="Fitted efficiencies (redo of the preset values)")
    for c in ("field", "fit", "preset", "source"):
        fits.add_column(c)
    intra, inter = fit_a2a_efficiency()
    a100, h100 = DEVICE_PRESETS["A100-80GB"], DEVICE_PRESETS["H100-80GB"]
    fa, fh = fit_efficiencies("A100"), fit_efficiencies("H100")
    fits.add_row("A100 mm_efficiency", f"{fa['mm_efficiency']:.3f}", f"{a100.mm_efficiency:.3f}", _MEGATRON)
    fits.add_row("unfused attention (2021 runs)", f"{fa['unfused_attn_efficiency']:.3f}",
                 f"{UNFUSED_ATTN_EFFICIENCY:.3f}", _MEGATRON)
    fits.add_row("H100 mm_efficiency", f"{fh['mm_efficiency']:.3f}", f"{h100.mm_efficiency:.3f}", _LLAMA3)
    fits.add_row("attn_efficiency", f"{fit_attn_efficiency():.3f}", f"{a100.attn_efficiency:.3f}", "FlexSP 7B profile")
    fits.add_row("a2a_intra_efficiency", f"{intra:.3f}", f"{a100.a2a_intra_efficiency:.3f}", "FlexSP all-to-all")
    fits.add_row("a2a_inter_efficiency", f"{inter:.3f}", f"{a100.a2a_inter_efficiency:.3f}", "FlexSP all-to-all")
    con.print(fits)
    runs = Table(title="Published runs: per-GPU throughput, predicted with the presets")
    for c in ("run", "device", "layout", "published tok/s/GPU", "predicted", "ratio"):
        runs.add_column(c, justify="right" if c not in ("run", "device", "layout") else "left")
    for row in calibration_table():
        runs.add_row(row["run"], row["device"], row["layout"], f"{row['published_tokens_per_gpu']:.0f}",
                     f"{row['predicted_tokens_per_gpu']:.0f}", f"{row['ratio']:.3f}")
    con.print(runs)


if __name__ == "__main__":
    main()
