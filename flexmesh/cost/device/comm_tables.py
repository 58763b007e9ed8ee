"""Collective times inside one node from measured NCCL tables: the catalogue's ``presets/collectives.toml`` redone.

NVIDIA's Apache-2.0 ``aiconfigurator-core`` package (``pip install flexmesh[tables]``) ships nccl-tests
timings measured on single nodes of datacenter GPUs (``systems/data/<system>/comm/nccl/<version>/
nccl_perf.parquet``: op, GPUs, message size in elements, dtype, latency in ms; the collector runs
``all_reduce_perf`` and friends one size at a time, so a row's bytes are its elements x 2 for fp16). For
each system this module takes the fp16 rows of the newest NCCL version's table for the ring collectives
the cost model prices from tables (:data:`OPS`), the median where a size was timed more than once, and
writes them to ``flexmesh/spec/presets/collectives.toml``; device presets name their system with
``comm_table`` and :class:`flexmesh.cost.device.hardware.Hardware` interpolates them (docs/cost-model.md).

All-to-all is not taken from the tables: its preset efficiency is fitted to the all-to-all FlexSP
measured inside its training system (flexmesh.cost.training.calibrate), which runs 2.7x below nccl-tests'
``alltoall_perf`` on two A100s; the ring collectives' efficiencies always came from nccl-tests.

Run ``python -m flexmesh.cost.device.comm_tables`` (optionally ``--systems DIR``) to compare the tables with the
recorded file (exit 1 when any time differs by more than 0.5%), ``--write`` to rewrite it. Nothing at
plan or run time reads the parquet tables.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from flexmesh.cost.device.gemm_tables import newest, table_command

OPS = ("all_reduce", "all_gather", "reduce_scatter")
# Systems with NVSwitch nodes like the presets that name them. Not taken: l40s (an 8-GPU all-reduce at
# 1.5 GB/s bus bandwidth, below what PCIe through the host gives: a node without peer-to-peer, not an
# L40S node in general), rtx_pro_6000_server (no preset), the GB200/GB300 and B300 systems (no preset).
SYSTEMS = ("a100_sxm", "h100_sxm", "h200_sxm", "b200_sxm")
RECORDED = Path(__file__).resolve().parent.parent / "spec" / "presets" / "collectives.toml"

Curves = dict[str, dict[int, tuple[list[int], list[float]]]]  # op -> GPUs -> (bytes, seconds)


def newest_table(systems: Path, system: str) -> Path:
    return newest(systems, system, "comm", "nccl_perf.parquet", "NCCL", framework="nccl")


def curves(path: Path) -> Curves:
    """Per op and GPU count: (bytes, median seconds) of the fp16 rows, sizes ascending."""
    import pyarrow.parquet as pq  # the optional `tables` extra

    d = pq.read_table(path, columns=["op_name", "num_gpus", "nccl_dtype", "message_size", "latency"]).to_pydict()
    samples: dict[tuple[str, int, int], list[float]] = {}
    for op, n, dt, size, ms in zip(d["op_name"], d["num_gpus"], d["nccl_dtype"], d["message_size"], d["latency"]):
        if dt == "half" and op in OPS and ms > 0:
            samples.setdefault((op, int(n), 2 * int(size)), []).append(ms * 1e-3)
    out: Curves = {}
    for (op, n, nbytes), times in sorted(samples.items()):
        b, t = out.setdefault(op, {}).setdefault(n, ([], []))
        b.append(nbytes)
        t.append(float(np.median(times)))
    return out


def to_toml(tables: dict[str, tuple[str, Curves]]) -> str:
    lines = [
        "# Measured NCCL collectives inside one node, written by `python -m flexmesh.cost.device.comm_tables --write`",
        "# from aiconfigurator-core 0.12.0 (Apache-2.0): nccl-tests on one node of each system, fp16, the",
        "# newest NCCL version's table, the median where a size was timed twice. Per op and GPU count:",
        "# `bytes` the collective's buffer (all-reduce buffer, all-gather output, reduce-scatter input),",
        "# `us` the time of one collective in microseconds. Device presets name a system with `comm_table`.",
    ]
    for system, (table, cs) in tables.items():
        lines += ["", f"[{system}]", f'table = "{table}"']
        for op, by_n in cs.items():
            for n, (b, t) in by_n.items():
                lines += [f"[{system}.{op}.{n}]", f"bytes = [{', '.join(str(x) for x in b)}]",
                          f"us = [{', '.join(f'{x * 1e6:.4g}' for x in t)}]"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    systems, write = table_command("python -m flexmesh.cost.device.comm_tables", __doc__ or "", argv, "write",
                                   f"rewrite {RECORDED.name} from the tables")
    if systems is None:
        return 2
    tables = {}
    for s in SYSTEMS:
        path = newest_table(systems, s)
        tables[s] = (str(path.relative_to(systems)), curves(path))
    if write:
        from flexmesh.files import write_atomic

        write_atomic(RECORDED, to_toml(tables))
        print(f"wrote {RECORDED}")
    from flexmesh.spec.devices import COMM_TABLES  # what the presets read (after --write: as written)

    worst = 0.0
    print(f"{'system':<10} {'op':<15} {'GPUs':>4} {'sizes':>5} {'least us':>9} {'busbw at largest GB/s':>22}")
    for s, (_, cs) in tables.items():
        for op, by_n in cs.items():
            for n, (b, t) in by_n.items():
                rb, rt = COMM_TABLES[s][op][n]  # as the presets read them: made non-decreasing in bytes
                same = list(rb) == b
                t = list(np.maximum.accumulate(t))
                worst = max(worst, max(abs(x / y - 1.0) for x, y in zip(t, rt)) if same else float("inf"))
                bus = (2.0 if op == "all_reduce" else 1.0) * (n - 1) / n * b[-1] / t[-1] / 1e9
                print(f"{s:<10} {op:<15} {n:>4} {len(b):>5} {min(t) * 1e6:>9.1f} {bus:>22.0f}")
    print(f"largest difference from the recorded times: {worst:.2%}")
    return 0 if worst <= 0.005 else 1


if __name__ == "__main__":
    sys.exit(main())
