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

Run ``python -m flexmesh.cost.device.gemm_tables`` (optionally ``--systems DIR``, the package's ``systems``
folder) to print the medians beside the recorded ones; it exits 1 when they differ by more than 0.5%.
Nothing at plan or run time reads the tables.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from flexmesh.spec.devices import GEMM_TABLES, KernelTable

FRAMEWORK = "vllm"
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


def newest_table(systems: Path, system: str) -> Path:
    found = sorted((systems / "data" / system / "gemm" / FRAMEWORK).glob("*/gemm_perf.parquet"), key=version_key)
    if not found:
        raise FileNotFoundError(f"no {FRAMEWORK} GEMM table for {system} under {systems}")
    return found[-1]


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


def redo(prog: str, doc: str, argv: list[str] | None,
         measure: Callable[[Path, list[str]], list[TableMedian]], recorded: dict[str, KernelTable]) -> int:
    """The command line of a table module: ``measure`` the installed (or ``--systems``) tables, print
    each system's median beside ``recorded``; exit 1 when one differs by more than 0.5%, 2 without the
    tables."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument("--systems", type=Path, help="aiconfigurator-core's systems folder (default: the installed one)")
    args = p.parse_args(argv)
    systems = args.systems or systems_dir()
    if systems is None:
        print("aiconfigurator-core is not installed: pip install 'flexmesh[tables]' (or pass --systems DIR)")
        return 2
    worst = 0.0
    print(f"{'system':<12} {'table':<62} {'shapes':>6} {'TFLOP/s':>8} {'recorded':>8} {'of peak':>7}")
    for t in measure(systems, sorted(recorded)):
        rec = recorded[t.system]
        worst = max(worst, abs(t.tflops / rec.tflops - 1.0))
        print(f"{t.system:<12} {t.table:<62} {t.shapes:>6} {t.tflops:>8.1f} {rec.tflops:>8.1f} "
              f"{t.tflops / rec.peak_tflops:>7.3f}")
    print(f"largest difference from the recorded medians: {worst:.2%}")
    return 0 if worst <= 0.005 else 1


def main(argv: list[str] | None = None) -> int:
    return redo("python -m flexmesh.cost.device.gemm_tables", __doc__ or "", argv, medians, GEMM_TABLES)


if __name__ == "__main__":
    sys.exit(main())
