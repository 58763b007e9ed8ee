"""A decoder layer's work outside attention, flexmesh's device layer against Vidur's measured operators.

Vidur (Agrawal et al., "Vidur: A Large-Scale Simulation Framework for LLM Inference", MLSys 2024;
github.com/microsoft/vidur, MIT licence) publishes operator times profiled on A100 and H100 per model and token
count (``data/profiling/compute/<gpu>/<model>/mlp.csv``). ``bench/data/vidur_mlp_tp1.csv`` holds the rows of
tensor parallelism 1 for Llama-2-7B (A100, H100) and Llama-3-8B (A100), each operator's median; the licence is
``bench/data/vidur_LICENSE``. A layer outside attention is, as Vidur composes it
(``vidur/entities/execution_time.py``): the two norms, the QKV and output projections, rotary, the up and down
projections, the activation and the residual add. flexmesh's is :class:`flexmesh.cost.inference.analytic.
AnalyticIteration`'s per-layer dense term without its all-reduces (tp 1 has none): the four GEMMs at
``tokens`` rows at the device layer's kernels and the pointwise bytes. No flexmesh constant was fitted to these
rows: every row is held out. Target: median ``|predicted / measured - 1|`` <= 15% per GPU type.

Vidur's attention profiles (``attention.csv``, prefill and decode attention) are not in the stored copy of its
repository, so whole prefill and decode iterations are not composed here: this scores the part of an iteration
the GEMMs and pointwise operators make (all of a short-context decode's time but its attention, KV writes,
LM head and engine overhead).

Usage: ``python -m bench.vidur_layers [--no-record]``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

from bench._results import markdown_table, record
from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.inference.analytic import LAYER_POINTWISE_KERNELS, AnalyticIteration
from flexmesh.spec import MODEL_PRESETS
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.devices import DEVICE_PRESETS

DEPENDS_ON = ("flexmesh/cost", "flexmesh/spec", "flexmesh/errors.py", "flexmesh/files.py", "flexmesh/inputs.py",
              "flexmesh/units.py", "bench/data/vidur_mlp_tp1.csv")
DATA = Path(__file__).parent / "data" / "vidur_mlp_tp1.csv"
BOUND = 0.15
# Vidur's profiling machines (its paper: DGX A100 80GB and DGX H100) and models, as flexmesh names them
PARTS = {"a100": "A100-80GB", "h100": "H100-80GB"}
MODELS = {"meta-llama/Llama-2-7b-hf": "llama2-7b", "meta-llama/Meta-Llama-3-8B": "llama3-8b"}


def measured() -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """(gpu, model) -> token counts and the layer's measured seconds outside attention."""
    rows: dict[tuple[str, str], list[tuple[int, float]]] = {}
    with DATA.open() as f:
        for r in csv.DictReader(line for line in f if not line.startswith("#")):
            ms = sum(float(v) for k, v in r.items() if k.endswith("_ms"))
            rows.setdefault((r["gpu"], r["model"]), []).append((int(r["num_tokens"]), ms * 1e-3))
    return {k: (np.array([t for t, _ in v], dtype=float), np.array([s for _, s in v])) for k, v in rows.items()}


def predicted(model: str, part: str, tokens: np.ndarray, training: bool = False) -> np.ndarray:
    """flexmesh's seconds of one layer outside attention at ``tokens`` (``training``: at a training step's
    kernels, what serving priced with before the device layer's)."""
    it = AnalyticIteration(MODEL_PRESETS[model], Hardware(ClusterSpec(1, 1, DEVICE_PRESETS[part])))
    k = it.hw.kernels if training else it.kernels
    t = sum(k.gemm(tokens, n, red) for n, red in it.shapes)
    return t + k.memory_bound(tokens * it.pointwise_bytes, LAYER_POINTWISE_KERNELS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    args = ap.parse_args(argv)
    by_gpu: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    rows = []
    for (gpu, model), (tokens, secs) in sorted(measured().items()):
        part, name = PARTS[gpu], MODELS[model]
        after, before = predicted(name, part, tokens), predicted(name, part, tokens, training=True)
        by_gpu.setdefault(gpu, []).append((after / secs - 1.0, before / secs - 1.0, tokens))
        small, large = tokens <= 256, tokens >= 4096
        rows.append([part, name, str(len(tokens)), f"{np.median(np.abs(before / secs - 1)):.1%}",
                     f"{np.median(np.abs(after / secs - 1)):.1%}", f"{np.median(after[small] / secs[small] - 1):+.1%}",
                     f"{np.median(after[large] / secs[large] - 1):+.1%}"])
    verdicts = []
    for gpu, parts in sorted(by_gpu.items()):
        err = float(np.median(np.abs(np.concatenate([a for a, _, _ in parts]))))
        verdicts.append(f"{PARTS[gpu]} {err:.1%} {'PASS' if err <= BOUND else 'FAIL'}")
    md = ["A decoder layer outside attention (norms, QKV and output projections, rotary, up and down projections, "
          "activation, residual add) at tensor parallelism 1: flexmesh's device layer against the sum of Vidur's "
          "measured operator medians (MLSys 2024, microsoft/vidur, MIT; bench/data/vidur_mlp_tp1.csv), every token "
          "count Vidur profiled. No constant was fitted to these rows. Before: a training step's kernels (what "
          "serving priced with until now); after: the device layer's (`Hardware.device_kernels`). Signed medians "
          f"show the bias at decode-sized (<= 256 tokens) and prefill-sized (>= 4096) batches. Target: median "
          f"error <= {BOUND:.0%} per GPU type. Vidur's attention profiles are not in the stored copy of its "
          "repository: whole iterations are not composed.", "",
          *markdown_table(["part", "model", "token counts", "median error before", "median error after",
                           "after, <= 256 tokens (signed)", "after, >= 4096 tokens (signed)"], rows), "",
          "Per GPU type (after): " + "; ".join(verdicts) + "."]
    print("\n".join(md))
    headline = "layer outside attention vs Vidur's operators, median error: " + "; ".join(verdicts)
    print(headline)
    if not args.no_record:
        record("vidur_layers", "\n".join(md), headline=headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
