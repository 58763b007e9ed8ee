"""The device layer against aiconfigurator-core's measured kernel tables, on the rows no constant was fitted to.

For each system with a vLLM GEMM and attention table whose part is in the catalogue (the part of that
system's datasheet peak and bandwidth), the bf16 GEMM rows and the causal-attention rows
(``flexmesh.cost.device.attention_tables``: bf16, head dim 128, no window, the prefill kernel, every length)
and the decode-attention rows (``flexmesh.cost.device.decode_tables``: bf16 KV, head dim 128, no window, the
decode kernel) are sorted by shape; the constants of ``devices.toml`` ``[gemm_kernels]``, ``[attention_kernels]``
and ``[decode_kernels]`` were fitted to the even rows (``python -m flexmesh.cost.device.gemm_tables --fit``,
``attention_tables --fit``, ``decode_tables --fit``), and the odd rows score them here: the median of
``|predicted / measured - 1|``.

- after: ``Hardware.device_kernels``, the device layer's kernels (the measured forms at the kernel rates), which
  serving prices with and a training step prices with at its training rates (``Hardware.kernels``: the same forms,
  the framework term between the rates);
- before: the tile and wave model at the end-to-end fits' rates, what both halves priced single kernels with
  before the device layer (the framework terms in).

Decode attention's before is the KV bytes at the achievable HBM rate and a launch a call, what the serving
iteration priced it with until now. Targets: median error <= 10% for GEMMs and <= 12% for attention, prefill
and decode, on every GPU type. A second table lists each
part's kernel efficiencies, its training fits and the framework terms between them.

Usage: ``python -m bench.kernel_tables [--no-record]`` (needs ``pip install flexmesh[tables]``; without it the
bench says so in one line and exits 0).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import numpy as np

from bench._results import markdown_table, record
from flexmesh.cost.device import attention_tables, decode_tables, gemm_tables
from flexmesh.cost.device.hardware import Hardware
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.devices import (
    ATTENTION_KERNELS,
    DECODE_KERNELS,
    DEVICE_PRESETS,
    GEMM_KERNELS,
    GEMM_TABLES,
    DeviceSpec,
)

# The code this bench's figures depend on: a change there makes its record out of date.
DEPENDS_ON = ("flexmesh/cost/device", "flexmesh/spec", "flexmesh/errors.py", "flexmesh/files.py",
              "flexmesh/inputs.py", "flexmesh/units.py")
GEMM_BOUND, ATTENTION_BOUND = 0.10, 0.12


def measured_part(system: str) -> DeviceSpec | None:
    """The catalogue part a system's tables measured: its kernel table, peak and memory bandwidth."""
    t = GEMM_TABLES.get(system)
    for d in DEVICE_PRESETS.values():
        if t is not None and d.kernel_table == system and d.peak_tflops.get("bf16") == t.peak_tflops \
                and d.hbm_gbps == t.hbm_gbps:
            return d
    return None


def median_error(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.median(np.abs(predicted / measured - 1.0)))


def score(system: str, part: DeviceSpec, systems) -> dict:  # noqa: ANN001 - a Path
    hw = Hardware(ClusterSpec(1, 1, part))
    before = hw.tile_kernels()
    m, n, k, t = gemm_tables.gemm_rows(gemm_tables.newest_table(systems, system)).T
    held = ~gemm_tables.fitted_half(len(t))
    big = held & (np.minimum(np.minimum(m, n), k) >= gemm_tables.MIN_DIM)  # a training step's GEMMs
    kernel, rows = attention_tables.attention_rows(attention_tables.newest_table(systems, system))
    b, s, h, _, ta = rows.T
    held_a = ~gemm_tables.fitted_half(len(ta))
    flops = attention_tables.causal_flops(b, s, h)
    dkernel, drows = decode_tables.decode_rows(decode_tables.newest_table(systems, system))
    db, keys, _, kv, td = drows.T
    held_d = ~gemm_tables.fitted_half(len(td))
    nbytes, pairs = decode_tables.kv_bytes(db, keys, kv)[held_d], (db * kv)[held_d]
    return {
        "gemm_rows": (int((~held).sum()), int(held.sum())),
        "gemm_before": median_error(before.gemm(m[held], n[held], k[held]), t[held]),
        "gemm_after": median_error(hw.device_kernels.gemm(m[held], n[held], k[held]), t[held]),
        "big_rows": int(big.sum()),
        "big_before": median_error(before.gemm(m[big], n[big], k[big]), t[big]),
        "big_after": median_error(hw.device_kernels.gemm(m[big], n[big], k[big]), t[big]),
        "attn_kernel": kernel,
        "attn_rows": (int((~held_a).sum()), int(held_a.sum())),
        "attn_before": median_error(before.attention(flops[held_a], s[held_a]), ta[held_a]),
        "attn_after": median_error(hw.device_kernels.attention(flops[held_a], s[held_a]), ta[held_a]),
        "decode_kernel": dkernel,
        "decode_rows": (int((~held_d).sum()), int(held_d.sum())),
        "decode_before": median_error(before.decode_attention(nbytes, pairs), td[held_d]),
        "decode_after": median_error(hw.device_kernels.decode_attention(nbytes, pairs), td[held_d]),
    }


def deepbench_rows() -> list[list[str]]:
    """DeepBench's V100 and T4 GEMM tables (``gemm_tables.DEEPBENCH``) on their held-out rows: the part priced from the
    A100's fit scaled to its datasheet (before its own table), from its own fit, and (a power-capped part) at the
    rate its cap sustains."""
    out = []
    for system, (gpu, name) in gemm_tables.DEEPBENCH.items():
        part = replace(DEVICE_PRESETS[name], sustained_tflops={})  # the table's short runs: no power cap
        borrowed = replace(part, gemm_table="", kernel_mm_efficiency=GEMM_KERNELS[part.kernel_table]["efficiency"])
        m, n, k, t = gemm_tables.deepbench_rows(gemm_tables.DEEPBENCH_CSV, gpu).T
        held = ~gemm_tables.fitted_half(len(t))
        error = {which: median_error(Hardware(ClusterSpec(1, 1, d), "fp16").device_kernels.gemm(
            m[held], n[held], k[held]), t[held]) for which, d in (("before", borrowed), ("after", part),
                                                                 ("capped", DEVICE_PRESETS[name]))}
        out.append([system, name, f"{int((~held).sum())} / {int(held.sum())}",
                    f"{error['before']:.1%} ({borrowed.kernel_table}'s)", verdict(error["after"], GEMM_BOUND),
                    f"{error['capped']:.1%}" if DEVICE_PRESETS[name].sustained_tflops else "-"])
    return out


TORCH_MM = "bench/data/torch_mm_tflops.csv"
TORCH_MM_SIZES = (1024, 2048, 4096, 8192, 10240)  # the test's n: 30 torch.mm calls of n x n by n x n timed, after 6


def torch_mm_rows() -> list[list[str]]:
    """A second test of large GEMMs per part, independent of the tables (``TORCH_MM``: torch.mm n^3 rates published
    by zzc0721/torch-performance-test-data's users), beside the device layer's price of the same GEMMs: at each n
    the run gives, or its best n against the best price over the test's n."""
    import csv
    from collections import defaultdict

    runs: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    sources: dict[tuple[str, str], str] = {}
    with open(TORCH_MM, newline="") as fh:
        for r in csv.DictReader(fh):
            runs[(r["part"], r["dtype"])][r["n"]] = float(r["tflops"])
            sources[(r["part"], r["dtype"])] = r["source"]
    out = []
    for (name, dtype), rates in runs.items():
        kernels = Hardware(ClusterSpec(1, 1, DEVICE_PRESETS[name]), dtype).device_kernels
        priced = {n: 2 * n ** 3 / float(kernels.gemm(n, n, n)) / 1e12 for n in TORCH_MM_SIZES}
        if "best" in rates:
            cells = f"best {rates['best']:.0f} / {max(priced.values()):.0f}"
            error = max(priced.values()) / rates["best"] - 1
        else:
            cells = ", ".join(f"{n}: {rates[str(n)]:.0f} / {priced[n]:.0f}" for n in TORCH_MM_SIZES)
            error = float(np.median([priced[n] / rates[str(n)] - 1 for n in TORCH_MM_SIZES if n >= 4096]))
        out.append([name, dtype, cells, f"{error:+.0%}", sources[(name, dtype)]])
    return out


def verdict(error: float, bound: float) -> str:
    return f"{error:.1%} {'PASS' if error <= bound else 'FAIL'}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    args = ap.parse_args(argv)
    systems = gemm_tables.systems_dir()
    if systems is None:
        print("bench.kernel_tables: skipped, aiconfigurator-core is not installed (pip install 'flexmesh[tables]')")
        return 0
    measured = sorted(p.name for p in (systems / "data").iterdir()
                      if list((p / "gemm" / gemm_tables.FRAMEWORK).glob("*/gemm_perf.parquet")))
    scored, unmapped = [], []
    for system in measured:
        part = measured_part(system)
        if part is None or any(system not in k for k in (GEMM_KERNELS, ATTENTION_KERNELS, DECODE_KERNELS)):
            unmapped.append(system)
            continue
        scored.append((system, part, score(system, part, systems)))
        print(system, scored[-1][2], flush=True)
    rows = [[system, part.name,
             f"{r['gemm_rows'][0]} / {r['gemm_rows'][1]}", f"{r['gemm_before']:.1%}",
             verdict(r["gemm_after"], GEMM_BOUND),
             f"{r['big_rows']}: {r['big_before']:.1%} -> {r['big_after']:.1%}",
             f"{r['attn_rows'][0]} / {r['attn_rows'][1]}", f"{r['attn_before']:.1%}",
             verdict(r["attn_after"], ATTENTION_BOUND),
             f"{r['decode_rows'][0]} / {r['decode_rows'][1]}", f"{r['decode_before']:.1%}",
             verdict(r["decode_after"], ATTENTION_BOUND)] for system, part, r in scored]
    md = ["Median |predicted / measured - 1| on the held-out rows (the odd rows of each table sorted by shape; the "
          "constants were fitted to the even ones). GEMMs: every bf16 row of the vLLM table; attention: causal, "
          "bf16, head dim 128, no window, the prefill kernel (FlashAttention-2 on A100, FlashAttention-3 on "
          "Hopper, TensorRT-LLM's through FlashInfer on B200, FlashAttention-2 on L40S), every length; decode "
          "attention: bf16 KV, head dim 128, no window, the decode kernel, every batch and context. Before: the "
          "tile and wave model at the end-to-end fits' rates (`Hardware.kernels`, what a training step uses; "
          "decode: the KV bytes at the achievable HBM rate); "
          f"after: the device layer's kernels (`Hardware.device_kernels`). Targets: GEMMs <= {GEMM_BOUND:.0%}, "
          f"attention (prefill and decode) <= {ATTENTION_BOUND:.0%}.", "",
          *markdown_table(["system", "part", "GEMM rows fitted / held out", "GEMM before", "GEMM after",
                           f"held-out GEMMs with M, N, K >= {gemm_tables.MIN_DIM}: before -> after",
                           "attention rows fitted / held out", "attention before", "attention after",
                           "decode rows fitted / held out", "decode before", "decode after"], rows), ""]
    terms = [[part.name, f"{part.kernel_mm_efficiency:.3f}", f"{part.mm_efficiency:.3f}", f"{part.framework_mm:.3f}",
              f"{part.kernel_attn_efficiency:.3f}", f"{part.attn_efficiency:.3f}", f"{part.framework_attn:.3f}"]
             for _, part, _ in scored]
    md += ["Kernel efficiencies (fraction of peak, fitted to the tables), the training fits (flexmesh.cost.training."
           "calibrate, transferred through the tables' medians) and the framework terms, training / kernel: what a "
           "training step's GEMMs and attention reach of the kernel rate (the attention fit also prices the "
           "backward, which the tables do not time).", "",
           *markdown_table(["part", "kernel GEMM", "training GEMM", "framework GEMM", "kernel attention",
                            "training attention", "framework attention"], terms)]
    if unmapped:
        md += ["", f"Systems with vLLM tables and no catalogue part (not scored): {', '.join(unmapped)}."]
    md += ["", "Parts no aiconfigurator-core table timed, from DeepBench's fp16 GEMM tables (cuBLAS, CUDA 10.1; "
           "`bench/data/deepbench_gemm_fp16.csv`, `flexmesh.cost.device.gemm_tables.DEEPBENCH`): the same form fitted "
           "to the even rows, the odd rows held out. Before: the A100's fit scaled to the part's datasheet, as the "
           "part was priced without its table. DeepBench times short runs: the T4's are faster than the rate its "
           "70 W cap sustains, which the device layer prices at (last column).", "",
           *markdown_table(["system", "part", "GEMM rows fitted / held out", "GEMM before", "GEMM after",
                            "after, at the power cap's sustained rate"], deepbench_rows()),
           "", "A second test of large GEMMs, independent of the tables: torch.mm of two n x n matrices, 30 calls "
           "timed after 6 warm-ups, as users of zzc0721/torch-performance-test-data published it (`bench/data/"
           "torch_mm_tflops.csv`; each n where the run gives them, else its best n against the best price over the "
           "test's n), beside the device layer's price of the same GEMMs (power-capped parts at their sustained "
           "rate; the L4's 4096^3 rates are its catalogue `sustained_tflops`, so in-sample, its other n not). Not a "
           "target: one run each, on machines nobody describes.", "",
           *markdown_table(["part", "dtype", "TFLOP/s measured / priced", "price over measured (n >= 4096, or "
                            "best)", "run"], torch_mm_rows())]
    print("\n".join(md))
    worst_g = max(scored, key=lambda x: x[2]["gemm_after"])
    worst_a = max(scored, key=lambda x: x[2]["attn_after"])
    worst_d = max(scored, key=lambda x: x[2]["decode_after"])
    headline = (f"held-out median error, worst GPU: GEMM {worst_g[2]['gemm_after']:.1%} ({worst_g[0]}; before "
                f"{max(r['gemm_before'] for _, _, r in scored):.1%}), attention {worst_a[2]['attn_after']:.1%} "
                f"({worst_a[0]}; before {max(r['attn_before'] for _, _, r in scored):.1%}), decode attention "
                f"{worst_d[2]['decode_after']:.1%} ({worst_d[0]}; before "
                f"{max(r['decode_before'] for _, _, r in scored):.1%})")
    print(headline)
    if not args.no_record:
        record("kernel_tables", "\n".join(md), headline=headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
