"""Attention efficiency per GPU from measured kernel tables: the catalogue's ``[attention_tables]`` redone.

NVIDIA's Apache-2.0 ``aiconfigurator-core`` package (``pip install flexmesh[tables]``) ships the times of
fused causal attention over whole sequences measured on datacenter GPUs (``systems/data/<system>/
attention/<framework>/<version>/context_attention_perf.parquet``: batch, sequence length, heads, KV
heads, head dim, KV dtype, kernel, latency in ms). For each system this module takes one framework's
newest table (vLLM's, as :mod:`flexmesh.cost.device.gemm_tables`), keeps the rows a training step's attention
looks like — bf16 keys and values, head dim 128, no sliding window, sequences of at least
:data:`MIN_TOKENS` tokens (the efficiency the catalogue records is the one over long blocks) — with the
prefill kernel each system's vLLM runs there (FlashAttention-2 on Ampere and Ada, FlashAttention-3 on
Hopper, TensorRT-LLM's through FlashInfer on Blackwell: the fastest fused attention each architecture
has, as training stacks pick), and reports the median achieved TFLOP/s over the shapes every system's
table holds. A causal pass over ``s`` tokens of ``h`` heads of dim ``d`` is ``2 s^2 h d`` FLOPs (half of
``4 s^2 h d``).

``flexmesh/spec/presets/devices.toml`` records the medians under ``[attention_tables]``; a device's
``attn_efficiency`` is the fitted one (FlexSP's A100, :func:`flexmesh.cost.training.calibrate.fit_attn_efficiency`)
scaled by its table's fraction of peak over the A100 table's (:func:`flexmesh.spec.devices.catalogue_efficiency`).
The tables time the forward pass only; the scaling assumes a part's backward keeps the ratio its
forward has to A100's.

The device layer's own attention (``Hardware.device_kernels``) takes the measured form of
:class:`flexmesh.cost.device.kernels.MeasuredAttention` with the tile form of
:meth:`flexmesh.cost.device.kernels.Kernels.attention_efficiency`: four constants per system (the rate as a
fraction of peak, the per-query-tile overhead in keys, a fixed cost and a per-key cost per call), fitted
(:func:`fit_attention`) to the even rows, sorted by shape, of every sequence length the kept rows hold (from
1 token up), the odd ones held out (``bench/kernel_tables.py``). ``devices.toml`` records them under
``[attention_kernels]``.

Run ``python -m flexmesh.cost.device.attention_tables`` (optionally ``--systems DIR``) to print the medians
beside the recorded ones, ``--fit`` the fitted constants; it exits 1 when they differ by more than 0.5% (1%
for the constants). Nothing at plan or run time reads the tables.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from flexmesh.cost.device.gemm_tables import (
    FRAMEWORK,
    Fit,
    TableMedian,
    fitted_half,
    least_log_error,
    newest,
    redo,
)
from flexmesh.cost.device.kernels import Kernels, MeasuredAttention
from flexmesh.spec.devices import ATTENTION_KERNELS, ATTENTION_TABLES, KernelTable

MIN_TOKENS = 4096  # long blocks: the tile and per-query costs are a few percent there (flexmesh.cost.device.kernels)
HEAD_DIM = 128

Shape = tuple[int, int, int, int]  # batch, tokens, heads, KV heads


def newest_table(systems: Path, system: str) -> Path:
    return newest(systems, system, "attention", "context_attention_perf.parquet", f"{FRAMEWORK} attention")


def causal_seconds(path: Path, min_tokens: int = MIN_TOKENS) -> tuple[str, dict[Shape, float]]:
    """The prefill kernel of a table and its measured seconds per shape, over the rows kept (module doc) of at
    least ``min_tokens`` tokens."""
    import pyarrow.parquet as pq  # the optional `tables` extra

    t = pq.read_table(path).to_pydict()
    window = t.get("window_size", [0] * len(t["latency"]))
    out: dict[str, dict[Shape, float]] = {}
    for i, ms in enumerate(t["latency"]):
        kernel, s = t["kernel_source"][i], int(t["isl"][i])
        if ("decode" in kernel or t["kv_cache_dtype"][i] != "bfloat16" or t["attn_dtype"][i] != "bfloat16"
                or t["head_dim"][i] != HEAD_DIM or window[i] or s < min_tokens or ms <= 0):
            continue
        b, h = int(t["batch_size"][i]), int(t["num_heads"][i])
        out.setdefault(kernel, {})[(b, s, h, int(t["num_key_value_heads"][i]))] = ms * 1e-3
    if len(out) != 1:
        raise ValueError(f"{path}: expected one bf16 prefill kernel with head dim {HEAD_DIM}, found "
                         f"{', '.join(sorted(out)) or 'none'}")
    return next(iter(out.items()))


def causal_flops(b, s, h):  # noqa: ANN001, ANN201 - numbers or numpy arrays
    """FLOPs of a causal pass of ``b`` sequences of ``s`` tokens and ``h`` heads (half of ``4 s^2 h d``)."""
    return 2.0 * b * s * s * h * HEAD_DIM


def causal_tflops(path: Path) -> tuple[str, dict[Shape, float]]:
    """The prefill kernel of a table and its achieved TFLOP/s per shape, over the rows kept (module doc)."""
    kernel, rows = causal_seconds(path)
    return kernel, {shape: causal_flops(shape[0], shape[1], shape[2]) / t / 1e12 for shape, t in rows.items()}


def attention_rows(path: Path) -> tuple[str, np.ndarray]:
    """The prefill kernel and every kept row of any length as ``(batch, tokens, heads, KV heads, seconds)``,
    sorted by shape (the order :func:`flexmesh.cost.device.gemm_tables.fitted_half` splits)."""
    kernel, rows = causal_seconds(path, min_tokens=1)
    return kernel, np.array([(*shape, t) for shape, t in sorted(rows.items())], dtype=float).reshape(-1, 5)


ATTENTION_START = (0.5, 128.0, 3.0, 1.0)  # efficiency, overhead keys, fixed us, ns per key
ATTENTION_FIELDS = ("efficiency", "overhead_keys", "fixed_us", "per_key_ns")


def attention_kernels(values: dict[str, float], peak_tflops: float) -> Kernels:
    """The device layer's attention model with fitted ``values`` on a part of that peak (``sms`` only marks
    the tiles as modelled; attention's form does not use the count)."""
    return Kernels(mm_flops=1.0, attn_flops=values["efficiency"] * peak_tflops * 1e12, hbm_bytes_per_s=1.0, sms=1,
                   attn_overhead=values["overhead_keys"], attn_measured=MeasuredAttention(
                       fixed_s=values["fixed_us"] * 1e-6, per_key_s=values["per_key_ns"] * 1e-9))


def fit_attention(systems: Path, system: str, table: KernelTable) -> Fit:
    """The measured attention form's constants for ``system``, fitted to the even rows of its table (module doc)."""
    path = newest_table(systems, system)
    kernel, rows = attention_rows(path)
    b, s, h, _, t = rows.T
    fit = fitted_half(len(t))
    flops = causal_flops(b, s, h)

    def loss(v: dict[str, float]) -> float:
        pred = attention_kernels(v, table.peak_tflops).attention(flops[fit], s[fit])
        return float(np.mean(np.abs(np.log(np.maximum(pred, 1e-12) / t[fit]))))

    return Fit(system, f"{path.relative_to(systems).parent} {kernel}", int(fit.sum()), int((~fit).sum()),
               least_log_error(loss, ATTENTION_FIELDS, ATTENTION_START))


def medians(systems: Path, names: list[str]) -> list[TableMedian]:
    """Median causal-attention TFLOP/s of each system over the shapes all of them measured; the table
    named is the parquet file and, after it, the kernel it ran."""
    tables = {s: newest_table(systems, s) for s in names}
    rows = {s: causal_tflops(p) for s, p in tables.items()}
    common = set.intersection(*(set(r) for _, r in rows.values()))
    if not common:
        raise ValueError(f"the {FRAMEWORK} attention tables of {', '.join(names)} share no shape")
    return [TableMedian(s, f"{tables[s].relative_to(systems).parent} {rows[s][0]}", len(common),
                        float(np.median([rows[s][1][shape] for shape in common]))) for s in names]


def main(argv: list[str] | None = None) -> int:
    return redo("python -m flexmesh.cost.device.attention_tables", __doc__ or "", argv, medians, ATTENTION_TABLES,
                fit_attention, ATTENTION_KERNELS)


if __name__ == "__main__":
    sys.exit(main())
