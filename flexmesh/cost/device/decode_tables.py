"""Decode attention per GPU from measured kernel tables: the device layer's ``[decode_kernels]`` redone.

NVIDIA's Apache-2.0 ``aiconfigurator-core`` package (``pip install flexmesh[tables]``) ships the times of
decode attention measured on datacenter GPUs (``systems/data/<system>/attention/<framework>/<version>/
generation_attention_perf.parquet``: batch, ``isl`` (1) and ``step`` (the tokens generated before), heads, KV
heads, head dim, KV dtype, window, kernel, latency in ms): one query per sequence against ``isl + step``
cached keys and values. For each system this module takes one framework's newest table (vLLM's, as
:mod:`flexmesh.cost.device.gemm_tables`), keeps the rows a dense model's decode looks like — bf16 keys and
values, head dim 128, no sliding window — and fits the six constants of
:class:`flexmesh.cost.device.kernels.MeasuredDecode` (a fixed cost a call, a cost per (sequence, KV head)
pair, the fraction of the part's datasheet HBM bandwidth the KV reads reach, and the cache's three: the KV it
holds, its speedup and steepness, :func:`flexmesh.cost.device.kernels.cached_memory`) to the even rows, sorted by
shape; the odd ones are held out (``bench/kernel_tables.py``). ``devices.toml`` records them under
``[decode_kernels]``.

Run ``python -m flexmesh.cost.device.decode_tables --fit`` (optionally ``--systems DIR``) to print the fitted
constants beside the recorded ones; it exits 1 when one differs by more than 1%. Nothing at plan or run time
reads the tables.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from flexmesh.cost.device.gemm_tables import (
    CACHE_FIELDS,
    FRAMEWORK,
    Fit,
    fitted_half,
    least_log_error,
    newest,
    redo_fits,
    table_command,
)
from flexmesh.cost.device.kernels import Kernels, MeasuredDecode
from flexmesh.spec.devices import DECODE_KERNELS, GEMM_TABLES, KernelTable

HEAD_DIM = 128
KV_DTYPE_BYTES = 2  # bf16

# fixed us, HBM fraction, ns per (sequence, KV head) pair, cached MB, cache speedup, cache steepness
DECODE_START = (12.0, 0.9, 25.0, 32.0, 2.0, 4.0)
DECODE_FIELDS = ("fixed_us", "hbm_fraction", "per_pair_ns", *CACHE_FIELDS)


def newest_table(systems: Path, system: str) -> Path:
    return newest(systems, system, "attention", "generation_attention_perf.parquet", f"{FRAMEWORK} decode attention")


def decode_rows(path: Path) -> tuple[str, np.ndarray]:
    """The decode kernel of a table and its kept rows (module doc) as ``(batch, keys, heads, KV heads, seconds)``,
    sorted by shape (the order :func:`flexmesh.cost.device.gemm_tables.fitted_half` splits)."""
    import pyarrow.parquet as pq  # the optional `tables` extra

    t = pq.read_table(path).to_pydict()
    window = t.get("window_size", [0] * len(t["latency"]))
    out: dict[str, dict[tuple[int, int, int, int], float]] = {}
    for i, ms in enumerate(t["latency"]):
        if t["kv_cache_dtype"][i] != "bfloat16" or t["head_dim"][i] != HEAD_DIM or window[i] or ms <= 0:
            continue
        shape = (int(t["batch_size"][i]), int(t["isl"][i]) + int(t["step"][i]), int(t["num_heads"][i]),
                 int(t["num_key_value_heads"][i]))
        out.setdefault(t["kernel_source"][i], {})[shape] = ms * 1e-3
    if len(out) != 1:
        raise ValueError(f"{path}: expected one bf16 decode kernel with head dim {HEAD_DIM}, found "
                         f"{', '.join(sorted(out)) or 'none'}")
    kernel, rows = next(iter(out.items()))
    return kernel, np.array([(*shape, s) for shape, s in sorted(rows.items())], dtype=float).reshape(-1, 5)


def kv_bytes(batch, keys, kv_heads):  # noqa: ANN001, ANN201 - numbers or numpy arrays
    """Bytes of keys and values a decode call reads: every sequence's cached tokens, K and V, each KV head."""
    return 2.0 * batch * keys * kv_heads * HEAD_DIM * KV_DTYPE_BYTES


def decode_kernels(values: dict[str, float], hbm_gbps: float) -> Kernels:
    """The device layer's decode-attention model with fitted ``values`` on a part of that bandwidth."""
    return Kernels(mm_flops=1.0, attn_flops=1.0, hbm_bytes_per_s=hbm_gbps * 1e9, sms=None,
                   decode_measured=MeasuredDecode(fixed_s=values["fixed_us"] * 1e-6,
                                                  hbm_bytes_per_s=values["hbm_fraction"] * hbm_gbps * 1e9,
                                                  per_pair_s=values["per_pair_ns"] * 1e-9,
                                                  cache_bytes=values["cache_mb"] * 1e6,
                                                  cache_speedup=values["cache_speedup"],
                                                  cache_steepness=values["cache_steepness"]))


def fit_decode(systems: Path, system: str, table: KernelTable) -> Fit:
    """The measured decode form's constants for ``system``, fitted to the even rows of its table (module doc);
    ``table``: the system's GEMM table (its part's datasheet bandwidth)."""
    path = newest_table(systems, system)
    kernel, rows = decode_rows(path)
    b, keys, _, kv, t = rows.T
    fit = fitted_half(len(t))
    nbytes, pairs = kv_bytes(b, keys, kv), b * kv

    def loss(v: dict[str, float]) -> float:
        pred = decode_kernels(v, table.hbm_gbps).decode_attention(nbytes[fit], pairs[fit])
        return float(np.mean(np.abs(np.log(np.maximum(pred, 1e-12) / t[fit]))))

    return Fit(system, f"{path.relative_to(systems).parent} {kernel}", int(fit.sum()), int((~fit).sum()),
               least_log_error(loss, DECODE_FIELDS, DECODE_START))


def main(argv: list[str] | None = None) -> int:
    systems, _ = table_command("python -m flexmesh.cost.device.decode_tables", __doc__ or "", argv, "fit",
                               "redo the fitted constants (the only thing this command does)")
    if systems is None:
        return 2
    return redo_fits(systems, fit_decode, {s: GEMM_TABLES[s] for s in DECODE_KERNELS or GEMM_TABLES}, DECODE_KERNELS)


if __name__ == "__main__":
    sys.exit(main())
