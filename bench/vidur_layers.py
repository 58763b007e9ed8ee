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

Per operator, each Vidur column against the device layer's price of the same work: the four GEMMs at the device
layer's kernels, and each pointwise operator as one streaming kernel (:meth:`Kernels.memory_bound`) moving the
elements sarathi-serve's kernels move (Vidur profiles those: ``vidur/profiling/mlp/mlp_impl.py``): each RMSNorm
reads and writes its row (its kernel reads the row twice, the second time from cache), rotary reads and writes q
and k in place, SiLU-and-mul reads gate and up and writes the activation, the residual add reads two rows and
writes one. Beside each, the rate Vidur's kernel reached at its largest token count (a pointwise operator's bytes
over its time as a fraction of the datasheet HBM bandwidth; a GEMM's FLOPs over its time as a fraction of peak),
and, where aiconfigurator-core's tables are installed, Vidur's GEMM times over the tables' at the very same shapes:
the two measurements the layer's GEMMs are scored between.

What the breakdown shows: the four GEMMs make about nine tenths of the layer's time and carry its error (with
Vidur's own GEMM times in place of the device layer's, the layer is within a few percent); Vidur's large GEMMs run
slower than aiconfigurator-core measured the same shapes (its tables are what the device layer's GEMM constants
are fitted to), which no constant fitted to the tables can follow. The pointwise operators miss by more, but weigh
little: sarathi-serve's RMSNorm, rotary and SiLU-and-mul kernels load one scalar at a time in one block per token
and reach a third to a half of the HBM bandwidth, where its vectorised PyTorch add reaches about nine tenths (the
device layer's streaming rate, ``flexmesh.cost.device.kernels.HBM_EFFICIENCY``).

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
from flexmesh.cost.device.kernels import HBM_EFFICIENCY
from flexmesh.cost.device.layer_shapes import pointwise_elems
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
# Vidur's operators in a layer's order; the GEMMs by their place in flexmesh.cost.device.layer_shapes.linear_shapes
OPERATORS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
GEMMS = {"attn_pre_proj": 0, "attn_post_proj": 1, "mlp_up_proj": 2, "mlp_down_proj": 3}
ADD_ELEMS = 3  # the residual add: reads two rows of the hidden size, writes one


def measured_operators() -> dict[tuple[str, str], tuple[np.ndarray, dict[str, np.ndarray]]]:
    """(gpu, model) -> token counts and each operator's measured seconds (Vidur's median)."""
    rows: dict[tuple[str, str], list[dict[str, str]]] = {}
    with DATA.open() as f:
        for r in csv.DictReader(line for line in f if not line.startswith("#")):
            rows.setdefault((r["gpu"], r["model"]), []).append(r)
    return {k: (np.array([float(r["num_tokens"]) for r in v]),
                {op: np.array([float(r[f"{op}_ms"]) * 1e-3 for r in v]) for op in OPERATORS})
            for k, v in rows.items()}


def measured() -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """(gpu, model) -> token counts and the layer's measured seconds outside attention."""
    return {k: (tokens, sum(ops.values(), np.zeros_like(tokens))) for k, (tokens, ops) in measured_operators().items()}


def operator_elems(model: str) -> dict[str, int]:
    """Elements each of Vidur's pointwise operators moves per token, read and write counted (see the module doc)."""
    m = MODEL_PRESETS[model]
    p = pointwise_elems(m)
    return {"input_layernorm": p.norms // 2, "post_attention_layernorm": p.norms // 2, "attn_rope": p.rotary,
            "mlp_act": p.activation, "add": ADD_ELEMS * m.hidden}


def predicted_operators(model: str, part: str, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """flexmesh's device layer's seconds of each of Vidur's operators at ``tokens``: the GEMMs at their kernels,
    each pointwise operator one streaming kernel moving :func:`operator_elems`."""
    it = AnalyticIteration(MODEL_PRESETS[model], Hardware(ClusterSpec(1, 1, DEVICE_PRESETS[part])))
    k, b = it.kernels, MODEL_PRESETS[model].dtype_bytes
    out = {op: k.gemm(tokens, *it.shapes[i]) for op, i in GEMMS.items()}
    out.update({op: k.memory_bound(tokens * e * b) for op, e in operator_elems(model).items()})
    return out


def achieved(model: str, part: str, op: str, tokens: float, secs: float) -> float:
    """The fraction of the datasheet rate an operator of ``tokens`` reached in ``secs``: a GEMM's of peak FLOP/s,
    a pointwise operator's of the HBM bandwidth."""
    m, d = MODEL_PRESETS[model], DEVICE_PRESETS[part]
    if op in GEMMS:
        n, red = AnalyticIteration(m, Hardware(ClusterSpec(1, 1, d))).shapes[GEMMS[op]]
        return 2.0 * tokens * n * red / secs / d.peak_flops("bf16")
    return tokens * operator_elems(model)[op] * m.dtype_bytes / secs / (d.hbm_gbps * 1e9)


def table_ratios(part: str, model: str, tokens: np.ndarray, ops: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per GEMM, Vidur's seconds over aiconfigurator-core's vLLM table's at each token count the table measured at
    the same shape (NaN elsewhere); empty without the optional tables."""
    try:
        from flexmesh.cost.device.gemm_tables import gemm_rows, newest_table, systems_dir
        systems = systems_dir()
        if systems is None:
            return {}
        rows = gemm_rows(newest_table(systems, DEVICE_PRESETS[part].kernel_table))
    except (ImportError, FileNotFoundError):
        return {}
    table = {(int(m), int(n), int(k)): s for m, n, k, s in rows}
    shapes = AnalyticIteration(MODEL_PRESETS[model], Hardware(ClusterSpec(1, 1, DEVICE_PRESETS[part]))).shapes
    return {op: np.array([ops[op][j] / table[key] if (key := (int(t), int(shapes[i][0]), int(shapes[i][1]))) in table
                          else np.nan for j, t in enumerate(tokens)]) for op, i in GEMMS.items()}


def swapped() -> dict[str, tuple[float, float]]:
    """Per GPU type, the layer's median error with Vidur's GEMM times in place of the device layer's, and with
    Vidur's pointwise operators' times in place of the device layer's pointwise term."""
    errs: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for (gpu, model), (tokens, ops) in sorted(measured_operators().items()):
        it = AnalyticIteration(MODEL_PRESETS[MODELS[model]], Hardware(ClusterSpec(1, 1, DEVICE_PRESETS[PARTS[gpu]])))
        k, secs = it.kernels, sum(ops.values())
        gemms = sum(k.gemm(tokens, n, red) for n, red in it.shapes)
        pointwise = k.memory_bound(tokens * it.pointwise_bytes, LAYER_POINTWISE_KERNELS)
        vidur_gemms = sum(ops[op] for op in GEMMS)
        e = errs.setdefault(gpu, ([], []))
        e[0].append((vidur_gemms + pointwise) / secs - 1.0)
        e[1].append((gemms + secs - vidur_gemms) / secs - 1.0)
    return {gpu: (float(np.median(np.abs(np.concatenate(a)))), float(np.median(np.abs(np.concatenate(b)))))
            for gpu, (a, b) in errs.items()}


def operator_rows() -> tuple[list[list[str]], bool]:
    """The per-operator table's rows, per GPU type (its models pooled), and whether aiconfigurator's tables
    were read."""
    by_gpu: dict[str, list[tuple[str, np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]]] = {}
    for (gpu, model), (tokens, ops) in sorted(measured_operators().items()):
        by_gpu.setdefault(gpu, []).append((model, tokens, ops, predicted_operators(MODELS[model], PARTS[gpu], tokens)))
    rows, tables = [], False
    for gpu, parts in sorted(by_gpu.items()):
        part = PARTS[gpu]
        ratios = [table_ratios(part, MODELS[model], tokens, ops) for model, tokens, ops, _ in parts]
        tables = tables or any(ratios)
        layer = sum(float(sum(v.sum() for v in ops.values())) for _, _, ops, _ in parts)
        for op in OPERATORS:
            tokens = np.concatenate([t for _, t, _, _ in parts])
            err = np.concatenate([p[op] / ops[op] - 1.0 for _, _, ops, p in parts])
            small, large = tokens <= 256, tokens >= 4096
            rate = np.median([achieved(MODELS[model], part, op, float(t[-1]), float(ops[op][-1]))
                              for model, t, ops, _ in parts])
            cells = [part, op, f"{sum(float(ops[op].sum()) for _, _, ops, _ in parts) / layer:.1%}",
                     f"{np.median(np.abs(err)):.1%}", f"{np.median(err[small]):+.1%}", f"{np.median(err[large]):+.1%}",
                     f"{rate:.0%} of {'peak' if op in GEMMS else 'HBM'}"]
            r = np.concatenate([x[op] for x in ratios]) if op in GEMMS and all(ratios) else np.array([])
            ok = ~np.isnan(r)
            cells.append("" if not ok.any() else
                         f"{np.median(r[ok & small]):.2f} / {np.median(r[ok & (tokens >= 1024)]):.2f}"
                         if (ok & small).any() and (ok & (tokens >= 1024)).any() else f"{np.median(r[ok]):.2f}")
            rows.append(cells)
    return rows, tables


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
    op_rows, tables = operator_rows()
    md += ["", "Per operator (each GPU type's models pooled): the operator's share of the measured layer time, the "
           "device layer's error on it (pointwise operators each one streaming kernel moving the elements "
           "sarathi-serve's kernels move, priced at "
           f"{HBM_EFFICIENCY:.0%} of the HBM bandwidth; the largest GEMMs at "
           + ", ".join(f"{DEVICE_PRESETS[p].kernel_mm_efficiency:.0%} of peak on {p}" for p in PARTS.values())
           + "), the rate Vidur's kernel reached at its largest token count"
           + (", and Vidur's GEMM time over aiconfigurator-core's vLLM table's at the same shape (median at <= 256 / "
              ">= 1024 tokens, the counts both measured)" if tables else
              " (aiconfigurator-core not installed: no same-shape comparison of the GEMMs)") + ".", "",
           *markdown_table(["part", "operator", "share of layer", "median error", "<= 256 tokens (signed)",
                            ">= 4096 tokens (signed)", "Vidur's rate, most tokens",
                            "Vidur / aiconfigurator, same shape"], op_rows), "",
           "The layer's median error with Vidur's GEMM times in place of the device layer's | with Vidur's pointwise "
           "operators' times in place of its pointwise term: " + "; ".join(
               f"{PARTS[gpu]} {g:.1%} | {pw:.1%}" for gpu, (g, pw) in sorted(swapped().items())) + "."]
    print("\n".join(md))
    headline = "layer outside attention vs Vidur's operators, median error: " + "; ".join(verdicts)
    print(headline)
    if not args.no_record:
        record("vidur_layers", "\n".join(md), headline=headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
