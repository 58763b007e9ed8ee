"""Tensor-parallel scaling of a decoder layer: flexmesh's prices against Vidur's per-GPU measurements at tp 1, 2, 4.

Vidur (Agrawal et al., "Vidur: A Large-Scale Simulation Framework for LLM Inference", MLSys 2024;
github.com/microsoft/vidur, MIT licence, ``bench/data/vidur_LICENSE``) profiles each operator of a layer outside
attention on one GPU's shard at tensor parallelism 1, 2, 4 and 8 (``bench/data/vidur_mlp_tp.csv``: Llama-2-70B on
A100 and H100, Llama-3-70B on A100) and NCCL's all-reduce over 2 and 4 GPUs by message size
(``bench/data/vidur_allreduce.csv``) on two kinds of node: DGX (NVSwitch) and four GPUs in NVLink-bridged pairs with
PCIe between the pairs (Azure NC96ads_A100_v4 for A100; Vidur uses one compute profile for both, its docs say). A
layer at tp ``t`` is, as Vidur composes it (``vidur/entities/execution_time.py``), its operators at ``t``'s shard
plus two all-reduces of ``tokens x hidden`` fp16 values (after the attention output and the MLP down projections;
none at tp 1), the all-reduce interpolated log-log between the sizes measured. flexmesh's:
:class:`~flexmesh.cost.inference.analytic.AnalyticIteration`'s per-layer dense term on a node of the part (its GEMMs
at the per-GPU shape through the measured GEMM form, the pointwise operators of which norms do not shrink with tp,
and the two all-reduces over the node's links as the device layer prices them): the SXM part in a DGX, or the same
part with the links of the catalogue's PCIe part (NVLink bridges between pairs, PCIe beyond; no measured NCCL table,
so NCCL's own tuning model's latencies: ``flexmesh.cost.device.hardware.nccl_ring_time``) for the bridged node. The
speedup of tp ``t`` is the layer at tp 1 over the layer at tp ``t``, per token count; decode-sized steps are 8 to 64
tokens, prefill-sized 1024 to 4096. No constant was fitted to these rows.

Vidur timed each all-reduce as one eager ``torch.distributed`` call, back to back (``vidur/profiling/collectives``:
eleven calls, CUDA graphs off, each NCCL kernel's time by the PyTorch profiler): a host-bound loop, where each rank's
kernel starts when its host launches it and waits for the slowest rank's (NCCL's maintainers on such timings,
NVIDIA/nccl#701), so a decode-sized all-reduce measured 40-60 us where nccl-tests' back-to-back kernels take 10-20.
Each row is therefore priced two ways: with the device layer's all-reduce (nccl-tests' kernel time; what a CUDA
graph replays), and as the device layer prices NCCL called eagerly (``Hardware.engine_all_reduce``): that kernel
time, but at least the node's measured host work per call (``Hardware.eager_floor``: aiconfigurator-core's all-reduce
called eagerly inside vLLM, ``vllm_eager`` in presets/collectives.toml, its smallest message's time, 45 us on the
A100 node and 23 us on the H100 one, measured with another kernel than Vidur's NCCL; nodes without that table keep
the kernel time). The verdict is on the eager pricing, the
way Vidur's all-reduces ran; the kernel pricing is beside it. Attention
(its heads split evenly by tp on both sides) and the engine's per-iteration CPU time are left out: the first scales
by tp alone, the second is the engine description's (``multi_gpu_ms``), not the device layer's.

Usage: ``python -m bench.tp_scaling [--no-record]``.
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np

from bench._results import markdown_table, record
from bench.vidur_layers import operator_sums
from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.inference.analytic import LAYER_POINTWISE_KERNELS, AnalyticIteration
from flexmesh.spec import MODEL_PRESETS
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.devices import DEVICE_PRESETS

DEPENDS_ON = ("flexmesh/cost", "flexmesh/spec", "flexmesh/errors.py", "flexmesh/files.py", "flexmesh/inputs.py",
              "flexmesh/units.py", "bench/vidur_layers.py", "bench/data/vidur_mlp_tp.csv",
              "bench/data/vidur_allreduce.csv")
DATA = Path(__file__).parent / "data"
BOUND = 0.15
PARTS = {"a100": "A100-80GB", "h100": "H100-80GB"}  # Vidur's DGX A100 80GB and DGX H100
# Vidur's nodes: (gpu, node kind) -> its all-reduce table and the catalogue part whose links the node has
NODES = {("a100", "nvswitch"): ("a100_dgx", "A100-80GB"), ("h100", "nvswitch"): ("h100_dgx", "H100-80GB"),
         ("a100", "bridged pairs"): ("a100_pairwise_nvlink", "A100-PCIe-80GB"),
         ("h100", "bridged pairs"): ("h100_pairwise_nvlink", "H100-PCIe")}
LINK_FIELDS = ("intra_link", "nvlink_gbps", "nvlink_domain", "pcie_gbps", "intra_latency_us")
MODELS = {"Llama-2-70b-hf": "llama2-70b", "Meta-Llama-3-70B": "llama3-70b"}
DEGREES = (2, 4)
DECODE, PREFILL = (8, 64), (1024, 4096)  # token counts of each kind of step


def _rows(name: str) -> list[dict[str, str]]:
    with open(DATA / name) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


@cache
def measured_ops() -> dict[tuple[str, str, int], dict[int, float]]:
    """(gpu, model, tp) -> token count -> the operators' summed seconds (Vidur's medians)."""
    return {k: dict(zip(tokens.astype(int).tolist(), secs.tolist()))
            for k, (tokens, secs) in operator_sums(DATA / "vidur_mlp_tp.csv", "gpu", "model", "tp").items()}


@cache
def measured_allreduce() -> dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]:
    """(Vidur's node, GPUs) -> message bytes and seconds."""
    raw: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in _rows("vidur_allreduce.csv"):
        raw.setdefault((r["node"], int(r["gpus"])), []).append((float(r["bytes"]), float(r["ms"]) * 1e-3))
    return {k: (np.array([b for b, _ in v]), np.array([s for _, s in v])) for k, v in
            ((k, sorted(v)) for k, v in raw.items())}


def allreduce_s(node: str, tp: int, nbytes: float) -> float:
    sizes, secs = measured_allreduce()[node, tp]
    return float(np.exp(np.interp(np.log(nbytes), np.log(sizes), np.log(secs))))


def measured_allreduces(node: str, model: str, tp: int, tokens: int) -> float:
    """A layer's two all-reduces at tp, as measured (none at tp 1)."""
    return 2 * allreduce_s(node, tp, tokens * MODEL_PRESETS[MODELS[model]].hidden * 2) if tp > 1 else 0.0


def measured_layer(gpu: str, node: str, model: str, tp: int, tokens: int) -> float:
    return measured_ops()[gpu, model, tp][tokens] + measured_allreduces(node, model, tp, tokens)


@cache
def _iteration(model: str, gpu: str, kind: str, tp: int) -> AnalyticIteration:
    """The part of ``gpu`` on a node of ``kind``: the DGX part itself, or it with the PCIe part's links."""
    d = DEVICE_PRESETS[PARTS[gpu]]
    if kind != "nvswitch":
        links = DEVICE_PRESETS[NODES[gpu, kind][1]]
        d = replace(d, comm_table="", **{f: getattr(links, f) for f in LINK_FIELDS})
    return AnalyticIteration(MODEL_PRESETS[model], Hardware(ClusterSpec(1, 4, d)), tp)


def predicted_layer(gpu: str, kind: str, model: str, tp: int, tokens: int, eager: bool = False) -> tuple[float, float]:
    """flexmesh's seconds of the layer outside attention, and of its two all-reduces: NCCL's as a CUDA graph replays
    it (nccl-tests' kernel time), or ``eager``, called eagerly (at least the node's measured host work per call,
    ``Hardware.eager_floor``)."""
    it = _iteration(MODELS[model], gpu, kind, tp)
    k = it.kernels
    nbytes = tokens * it.hidden_bytes
    ar = 2 * float(it.hw.engine_all_reduce("nccl", not eager, nbytes, it.tp_shape)) if tp > 1 else 0.0
    return float(sum(k.gemm(tokens, n, red) for n, red in it.shapes)
                 + k.memory_bound(tokens * it.pointwise_bytes, LAYER_POINTWISE_KERNELS) + ar), ar


def cases() -> list[dict]:
    out = []
    for (gpu, model, tp), by_tokens in sorted(measured_ops().items()):
        for (g, kind), (node, _) in NODES.items():
            if g != gpu or tp not in DEGREES or (node, tp) not in measured_allreduce():
                continue
            for tokens in sorted(by_tokens):
                step = "decode" if DECODE[0] <= tokens <= DECODE[1] else \
                    "prefill" if PREFILL[0] <= tokens <= PREFILL[1] else None
                if step is None or tokens not in measured_ops()[gpu, model, 1]:
                    continue
                m1, mt = (measured_layer(gpu, node, model, t, tokens) for t in (1, tp))
                p1, _ = predicted_layer(gpu, kind, model, 1, tokens)  # no all-reduce at tp 1, eager or not
                (pt, par), (et, ear) = (predicted_layer(gpu, kind, model, tp, tokens, eager=e) for e in (False, True))
                mar = measured_allreduces(node, model, tp, tokens)
                out.append({"gpu": gpu, "node": kind, "model": model, "tp": tp, "tokens": tokens, "kind": step,
                            "measured": m1 / mt, "predicted": p1 / pt, "eager": p1 / et, "layer_error": et / mt - 1,
                            "allreduce_error": ear / mar - 1, "kernel_allreduce_error": par / mar - 1,
                            "measured_ar_us": mar * 1e6, "predicted_ar_us": par * 1e6, "eager_ar_us": ear * 1e6})
    return out


def _median(cs: list[dict], gpu: str, tp: int, key: str) -> float:
    return float(np.median([c[key] for c in cs if c["gpu"] == gpu and c["tp"] == tp]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    args = ap.parse_args(argv)
    rows, verdicts, kernel_verdicts, worst = [], [], [], 0.0
    groups: dict[tuple[str, str, str, int, str], list[dict]] = {}
    every = cases()
    for c in every:
        groups.setdefault((c["gpu"], c["node"], c["model"], c["tp"], c["kind"]), []).append(c)
    for (gpu, node, model, tp, kind), cs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "nvswitch",
                                                                                   *kv[0][2:])):
        meas = float(np.median([c["measured"] for c in cs]))
        pred, eager = (float(np.median([c[key] for c in cs])) for key in ("predicted", "eager"))
        err, kernel_err = (float(np.median([abs(c[key] / c["measured"] - 1) for c in cs]))
                           for key in ("eager", "predicted"))
        worst = max(worst, err)
        ok = err <= BOUND
        verdicts.append(ok)
        kernel_verdicts.append(kernel_err <= BOUND)
        rows.append([PARTS[gpu], node, MODELS[model], f"tp{tp}", kind, str(len(cs)), f"{meas:.2f}x", f"{eager:.2f}x",
                     f"{err:.1%} {'PASS' if ok else 'FAIL'}",
                     f"{np.median([c['layer_error'] for c in cs]):+.1%}",
                     f"{np.median([c['allreduce_error'] for c in cs]):+.1%}", f"{pred:.2f}x ({kernel_err:.1%})",
                     f"{np.median([c['kernel_allreduce_error'] for c in cs]):+.1%}"])
    md = ["Tensor-parallel speedup of a decoder layer outside attention on A100 and H100 nodes of two kinds (NVSwitch; "
          "NVLink-bridged pairs with PCIe between them): "
          "Vidur's per-GPU operator profiles plus its measured NCCL all-reduces (MLSys 2024, microsoft/vidur, MIT; "
          "bench/data/vidur_mlp_tp.csv, vidur_allreduce.csv) against flexmesh's device layer, no constant fitted to "
          "these rows. Decode: steps of 8 to 64 tokens; prefill: 1024 to 4096. Each row: the median measured and "
          "predicted speedup over tp 1 with each all-reduce priced as an eager call (Vidur's were: the module doc; "
          "nccl-tests' kernel time, at least aiconfigurator-core's floor of an eagerly called all-reduce on the node "
          "where it has one), the median |predicted / measured - 1| of the speedup per token count "
          f"(bound {BOUND:.0%}), the signed median error of the layer at that tp and of its two all-reduces "
          "alone; then the same with the device layer's all-reduce (nccl-tests' kernel time, as a CUDA graph "
          "replays it).", "",
          *markdown_table(["part", "node", "model", "tp", "steps", "token counts", "measured speedup",
                           "predicted, eager calls", "speedup error", "layer error at tp", "all-reduce error",
                           "predicted, kernel time (error)", "kernel all-reduce error"], rows)]
    small = [c for c in every if c["kind"] == "decode" and c["node"] == "nvswitch"]
    pairs = sorted({(c["gpu"], c["tp"]) for c in small})
    md += ["", "Decode-sized all-reduces on NVSwitch (the two per layer, 8 to 64 tokens): measured "
           + ", ".join(f"{PARTS[g]} tp{t} {_median(small, g, t, 'measured_ar_us'):.0f} us" for g, t in pairs)
           + " against an eager call's " + ", ".join(f"{_median(small, g, t, 'eager_ar_us'):.0f} us" for g, t in pairs)
           + " and nccl-tests' kernel time " + ", ".join(f"{_median(small, g, t, 'predicted_ar_us'):.0f} us"
                                                         for g, t in pairs) + "."]
    body = "\n".join(md)
    print(body)
    if not args.no_record:
        record("tp_scaling", body, headline=f"tp speedups within {BOUND:.0%}: {sum(verdicts)} of {len(verdicts)} "
               f"with each all-reduce an eager call as Vidur timed them (worst median error {worst:.1%}); "
               f"{sum(kernel_verdicts)} of {len(kernel_verdicts)} at nccl-tests' kernel time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
