"""Collective times inside one node from measured NCCL tables: the catalogue's ``presets/collectives.toml`` redone.

NVIDIA's Apache-2.0 ``aiconfigurator-core`` package (``pip install flexmesh[tables]``) ships nccl-tests
timings measured on single nodes of datacenter GPUs (``systems/data/<system>/comm/nccl/<version>/
nccl_perf.parquet``: op, GPUs, message size in elements, dtype, latency in ms; the collector runs
``all_reduce_perf`` and friends one size at a time, so a row's bytes are its elements x 2 for fp16). For
each system this module takes the fp16 rows of the newest NCCL version's table for the ring collectives
the cost model prices from tables (:data:`OPS`), the median where a size was timed more than once, and
writes them to ``flexmesh/spec/presets/collectives.toml``; device presets name their system with
``comm_table`` and :class:`flexmesh.cost.device.hardware.Hardware` interpolates them (docs/cost-model.md).

The engines' own all-reduce kernels come from the same package: aiconfigurator-core times vLLM's and SGLang's custom
all-reduce inside each engine both captured in a CUDA graph and called eagerly, and TensorRT-LLM's allreduce op
(``comm/<framework>/<version>/custom_allreduce_perf.parquet``: bf16, by GPU count and elements). This module takes
each framework's newest table and writes its curves to the same file as the ops ``<framework>_graph`` and
``<framework>_eager`` (TensorRT-LLM's one mode as ``trtllm_graph``); an engine description's ``all_reduce`` names
the one its engine runs (:mod:`flexmesh.cost.inference.analytic`).

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
# Engines whose own all-reduce kernels the tables time (comm/<framework>/.../custom_allreduce_perf.parquet)
ENGINE_ALL_REDUCE = ("vllm", "sglang", "trtllm")
# Systems with NVSwitch nodes like the presets that name them. Not taken: l40s (an 8-GPU all-reduce at
# 1.5 GB/s bus bandwidth, below what PCIe through the host gives: a node without peer-to-peer, not an
# L40S node in general), rtx_pro_6000_server (no preset), the GB200/GB300 and B300 systems (no preset).
SYSTEMS = ("a100_sxm", "h100_sxm", "h200_sxm", "b200_sxm")
RECORDED = Path(__file__).resolve().parents[2] / "spec" / "presets" / "collectives.toml"

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
    return _medians(samples)


def _medians(samples: dict[tuple[str, int, int], list[float]]) -> Curves:
    """(op, GPU count, bytes) -> seconds timed, as curves: per op and GPU count, (bytes, median seconds), sizes
    ascending."""
    out: Curves = {}
    for (op, n, nbytes), times in sorted(samples.items()):
        b, t = out.setdefault(op, {}).setdefault(n, ([], []))
        b.append(nbytes)
        t.append(float(np.median(times)))
    return out


def _with_engines(nccl: Curves, engines: dict[str, tuple[str, Curves]]) -> Curves:
    """A system's NCCL curves and its engines' own all-reduce curves, as one set of ops."""
    return {**nccl, **{op: by_n for _, cs in engines.values() for op, by_n in cs.items()}}


def _engine_op(framework: str, mode: str) -> str | None:
    """The recorded op of an engine table's row mode (``vllm_graph``, ``vLLM_custom_eager``, ``TRTLLM``, ...); None
    for a mode not taken (another framework's kernel timed under this one's, multi-node NVLink variants)."""
    m = mode.lower()
    if framework == "trtllm" or m == "trtllm":
        return "trtllm_graph" if framework == "trtllm" and m == "trtllm" else None
    if m.startswith(framework) or m.startswith(f"{framework}_custom"):
        return f"{framework}_graph" if m.endswith("graph") else f"{framework}_eager" if m.endswith("eager") else None
    return None


def engine_curves(path: Path, framework: str) -> Curves:
    """An engine's all-reduce table as curves per recorded op and GPU count: (bytes, seconds) of its bf16 rows
    (elements x 2), sizes ascending, the seconds the non-decreasing least-squares fit in log time of the rows'
    (SciPy's isotonic regression): the tables time each size once, and a single slow or fast sample (up to 10x
    its neighbours) would otherwise set every larger size's floor."""
    import pyarrow.parquet as pq  # the optional `tables` extra
    from scipy.optimize import isotonic_regression

    d = pq.read_table(path).to_pydict()
    modes = d.get("backend") or d["kernel_source"]
    samples: dict[tuple[str, int, int], list[float]] = {}
    for mode, dt, n, size, ms in zip(modes, d["allreduce_dtype"], d["num_gpus"], d["message_size"], d["latency"]):
        op = _engine_op(framework, str(mode))
        if op and dt == "bfloat16" and ms > 0:
            samples.setdefault((op, int(n), 2 * int(size)), []).append(ms * 1e-3)
    out = _medians(samples)
    for by_n in out.values():
        for n, (b, t) in by_n.items():
            by_n[n] = (b, [float(x) for x in np.exp(isotonic_regression(np.log(t)).x)])
    return out


def engine_tables(systems: Path, system: str) -> dict[str, tuple[str, Curves]]:
    """Per framework of :data:`ENGINE_ALL_REDUCE` with a table of ``system``: the newest version's that has rows
    of its own kernel, its path and curves."""
    from flexmesh.cost.device.gemm_tables import version_key

    out = {}
    for fw in ENGINE_ALL_REDUCE:
        for path in sorted((systems / "data" / system / "comm" / fw).glob("*/custom_allreduce_perf.parquet"),
                           key=version_key, reverse=True):
            cs = engine_curves(path, fw)
            if cs:
                out[fw] = (str(path.relative_to(systems)), cs)
                break
    return out


def to_toml(tables: dict[str, tuple[str, Curves]], engines: dict[str, dict[str, tuple[str, Curves]]]) -> str:
    lines = [
        "# Measured NCCL collectives inside one node, written by `python -m flexmesh.cost.device.comm_tables --write`",
        "# from aiconfigurator-core 0.12.0 (Apache-2.0): nccl-tests on one node of each system, fp16, the",
        "# newest NCCL version's table, the median where a size was timed twice. Per op and GPU count:",
        "# `bytes` the collective's buffer (all-reduce buffer, all-gather output, reduce-scatter input),",
        "# `us` the time of one collective in microseconds. Device presets name a system with `comm_table`.",
        "# Engines' own all-reduce kernels (the ops <framework>_graph and <framework>_eager; `<framework>_table` their",
        "# file): timed inside vLLM and SGLang captured in a CUDA graph and called eagerly, TensorRT-LLM's one mode;",
        "# bf16, the newest version's table of each, each curve its non-decreasing fit (one timing per size).",
    ]
    for system, (table, nccl) in tables.items():
        lines += ["", f"[{system}]", f'table = "{table}"']
        lines += [f'{fw}_table = "{path}"' for fw, (path, _) in engines.get(system, {}).items()]
        for op, by_n in _with_engines(nccl, engines.get(system, {})).items():
            for n, (b, t) in by_n.items():
                lines += [f"[{system}.{op}.{n}]", f"bytes = [{', '.join(str(x) for x in b)}]",
                          f"us = [{', '.join(f'{x * 1e6:.4g}' for x in t)}]"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    systems, write = table_command("python -m flexmesh.cost.device.comm_tables", __doc__ or "", argv, "write",
                                   f"rewrite {RECORDED.name} from the tables")
    if systems is None:
        return 2
    tables, engines = {}, {}
    for s in SYSTEMS:
        path = newest_table(systems, s)
        tables[s] = (str(path.relative_to(systems)), curves(path))
        engines[s] = engine_tables(systems, s)
    if write:
        from flexmesh.files import write_atomic

        write_atomic(RECORDED, to_toml(tables, engines))
        print(f"wrote {RECORDED}")
    from flexmesh.spec.devices import COMM_TABLES  # what the presets read (after --write: as written)

    worst = 0.0
    print(f"{'system':<10} {'op':<15} {'GPUs':>4} {'sizes':>5} {'least us':>9} {'busbw at largest GB/s':>22}")
    for s, (_, nccl) in tables.items():
        for op, by_n in _with_engines(nccl, engines[s]).items():
            for n, (b, t) in by_n.items():
                rb, rt = COMM_TABLES[s].get(op, {}).get(n, ((), ()))  # as read: made non-decreasing in bytes
                same = list(rb) == b
                t = list(np.maximum.accumulate(t))
                worst = max(worst, max(abs(x / y - 1.0) for x, y in zip(t, rt)) if same else float("inf"))
                bus = (2.0 if op == "all_reduce" else 1.0) * (n - 1) / n * b[-1] / t[-1] / 1e9
                print(f"{s:<10} {op:<15} {n:>4} {len(b):>5} {min(t) * 1e6:>9.1f} {bus:>22.0f}")
    print(f"largest difference from the recorded times: {worst:.2%}")
    return 0 if worst <= 0.005 else 1


if __name__ == "__main__":
    sys.exit(main())
