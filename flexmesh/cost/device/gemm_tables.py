"""GEMM efficiency per GPU from measured kernel tables: the catalogue's ``[gemm_tables]`` redone.

NVIDIA's Apache-2.0 ``aiconfigurator-core`` package (``pip install flexmesh[tables]``) ships GEMM
latencies measured on datacenter GPUs (``systems/data/<system>/gemm/<framework>/<version>/
gemm_perf.parquet``: m, n, k, dtype, latency in ms). For each system this module takes the bf16 rows
of one framework's newest table (vLLM's: they time ``torch.nn.functional.linear``, the call the
runtime makes), keeps the shapes with m, n and k all >= :data:`MIN_DIM` that every system's table
holds (so no GPU is scored on easier shapes than another), and reports the median achieved TFLOP/s
over them. ``flexmesh/spec/presets/devices.toml`` records those medians under ``[gemm_tables]``; a
device's ``mm_efficiency`` is its family's fit scaled by its table's fraction of peak over the fitted
part's (:func:`flexmesh.spec.cluster.catalogue_efficiency`).

The device layer's own GEMMs (``Hardware.device_kernels``: each kernel as the tables time it, no training
step's framework terms) take the measured form of :class:`flexmesh.cost.device.kernels.MeasuredGemm`, its
nine constants (five of the GEMM, three of the cache and the wave term's share) fitted per system
(:func:`fit_gemm`; the waves on the measured part's SMs, ``[gemm_tables] sms``) to every bf16 row of the table:
the rows sorted by ``(m, n, k)``, the even ones fitted (least mean absolute log error, Nelder-Mead from each of
the fixed :data:`GEMM_STARTS`, the least fitted loss kept), the odd ones held out to score it
(``bench/kernel_tables.py``). ``devices.toml`` records them under ``[gemm_kernels]``. The fits of all five
systems take about 40 s. The V100 and T4, which no aiconfigurator-core table timed, have DeepBench's fp16 GEMM tables
(:data:`DEEPBENCH`; ``bench/data/deepbench_gemm_fp16.csv``), fitted in the same form and the same way on their own
datasheets; a part names such a fit as its ``gemm_table``.

Run ``python -m flexmesh.cost.device.gemm_tables`` (optionally ``--systems DIR``, the package's ``systems``
folder) to print the medians beside the recorded ones, ``--fit`` the fitted constants beside theirs; it exits 1
when they differ by more than 0.5% (1% for a fit's constants). Nothing at plan or run time reads the tables.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from flexmesh.cost.device.kernels import TABLE_WEIGHTS, Kernels, MeasuredGemm
from flexmesh.spec.devices import GEMM_KERNELS, GEMM_TABLES, KernelTable

FRAMEWORK = "vllm"
T = TypeVar("T")  # what a fit reads beside its rows: a KernelTable, or a DeepBench GPU and part
MIN_DIM = 4096  # the GEMMs of a training step's layers: thousands of tokens by thousands of features


@dataclass(frozen=True)
class TableMedian:
    system: str
    table: str  # the parquet file read, relative to the systems folder
    shapes: int
    tflops: float


def systems_dir() -> Path | None:
    """The ``systems`` folder of the installed aiconfigurator-core, found without importing it."""
    spec = importlib.util.find_spec("aiconfigurator_core")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "systems"


def version_key(path: Path) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in path.parent.name.replace("rc", ".").split("."))


def newest(systems: Path, system: str, op: str, file: str, what: str, framework: str = FRAMEWORK) -> Path:
    """The newest version's ``file`` of ``system``'s ``op`` tables measured under ``framework``."""
    found = sorted((systems / "data" / system / op / framework).glob(f"*/{file}"), key=version_key)
    if not found:
        raise FileNotFoundError(f"no {what} table for {system} under {systems}")
    return found[-1]


def newest_table(systems: Path, system: str) -> Path:
    return newest(systems, system, "gemm", "gemm_perf.parquet", f"{FRAMEWORK} GEMM")


def table_command(prog: str, doc: str, argv: list[str] | None, flag: str, flag_help: str) -> tuple[Path | None, bool]:
    """The command line every table module shares: ``--systems DIR`` and one action ``--flag``; the systems
    folder (None, said in one line, without aiconfigurator-core) and whether the flag was given."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument("--systems", type=Path, help="aiconfigurator-core's systems folder (default: the installed one)")
    p.add_argument(f"--{flag}", action="store_true", help=flag_help)
    args = p.parse_args(argv)
    systems = args.systems or systems_dir()
    if systems is None:
        print("aiconfigurator-core is not installed: pip install 'flexmesh[tables]' (or pass --systems DIR)")
    return systems, bool(getattr(args, flag))


def _bf16_rows(path: Path) -> dict[tuple[int, int, int], float]:
    import pyarrow.parquet as pq  # the optional `tables` extra

    d = pq.read_table(path, columns=["gemm_dtype", "m", "n", "k", "latency"]).to_pydict()
    out: dict[tuple[int, int, int], float] = {}
    for dt, m, n, k, lat in zip(d["gemm_dtype"], d["m"], d["n"], d["k"], d["latency"]):
        if dt == "bfloat16" and min(m, n, k) >= MIN_DIM and lat > 0:
            out[(int(m), int(n), int(k))] = 2.0 * m * n * k / (lat * 1e-3) / 1e12
    return out


def medians(systems: Path, names: list[str]) -> list[TableMedian]:
    """Median bf16 TFLOP/s of each system over the shapes all of them measured."""
    tables = {s: newest_table(systems, s) for s in names}
    rows = {s: _bf16_rows(p) for s, p in tables.items()}
    common = set.intersection(*(set(r) for r in rows.values()))
    if not common:
        raise ValueError(f"the {FRAMEWORK} tables of {', '.join(names)} share no shape with every dimension "
                         f">= {MIN_DIM}")
    return [TableMedian(s, str(tables[s].relative_to(systems)), len(common),
                        float(np.median([rows[s][shape] for shape in common]))) for s in names]


# DeepBench's GEMM results (github.com/baidu-research/DeepBench, Apache-2.0, bench/data/deepbench_LICENSE), the one
# public kernel table found of the Volta and Turing parts: results/train/DeepBench_NV_<gpu>.xlsx, sheet "Results -
# FP16 ip, Mixed math" (cuBLAS fp16 GEMMs accumulating in fp32, CUDA 10.1.243, driver 418.67; the V100 an SXM2 part of
# a DGX-1), its 160 dense GEMM rows per GPU copied into DEEPBENCH_CSV. Each system: the GPU's rows, the catalogue part
# whose datasheet (fp16 peak, bandwidth, SMs) they are fitted on.
DEEPBENCH = {"v100_deepbench": ("V100", "V100-32GB"), "t4_deepbench": ("T4", "T4")}
DEEPBENCH_CSV = Path(__file__).resolve().parents[3] / "bench" / "data" / "deepbench_gemm_fp16.csv"

# efficiency, fixed us, HBM fraction, power, ns per K element, cached MB, cache speedup, cache steepness, wave tail:
# Nelder-Mead from each start, the least loss on the fitted rows kept (the second start finds a lower one on H200)
GEMM_STARTS = ((0.8, 2.5, 0.85, 3.0, 0.3, 32.0, 2.0, 4.0, 0.5), (0.6, 3.0, 0.9, 1.5, 0.5, 50.0, 1.5, 4.0, 0.8))
GEMM_FIELDS = ("efficiency", "fixed_us", "hbm_fraction", "power", "per_k_ns", "cache_mb", "cache_speedup",
               "cache_steepness", "wave_tail")
CACHE_FIELDS = ("cache_mb", "cache_speedup", "cache_steepness")


@dataclass(frozen=True)
class Fit:
    """Constants fitted to one system's table and the rows they were fitted to and scored on."""

    system: str
    table: str
    fitted_rows: int
    held_rows: int
    values: dict[str, float]


def gemm_rows(path: Path) -> np.ndarray:
    """Every bf16 row of a GEMM table as ``(m, n, k, seconds)``, sorted by shape (the order :func:`fitted_half`
    splits)."""
    import pyarrow.parquet as pq  # the optional `tables` extra

    d = pq.read_table(path, columns=["gemm_dtype", "m", "n", "k", "latency"]).to_pydict()
    rows = sorted({(int(m), int(n), int(k)): ms * 1e-3 for dt, m, n, k, ms in
                   zip(d["gemm_dtype"], d["m"], d["n"], d["k"], d["latency"]) if dt == "bfloat16" and ms > 0}.items())
    return np.array([(*shape, s) for shape, s in rows], dtype=float).reshape(-1, 4)


def fitted_half(rows: int) -> np.ndarray:
    """Which rows of a shape-sorted table the constants are fitted to: the even ones (the odd are held out)."""
    return np.arange(rows) % 2 == 0


def gemm_kernels(values: dict[str, float], peak_tflops: float, hbm_gbps: float, sms: int | None) -> Kernels:
    """The device layer's GEMM model with fitted ``values`` on a part of that peak, bandwidth and SM count, timed
    as the tables time it (:data:`flexmesh.cost.device.kernels.TABLE_WEIGHTS` weights against one input)."""
    return Kernels(mm_flops=values["efficiency"] * peak_tflops * 1e12, attn_flops=1.0, hbm_bytes_per_s=hbm_gbps * 1e9,
                   sms=sms, gemm_measured=MeasuredGemm(
                       fixed_s=values["fixed_us"] * 1e-6, hbm_bytes_per_s=values["hbm_fraction"] * hbm_gbps * 1e9,
                       power=values["power"], per_k_s=values["per_k_ns"] * 1e-9, cache_bytes=values["cache_mb"] * 1e6,
                       cache_speedup=values["cache_speedup"], cache_steepness=values["cache_steepness"],
                       weights=TABLE_WEIGHTS, wave_tail=values["wave_tail"]))


def least_log_error(loss: Callable[[dict[str, float]], float], fields: tuple[str, ...],
                    start: tuple[float, ...], *more: tuple[float, ...]) -> dict[str, float]:
    """The constants that minimise ``loss`` (Nelder-Mead from ``start``, and from each of ``more`` with the least
    loss kept, the first on a tie: deterministic), rounded to 4 figures."""
    from scipy.optimize import minimize

    runs = [minimize(lambda x: loss(dict(zip(fields, x))), np.asarray(s), method="Nelder-Mead",
                     options={"maxiter": 4000, "xatol": 1e-5, "fatol": 1e-7}) for s in (start, *more)]
    best = min(runs, key=lambda r: r.fun)  # min keeps the first of equal losses
    return {f: float(f"{v:.4g}") for f, v in zip(fields, best.x)}


def bounded(v: dict[str, float]) -> dict[str, float]:
    """``v`` with the wave term in [0, 1] and the time a K element adds at least 0: the fit prices a constant outside
    at its bound (so it may wander there at no cost) and records it there."""
    return {**v, "wave_tail": min(max(v["wave_tail"], 0.0), 1.0), "per_k_ns": max(v["per_k_ns"], 0.0)}


def fit_rows(rows: np.ndarray, peak_tflops: float, hbm_gbps: float, sms: int | None) -> tuple[dict[str, float], int]:
    """The measured GEMM form's constants fitted to the even rows of ``rows`` (``(m, n, k, seconds)``, sorted by
    shape) on a part of that peak, bandwidth and SM count, and how many rows they were fitted to."""
    m, n, k, t = rows.T
    fit = fitted_half(len(t))

    def loss(v: dict[str, float]) -> float:
        pred = gemm_kernels(bounded(v), peak_tflops, hbm_gbps, sms).gemm(m[fit], n[fit], k[fit])
        return float(np.mean(np.abs(np.log(np.maximum(pred, 1e-12) / t[fit]))))

    values = bounded(least_log_error(loss, GEMM_FIELDS, *GEMM_STARTS))
    return values, int(fit.sum())


def fit_gemm(systems: Path, system: str, table: KernelTable) -> Fit:
    """The measured GEMM form's constants for ``system``, fitted to the even rows of its table (module doc)."""
    path = newest_table(systems, system)
    rows = gemm_rows(path)
    values, fitted = fit_rows(rows, table.peak_tflops, table.hbm_gbps, table.sms)
    return Fit(system, str(path.relative_to(systems)), fitted, len(rows) - fitted, values)


def deepbench_rows(path: Path, gpu: str) -> np.ndarray:
    """One GPU's rows of DeepBench's fp16 GEMM table (:data:`DEEPBENCH_CSV`) as ``(m, n, k, seconds)``, sorted by
    shape and then by the transposes (a shape timed with two layouts keeps both rows)."""
    import csv

    with open(path, newline="") as fh:
        rows = sorted((int(r["m"]), int(r["n"]), int(r["k"]), r["a_transpose"], r["b_transpose"], float(r["ms"]) * 1e-3)
                      for r in csv.DictReader(fh) if r["gpu"] == gpu)
    if not rows:
        raise ValueError(f"{path} has no rows of {gpu}")
    return np.array([(m, n, k, s) for m, n, k, _, _, s in rows], dtype=float)


def fit_deepbench(path: Path, system: str) -> Fit:
    """The measured GEMM form's constants for DeepBench's ``system`` (a key of :data:`DEEPBENCH`), fitted to the even
    rows of its GPU's table on that GPU's datasheet."""
    from flexmesh.spec.devices import device

    gpu, part = DEEPBENCH[system]
    d = device(part)
    rows = deepbench_rows(path, gpu)
    values, fitted = fit_rows(rows, d.peak_tflops["fp16"], d.hbm_gbps, d.sms)
    return Fit(system, f"{path.name} ({gpu})", fitted, len(rows) - fitted, values)


def _difference(fitted: float, recorded: float) -> float:
    """|fitted / recorded - 1|; for a constant recorded at 0 (a term the fit left out), 0 only where it is still 0."""
    if recorded == 0.0:
        return 0.0 if fitted == 0.0 else math.inf
    return abs(fitted / recorded - 1.0)


def redo_fits(systems: Path, fit: Callable[[Path, str, T], Fit], tables: dict[str, T],
              recorded: dict[str, dict[str, float]]) -> int:
    """Print each system's fitted constants beside the recorded ones; 1 when one differs by more than 1%."""
    worst = 0.0
    for system in sorted(tables):
        f = fit(systems, system, tables[system])
        rec = recorded.get(system, {})
        worst = max([worst] + [_difference(v, rec[name]) if name in rec else math.inf for name, v in f.values.items()])
        print(f"[{system}]  # {f.table}: fitted to {f.fitted_rows} rows, {f.held_rows} held out")
        print("\n".join(f"{name} = {v:.4g}" + (f"  # recorded {rec[name]:.4g}" if name in rec else "")
                        for name, v in f.values.items()))
    print(f"largest difference from the recorded constants: {worst:.2%}")
    return 0 if worst <= 0.01 else 1


def redo(prog: str, doc: str, argv: list[str] | None,
         measure: Callable[[Path, list[str]], list[TableMedian]], recorded: dict[str, KernelTable],
         fit: Callable[[Path, str, KernelTable], Fit] | None = None,
         fitted: dict[str, dict[str, float]] | None = None) -> int:
    """The command line of a table module: ``measure`` the installed (or ``--systems``) tables, print
    each system's median beside ``recorded``; exit 1 when one differs by more than 0.5%, 2 without the
    tables."""
    systems, refit = table_command(prog, doc, argv, "fit",
                                   "redo the device layer's fitted constants instead of the medians")
    if systems is None:
        return 2
    if refit and fit is not None and fitted is not None:
        return redo_fits(systems, fit, recorded, fitted)
    worst = 0.0
    print(f"{'system':<12} {'table':<62} {'shapes':>6} {'TFLOP/s':>8} {'recorded':>8} {'of peak':>7}")
    for t in measure(systems, sorted(recorded)):
        rec = recorded[t.system]
        worst = max(worst, abs(t.tflops / rec.tflops - 1.0))
        print(f"{t.system:<12} {t.table:<62} {t.shapes:>6} {t.tflops:>8.1f} {rec.tflops:>8.1f} "
              f"{t.tflops / rec.peak_tflops:>7.3f}")
    print(f"largest difference from the recorded medians: {worst:.2%}")
    return 0 if worst <= 0.005 else 1


def redo_deepbench() -> int:
    """Print DeepBench's fits (:data:`DEEPBENCH`) beside the recorded ones; 1 when one differs by more than 1%, 2
    without the table (a flexmesh checkout's bench/data)."""
    if not DEEPBENCH_CSV.exists():
        print(f"DeepBench's table is not at {DEEPBENCH_CSV} (it ships in a flexmesh checkout's bench/data)")
        return 2
    return redo_fits(DEEPBENCH_CSV, lambda path, system, _: fit_deepbench(path, system), DEEPBENCH, GEMM_KERNELS)


def main(argv: list[str] | None = None) -> int:
    rc = redo("python -m flexmesh.cost.device.gemm_tables", __doc__ or "", argv, medians, GEMM_TABLES, fit_gemm,
              GEMM_KERNELS)
    if "--fit" in (sys.argv[1:] if argv is None else argv):
        rc = max(rc, redo_deepbench())
    return rc


if __name__ == "__main__":
    sys.exit(main())
