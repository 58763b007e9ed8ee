"""A decoder layer outside attention, and whole A100 iterations: flexmesh's device layer against Vidur's measurements.

Vidur (Agrawal et al., "Vidur: A Large-Scale Simulation Framework for LLM Inference", MLSys 2024;
github.com/microsoft/vidur, MIT licence) publishes operator times profiled on A100 and H100 per model and token
count (``data/profiling/compute/<gpu>/<model>/mlp.csv``). ``bench/data/vidur_mlp_tp1.csv`` holds the rows of
tensor parallelism 1 for Llama-2-7B (A100, H100) and Llama-3-8B (A100), each operator's median; the licence is
``bench/data/vidur_LICENSE``. A layer outside attention is, as Vidur composes it
(``vidur/entities/execution_time.py``): the two norms, the QKV and output projections, rotary, the up and down
projections, the activation and the residual add. flexmesh's is :class:`flexmesh.cost.inference.analytic.
AnalyticIteration`'s per-layer dense term without its all-reduces (tp 1 has none): the four GEMMs at
``tokens`` rows at the device layer's kernels and the pointwise bytes. No device-layer constant was fitted to
these rows.

Whole iterations (A100-80GB, Llama-2-7B, tensor parallelism 1 only). Vidur's attention profile
(``attention.csv``: per layer, the decode attention of ``batch_size`` requests of ``kv_cache_size`` cached tokens
each, or the prefill attention of one chunk of ``prefill_chunk_size`` tokens after ``kv_cache_size`` cached ones,
and the reshapes around either) is in git LFS in microsoft/vidur; a plain-text copy of the A100 Llama-2-7B one is in
github.com/sw5sh/cs378-assignment3 (commit 7ac2fe9), sampled into ``bench/data/vidur_attention_a100_llama2_7b_tp1.csv``
(its header says at which character offsets). The H100 profile is an LFS pointer wherever it is stored: no H100
iterations. An iteration is composed as Vidur's ``ExecutionTime.model_time`` composes it: ``num_layers`` x (the layer
outside attention at the step's tokens, ``B`` decodes or ``P`` prefill tokens, + the attention at ``(B, C)`` or
``(P, K)``), Vidur's side from its measured medians (the layer outside attention interpolated linearly between the
token counts it profiled; the attention row as measured: input reshape + decode or prefill kernel + output reshape),
flexmesh's from the device layer (:func:`predicted` outside attention; :meth:`AnalyticIteration.attention_s` over the
layers, less the KV-cache write it includes). Left out of both sides: the embedding, the final norm and the LM head
(Vidur's ``model_time`` leaves them out; flexmesh prices the head in ``head_s``); the KV-cache write (Vidur prices
``attn_kv_cache_save`` from a column this profile lacks, so as zero; flexmesh's ``attention_s`` term is subtracted);
the engine's CPU overhead (schedule, sampler, prepare inputs, process outputs: Vidur's ``_get_cpu_overhead``,
flexmesh's ``overhead.seconds``); and Vidur's configured 10% decode (prefill) batching overhead, a constant its
predictor multiplies attention by, not a measurement. Vidur's predictor does not add the reshapes; they are kept on
the measured side (a median 2% of a row's attention, under 1% of any iteration). No device-layer constant was fitted
to these rows either.

What the whole iterations show: attention carries the error, in opposite directions for the two kinds. Vidur's
prefill attention (flash-attention over the paged cache) runs at about a fifth of peak at its largest chunks, well
below the attention rate of the device layer's measured tables, so long prefills are priced low; its decode
attention streams the KV cache at nearly the datasheet HBM bandwidth, above the tables' decode rate, so large decode
batches over long contexts are priced high. Small steps are close.

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

The engine's own rates (framework terms above the device layer, :mod:`flexmesh.cost.inference.engine_rates`).
Vidur profiled sarathi-serve's kernels, not the ones aiconfigurator-core timed: what those kernels reach of the
device layer's rates is a term of the engine, not of the GPU. Four factors, each on one rate and each fitted
(:func:`~flexmesh.cost.inference.engine_rates.fit_rate`, least squares on log(priced / measured)) to the rows of
the operators it names: ``gemm`` (the GEMMs' tensor-core rate) to the four GEMM columns, ``pointwise`` (the
streaming kernels' bandwidth) to the five pointwise ones, ``prefill_attention`` (the attention FLOP rate) to the
prefill rows' attention, ``decode_attention`` (the KV read rate) to the decode rows'. Every figure is given at the
device layer alone, in sample and held out, and the targets are judged held out: the layer outside attention
leaving one model out (Llama-2-7B's rows priced by rates fitted to Llama-3-8B's, and the reverse) and leaving one
GPU type out (A100's by rates fitted to H100's, and the reverse), median ``|predicted / measured - 1|`` <= 15% per
GPU type under each; whole iterations with no iteration in any fit, the layer rates fitted without the
iteration's own (GPU, model) profile and the attention rates to one half of the attention rows, the other half
scored (split three ways: every other row by kind, step tokens and context; each kind's rows at or below its
median context against those above; the same by step tokens), median error <= 15% for prefill and for decode
under each split.

A part flexmesh has no kernel tables of (priced from another part's, scaled to its datasheet, and named so in
``serve simulate``'s output): Vidur also profiled the A40 (``bench/data/vidur_mlp_a40.csv``, Llama-2-7B and
Llama-2-70B, each GPU's shard at tensor parallelism 1 to 8). Its layer outside attention is scored at the device
layer alone (the borrowed A100 tables) and at sarathi-serve's rates fitted to the A100 and H100 rows; no A40 row
enters any fit. Target: the device layer's median error <= 15%.

Usage: ``python -m bench.vidur_layers [--no-record]``.
"""

from __future__ import annotations

import argparse
import csv
import sys
from functools import cache
from pathlib import Path

import numpy as np

from bench._results import markdown_table, record
from flexmesh.cost.device.hardware import Hardware, unmeasured_notes
from flexmesh.cost.device.kernels import HBM_EFFICIENCY
from flexmesh.cost.device.layer_shapes import pointwise_elems
from flexmesh.cost.inference.analytic import LAYER_POINTWISE_KERNELS, AnalyticIteration
from flexmesh.cost.inference.engine_rates import EngineRates, fit_engine_rates
from flexmesh.spec import MODEL_PRESETS
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.devices import DEVICE_PRESETS

DEPENDS_ON = ("flexmesh/cost", "flexmesh/spec", "flexmesh/errors.py", "flexmesh/files.py", "flexmesh/inputs.py",
              "flexmesh/units.py", "bench/data/vidur_mlp_tp1.csv", "bench/data/vidur_attention_a100_llama2_7b_tp1.csv",
              "bench/data/vidur_mlp_a40.csv")
DATA = Path(__file__).parent / "data" / "vidur_mlp_tp1.csv"
# Vidur's profiles of a part flexmesh has no kernel tables of (priced from another part's, scaled to its datasheet):
# held out from every fit here, each model at tensor parallelism 1, 2, 4 and 8
BORROWED_DATA = Path(__file__).parent / "data" / "vidur_mlp_a40.csv"
BORROWED = {"a40": "A40"}
BORROWED_MODELS = {"meta-llama/Llama-2-7b-hf": "llama2-7b", "meta-llama/Llama-2-70b-hf": "llama2-70b"}
ATTENTION_DATA = Path(__file__).parent / "data" / "vidur_attention_a100_llama2_7b_tp1.csv"
BOUND = 0.15
# Vidur's profiling machines (its paper: DGX A100 80GB and DGX H100) and models, as flexmesh names them
PARTS = {"a100": "A100-80GB", "h100": "H100-80GB"}
MODELS = {"meta-llama/Llama-2-7b-hf": "llama2-7b", "meta-llama/Meta-Llama-3-8B": "llama3-8b"}
# Vidur's operators in a layer's order; the GEMMs by their place in flexmesh.cost.device.layer_shapes.linear_shapes
OPERATORS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
GEMMS = {"attn_pre_proj": 0, "attn_post_proj": 1, "mlp_up_proj": 2, "mlp_down_proj": 3}
ADD_ELEMS = 3  # the residual add: reads two rows of the hidden size, writes one
# Whole iterations: the one (gpu, model) whose attention profile is stored, and its attention columns
ITERATION = ("a100", "meta-llama/Llama-2-7b-hf")
ATTENTION_OPERATORS = ("attn_input_reshape", "attn_decode", "attn_output_reshape", "attn_prefill")
SMALL_BATCH, LARGE_BATCH = 16, 64  # decodes in a step
SHORT_CHUNK, LONG_CHUNK = 512, 1024  # a prefill chunk's tokens
SHORT_CONTEXT, LONG_CONTEXT = 1024, 2048  # cached tokens (per request) before the step


def _operator_rows(path: Path, *keys: str) -> dict[tuple, tuple[np.ndarray, dict[str, np.ndarray]]]:
    """A file of Vidur's operator medians by its ``keys`` columns: token counts and each operator's seconds."""
    rows: dict[tuple, list[dict[str, str]]] = {}
    with path.open() as f:
        for r in csv.DictReader(line for line in f if not line.startswith("#")):
            rows.setdefault(tuple(int(r[k]) if k == "tp" else r[k] for k in keys), []).append(r)
    return {k: (np.array([float(r["num_tokens"]) for r in v]),
                {op: np.array([float(r[f"{op}_ms"]) * 1e-3 for r in v]) for op in OPERATORS})
            for k, v in rows.items()}


def operator_sums(path: Path, *keys: str) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """:func:`_operator_rows`' files by ``keys`` -> token counts and the operators' summed seconds (the layer
    outside attention)."""
    return {k: (tokens, sum(ops.values(), np.zeros_like(tokens)))
            for k, (tokens, ops) in _operator_rows(path, *keys).items()}


def measured_operators() -> dict[tuple[str, str], tuple[np.ndarray, dict[str, np.ndarray]]]:
    """(gpu, model) -> token counts and each operator's measured seconds (Vidur's median)."""
    return _operator_rows(DATA, "gpu", "model")


def measured() -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """(gpu, model) -> token counts and the layer's measured seconds outside attention."""
    return operator_sums(DATA, "gpu", "model")


def operator_elems(model: str) -> dict[str, int]:
    """Elements each of Vidur's pointwise operators moves per token, read and write counted (see the module doc)."""
    m = MODEL_PRESETS[model]
    p = pointwise_elems(m)
    return {"input_layernorm": p.norms // 2, "post_attention_layernorm": p.norms // 2, "attn_rope": p.rotary,
            "mlp_act": p.activation, "add": ADD_ELEMS * m.hidden}


@cache
def _device_layer(model: str, part: str, tp: int = 1) -> AnalyticIteration:
    return AnalyticIteration(MODEL_PRESETS[model], Hardware(ClusterSpec(1, tp, DEVICE_PRESETS[part])), tp)


def iteration(model: str, part: str, rates: EngineRates | None = None, tp: int = 1) -> AnalyticIteration:
    """``model``'s iteration priced on ``tp`` of ``part`` (each GPU's shard): at the device layer's kernels, or at an
    engine's ``rates`` on them (``EngineRates.on``)."""
    it = _device_layer(model, part, tp)
    return it if rates is None else AnalyticIteration(MODEL_PRESETS[model], rates.on(it.hw), tp)


def predicted_operators(model: str, part: str, tokens: np.ndarray,
                        rates: EngineRates | None = None) -> dict[str, np.ndarray]:
    """flexmesh's device layer's seconds of each of Vidur's operators at ``tokens``: the GEMMs at their kernels,
    each pointwise operator one streaming kernel moving :func:`operator_elems` (``rates``: at an engine's rates
    on those kernels)."""
    it = iteration(model, part, rates)
    k, b = it.kernels, MODEL_PRESETS[model].dtype_bytes
    out = {op: k.gemm(tokens, *it.shapes[i]) for op, i in GEMMS.items()}
    out.update({op: k.memory_bound(tokens * e * b) for op, e in operator_elems(model).items()})
    return out


def achieved(model: str, part: str, op: str, tokens: float, secs: float) -> float:
    """The fraction of the datasheet rate an operator of ``tokens`` reached in ``secs``: a GEMM's of peak FLOP/s,
    a pointwise operator's of the HBM bandwidth."""
    m, d = MODEL_PRESETS[model], DEVICE_PRESETS[part]
    if op in GEMMS:
        n, red = iteration(model, part).shapes[GEMMS[op]]
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
    shapes = iteration(model, part).shapes
    return {op: np.array([ops[op][j] / table[key] if (key := (int(t), int(shapes[i][0]), int(shapes[i][1]))) in table
                          else np.nan for j, t in enumerate(tokens)]) for op, i in GEMMS.items()}


def swapped() -> dict[str, tuple[float, float]]:
    """Per GPU type, the layer's median error with Vidur's GEMM times in place of the device layer's, and with
    Vidur's pointwise operators' times in place of the device layer's pointwise term."""
    errs: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for (gpu, model), (tokens, ops) in sorted(measured_operators().items()):
        it = iteration(MODELS[model], PARTS[gpu])
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


def predicted(model: str, part: str, tokens: np.ndarray, training: bool = False,
              rates: EngineRates | None = None, tp: int = 1) -> np.ndarray:
    """flexmesh's seconds of one layer outside attention at ``tokens`` (``training``: at a training step's
    kernels, what serving priced with before the device layer's; ``rates``: at an engine's rates on the device
    layer's kernels; ``tp``: one GPU's shard at that tensor parallelism, its all-reduces left out as Vidur's
    operator profile leaves them)."""
    it = iteration(model, part, rates, tp)
    k = it.hw.kernels if training else it.kernels
    t = sum(k.gemm(tokens, n, red) for n, red in it.shapes)
    return t + k.memory_bound(tokens * it.pointwise_bytes, LAYER_POINTWISE_KERNELS)


def borrowed_measured() -> dict[tuple[str, str, int], tuple[np.ndarray, np.ndarray]]:
    """(gpu, model, tp) of :data:`BORROWED_DATA` -> token counts and the shard's measured seconds outside
    attention."""
    return operator_sums(BORROWED_DATA, "gpu", "model", "tp")


def borrowed_rows() -> tuple[list[list[str]], dict[str, tuple[float, float]]]:
    """Per (part, model, tp) of the parts priced from another part's tables: the median error of the layer outside
    attention at the device layer alone and at sarathi-serve's rates fitted to every A100 and H100 row (signed at
    <= 256 / >= 2048 tokens); and per part, the two medians over all its rows."""
    sarathi = fit_layer_rates(tuple(sorted(measured_operators())))
    rows, errs = [], {}
    for (gpu, model, tp), (tokens, secs) in sorted(borrowed_measured().items(), key=lambda kv: kv[0]):
        part, name = BORROWED[gpu], BORROWED_MODELS[model]
        cells = [part, name, f"tp{tp}", str(len(tokens))]
        for i, rates in enumerate((None, sarathi)):
            err = predicted(name, part, tokens, rates=rates, tp=tp) / secs - 1.0
            errs.setdefault(part, ([], []))[i].append(err)
            cells.append(f"{np.median(np.abs(err)):.1%} ({np.median(err[tokens <= 256]):+.1%} / "
                         f"{np.median(err[tokens >= 2048]):+.1%})")
        rows.append(cells)
    return rows, {part: (float(np.median(np.abs(np.concatenate(a)))), float(np.median(np.abs(np.concatenate(b)))))
                  for part, (a, b) in errs.items()}


# ---- whole iterations ------------------------------------------------------------------------------------


def measured_attention() -> dict[str, np.ndarray]:
    """Vidur's attention rows (A100, Llama-2-7B, tp 1): ``batch_size``, ``prefill_chunk_size``, ``kv_cache_size``,
    ``is_prefill`` and each of :data:`ATTENTION_OPERATORS`' measured seconds (NaN where a row's kind has none)."""
    with ATTENTION_DATA.open() as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    out = {c: np.array([float(r[c]) for r in rows]) for c in ("batch_size", "prefill_chunk_size", "kv_cache_size")}
    out["is_prefill"] = np.array([r["is_prefill"] == "True" for r in rows])
    out.update({op: np.array([float(r[f"{op}_ms"]) * 1e-3 if r[f"{op}_ms"] else np.nan for r in rows])
                for op in ATTENTION_OPERATORS})
    return out


def step_tokens(rows: dict[str, np.ndarray]) -> np.ndarray:
    """The tokens a row's step runs through every layer: its chunk's for a prefill, one per request for a decode."""
    return np.where(rows["is_prefill"], rows["prefill_chunk_size"], rows["batch_size"])


def measured_attention_s(rows: dict[str, np.ndarray]) -> np.ndarray:
    """Each row's measured attention of one layer: input reshape + the decode or prefill kernel + output reshape."""
    kernel = np.where(rows["is_prefill"], rows["attn_prefill"], rows["attn_decode"])
    return rows["attn_input_reshape"] + kernel + rows["attn_output_reshape"]


def measured_outside_attention(tokens: np.ndarray) -> np.ndarray:
    """Vidur's layer outside attention (A100, Llama-2-7B) at ``tokens``: its operators' summed medians, linear
    between the token counts it profiled (Vidur's predictor regresses on the same points)."""
    t, secs = measured()[ITERATION]
    order = np.argsort(t, kind="stable")
    return np.interp(tokens, t[order], secs[order])


def predicted_attention_s(it: AnalyticIteration, rows: dict[str, np.ndarray]) -> np.ndarray:
    """flexmesh's attention of one layer for each row: :meth:`AnalyticIteration.attention_s` of the row's step
    (``B`` decodes over ``B x C`` cached tokens, or one chunk ``(K, P)``) over the layers, less the KV-cache write
    it includes (``memory_bound`` of the new tokens' keys and values)."""
    out = []
    for prefill, b, p, c in zip(rows["is_prefill"], rows["batch_size"], rows["prefill_chunk_size"],
                                rows["kv_cache_size"]):
        new, total = (int(p), it.attention_s(0, 0, [(int(c), int(p))])) if prefill else \
            (int(b), it.attention_s(int(b), int(b) * int(c), ()))
        out.append(total / it.layers - float(it.kernels.memory_bound(2.0 * new * it.kv_token_bytes)))
    return np.array(out)


def iterations(rates: EngineRates | None = None) -> dict[str, np.ndarray]:
    """Every attention row as a whole iteration of :data:`ITERATION` (see the module doc): the rows, ``tokens``,
    ``layers``, each side's ``*_outside`` and ``*_attention`` seconds of one layer, and ``measured`` and
    ``predicted``, ``layers x (outside + attention)`` (``rates``: flexmesh's side at an engine's rates on the
    device layer's kernels)."""
    gpu, model = ITERATION
    name, part = MODELS[model], PARTS[gpu]
    rows = measured_attention()
    tokens = step_tokens(rows)
    it = iteration(name, part, rates)
    out = dict(rows, tokens=tokens, layers=np.full(len(tokens), it.layers),
               measured_outside=measured_outside_attention(tokens),
               predicted_outside=predicted(name, part, tokens, rates=rates),
               measured_attention=measured_attention_s(rows), predicted_attention=predicted_attention_s(it, rows))
    out["measured"] = it.layers * (out["measured_outside"] + out["measured_attention"])
    out["predicted"] = it.layers * (out["predicted_outside"] + out["predicted_attention"])
    return out


def attention_rates() -> dict[str, tuple[float, float]]:
    """Vidur's and flexmesh's attention rates at the row that moves the most: ``decode``, the KV bytes read per
    second at the largest ``B x C`` (bytes/s); ``prefill``, the query-key FLOPs per second at the largest chunk
    work (FLOP/s); each as ``(Vidur's kernel, flexmesh's price)``."""
    r = iterations()
    m = MODEL_PRESETS[MODELS[ITERATION[1]]]
    kv = r["batch_size"] * (r["kv_cache_size"] + 1) * 2 * m.num_kv_heads * m.head_dim * m.dtype_bytes
    p, c = r["prefill_chunk_size"], r["kv_cache_size"]
    flops = 4.0 * m.q_dim * (p * c + p * (p + 1) / 2)
    d = int(np.argmax(np.where(r["is_prefill"], 0.0, kv)))
    f = int(np.argmax(np.where(r["is_prefill"], flops, 0.0)))
    return {"decode": (kv[d] / r["attn_decode"][d], kv[d] / r["predicted_attention"][d]),
            "prefill": (flops[f] / r["attn_prefill"][f], flops[f] / r["predicted_attention"][f])}


def iteration_rows() -> tuple[list[list[str]], dict[str, float]]:
    """The whole-iteration table's rows (prefill, decode) and each kind's median ``|predicted / measured - 1|``."""
    r = iterations()
    err = r["predicted"] / r["measured"] - 1.0
    attn = r["predicted_attention"] / r["measured_attention"] - 1.0
    share = r["layers"] * r["measured_attention"] / r["measured"]
    rows, medians = [], {}
    for kind, mask, small, large in (
            ("prefill", r["is_prefill"], r["tokens"] <= SHORT_CHUNK, r["tokens"] >= LONG_CHUNK),
            ("decode", ~r["is_prefill"], r["tokens"] <= SMALL_BATCH, r["tokens"] >= LARGE_BATCH)):
        short, long = r["kv_cache_size"] <= SHORT_CONTEXT, r["kv_cache_size"] >= LONG_CONTEXT
        medians[kind] = m = float(np.median(np.abs(err[mask])))

        def signed(x: np.ndarray, sel: np.ndarray, mask: np.ndarray = mask) -> str:
            return f"{np.median(x[mask & sel]):+.1%} ({int((mask & sel).sum())})" if (mask & sel).any() else ""
        rows.append([kind, str(int(mask.sum())), f"{m:.1%}",
                     signed(err, small), signed(err, large), signed(err, short), signed(err, long),
                     f"{np.median(share[mask]):.0%}", f"{np.median(np.abs(attn[mask])):.1%}",
                     f"{np.median(attn[mask]):+.1%}", signed(attn, small), signed(attn, large)])
    return rows, medians


# ---- sarathi-serve's rates on the device layer's kernels (framework terms) ------------------------------


POINTWISE = tuple(op for op in OPERATORS if op not in GEMMS)
FOLDS = 2  # attention rows are split in two: one half fitted, the other scored, and the reverse
# How (attention_folds): every other row (by kind, step tokens, context); each kind's rows by context, or by step
# tokens, the half at or below the kind's median against the half above (the fit then extrapolates)
SPLITS = {"every other row": "turn", "by context": "context", "by step": "step"}


@cache
def fit_layer_rates(groups: tuple[tuple[str, str], ...]) -> EngineRates:
    """The engine's ``gemm`` and ``pointwise`` rates (:mod:`flexmesh.cost.inference.engine_rates`) fitted to the
    per-operator rows of ``groups`` ((gpu, model) keys of :func:`measured_operators`) and no others: ``gemm`` on
    the four GEMM columns, ``pointwise`` on the five pointwise ones, every token count."""
    data = measured_operators()

    def term(ops: tuple[str, ...]) -> tuple[object, np.ndarray]:
        def price(r: EngineRates) -> np.ndarray:
            out = []
            for g, m in groups:
                priced = predicted_operators(MODELS[m], PARTS[g], data[(g, m)][0], r)
                out += [priced[op] for op in ops]
            return np.concatenate(out)
        return price, np.concatenate([data[(g, m)][1][op] for g, m in groups for op in ops])
    return fit_engine_rates({"gemm": term(tuple(GEMMS)), "pointwise": term(POINTWISE)},
                            "sarathi-serve (Vidur's profiles): " + ", ".join(f"{PARTS[g]} {MODELS[m]}"
                                                                            for g, m in groups))


def held_out_groups(key: tuple[str, str], by: str) -> tuple[tuple[str, str], ...]:
    """The (gpu, model) groups a fit scored on ``key`` may see: ``by`` "model", those of another model (leave one
    model out); "gpu", those of another GPU type (leave one GPU out)."""
    i = {"gpu": 0, "model": 1}[by]
    return tuple(k for k in sorted(measured_operators()) if k[i] != key[i])


def attention_folds(rows: dict[str, np.ndarray], by: str = "turn") -> np.ndarray:
    """Each attention row's fold (0 or 1): ``by`` "turn", rows sorted by kind, step tokens and context, then
    numbered in turn; "context" or "step", 1 where the row's cached context (or step tokens) is above its kind's
    median."""
    if by == "turn":
        order = np.lexsort((rows["kv_cache_size"], step_tokens(rows), rows["is_prefill"]))
        fold = np.empty(len(order), dtype=int)
        fold[order] = np.arange(len(order)) % FOLDS
        return fold
    axis = {"context": rows["kv_cache_size"], "step": step_tokens(rows)}[by]
    fold = np.zeros(len(axis), dtype=int)
    for kind in (rows["is_prefill"], ~rows["is_prefill"]):
        fold[kind & (axis > np.median(axis[kind]))] = 1
    return fold


def fit_attention_rates(mask: np.ndarray, layer: EngineRates) -> EngineRates:
    """``layer`` with the engine's ``prefill_attention`` and ``decode_attention`` rates fitted to the attention
    rows in ``mask`` and no others (each kind's rows its own rate, at ``layer``'s other rates; the measured side
    as :func:`measured_attention_s`, flexmesh's as :func:`predicted_attention_s`)."""
    gpu, model = ITERATION
    name, part = MODELS[model], PARTS[gpu]
    rows = measured_attention()
    measured_s = measured_attention_s(rows)

    def term(kind: np.ndarray) -> tuple[object, np.ndarray]:
        sel = mask & kind
        seen = {c: v[sel] for c, v in rows.items()}

        def price(r: EngineRates) -> np.ndarray:
            return predicted_attention_s(iteration(name, part, r), seen)
        return price, measured_s[sel]
    return fit_engine_rates({"prefill_attention": term(rows["is_prefill"]),
                             "decode_attention": term(~rows["is_prefill"])},
                            f"{layer.source}; attention: {int(mask.sum())} of {PARTS[gpu]} {name}'s attention rows",
                            base=layer)


@cache
def layer_fits() -> dict[str, dict[tuple[str, str], EngineRates]]:
    """Per (gpu, model) group, the rates that price it: ``in sample`` (fitted to every group),
    ``leave one model out`` and ``leave one GPU out`` (fitted without the group's model, or its GPU type)."""
    keys = tuple(sorted(measured_operators()))
    every = fit_layer_rates(keys)
    return {"in sample": dict.fromkeys(keys, every),
            **{f"leave one {by if by == 'model' else 'GPU'} out": {k: fit_layer_rates(held_out_groups(k, by))
                                                                  for k in keys} for by in ("model", "gpu")}}


def layer_rate_rows() -> tuple[list[list[str]], list[list[str]], dict[str, dict[str, float]]]:
    """The layer outside attention at the engine's rates: per (gpu, model) its median error at the device layer
    alone, in sample and held out; the fits' rates; and per scheme and GPU type the median error."""
    fits, rows, errs = layer_fits(), [], {}
    for key, (tokens, secs) in sorted(measured().items()):
        gpu, model = key
        part, name = PARTS[gpu], MODELS[model]
        cells = [part, name, f"{np.median(np.abs(predicted(name, part, tokens) / secs - 1)):.1%}"]
        for scheme, by_key in fits.items():
            err = predicted(name, part, tokens, rates=by_key[key]) / secs - 1.0
            errs.setdefault(scheme, {}).setdefault(part, []).append(err)
            cells.append(f"{np.median(np.abs(err)):.1%} ({np.median(err[tokens <= 256]):+.1%} / "
                         f"{np.median(err[tokens >= 4096]):+.1%})")
        rows.append(cells)
    scored: dict[tuple[str, EngineRates], list[str]] = {}
    for scheme, by_key in fits.items():
        for (gpu, model), r in sorted(by_key.items()):
            scored.setdefault((scheme, r), []).append(f"{PARTS[gpu]} {MODELS[model]}")
    fit_rows = [[scheme, r.source.split(": ", 1)[1], ", ".join(keys), f"{r.gemm:.3f}", f"{r.pointwise:.3f}"]
                for (scheme, r), keys in scored.items()]
    medians = {scheme: {part: float(np.median(np.abs(np.concatenate(e)))) for part, e in by_part.items()}
               for scheme, by_part in errs.items()}
    return rows, fit_rows, medians


@cache
def iteration_fits() -> dict[str, tuple[np.ndarray, tuple[EngineRates, ...]]]:
    """The rates whole iterations are priced at: per scheme, each attention row's fold and one set of rates per
    fold (a row is priced at its fold's). ``in sample``: every per-operator row and every attention row (one
    fold); ``held out, <split>`` (:data:`SPLITS`): the layer rates of every group but the iteration's own
    (:data:`ITERATION`), the attention rates fitted to the other fold's rows."""
    keys = tuple(sorted(measured_operators()))
    rows = measured_attention()
    every = fit_attention_rates(np.ones(len(rows["is_prefill"]), dtype=bool), fit_layer_rates(keys))
    layer = fit_layer_rates(tuple(k for k in keys if k != ITERATION))
    out = {"in sample": (np.zeros(len(rows["is_prefill"]), dtype=int), (every,))}
    for name, by in SPLITS.items():
        folds = attention_folds(rows, by)
        out[f"held out, {name}"] = (folds, tuple(fit_attention_rates(folds != f, layer) for f in range(FOLDS)))
    return out


def iteration_errors(folds: np.ndarray, fits: tuple[EngineRates, ...]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Whole iterations with each row priced at its fold's rates: the rows (:func:`iterations`) and each row's
    ``predicted / measured - 1``."""
    r = iterations()
    err = np.full(len(folds), np.nan)
    for f, rates in enumerate(fits):
        at = iterations(rates)
        err[folds == f] = (at["predicted"] / at["measured"] - 1.0)[folds == f]
    return r, err


def iteration_rate_rows() -> tuple[list[list[str]], list[list[str]], dict[str, dict[str, float]]]:
    """Whole iterations at the engine's rates: per kind the median error at the device layer alone, in sample
    and under each held-out split (PASS or FAIL), with signed medians by step size under the first split; the
    fits' rates; and per held-out split each kind's median error."""
    fits = iteration_fits()
    errs = {scheme: iteration_errors(*fit)[1] for scheme, fit in fits.items()}
    r = iterations()
    alone = r["predicted"] / r["measured"] - 1.0
    first = f"held out, {next(iter(SPLITS))}"
    rows, medians = [], {}
    for kind, mask, small, large in (
            ("prefill", r["is_prefill"], r["tokens"] <= SHORT_CHUNK, r["tokens"] >= LONG_CHUNK),
            ("decode", ~r["is_prefill"], r["tokens"] <= SMALL_BATCH, r["tokens"] >= LARGE_BATCH)):
        cells = [kind, str(int(mask.sum())), f"{np.median(np.abs(alone[mask])):.1%}"]
        for scheme, err in errs.items():
            m = float(np.median(np.abs(err[mask])))
            if scheme == "in sample":
                cells.append(f"{m:.1%}")
            else:
                medians.setdefault(scheme, {})[kind] = m
                cells.append(f"{m:.1%} {'PASS' if m <= BOUND else 'FAIL'}")
        held = errs[first]
        rows.append([*cells, f"{np.median(held[mask & small]):+.1%}", f"{np.median(held[mask & large]):+.1%}"])
    def scored(scheme: str, fold: int) -> str:
        if scheme == "in sample":
            return scheme
        if SPLITS[scheme.split(", ", 1)[1]] == "turn":
            return f"{scheme}, scoring fold {fold}"
        return f"{scheme}, scoring the {'half above' if fold else 'half at or below'} the median"
    fit_rows = [[scored(scheme, f), f"{x.gemm:.3f}", f"{x.pointwise:.3f}", f"{x.prefill_attention:.3f}",
                 f"{x.decode_attention:.3f}"] for scheme, (_, rs) in fits.items() for f, x in enumerate(rs)]
    return rows, fit_rows, medians


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
    alone = []
    for gpu, parts in sorted(by_gpu.items()):
        alone.append(f"{PARTS[gpu]} {float(np.median(np.abs(np.concatenate([a for a, _, _ in parts])))):.1%}")
    md = ["A decoder layer outside attention (norms, QKV and output projections, rotary, up and down projections, "
          "activation, residual add) at tensor parallelism 1: flexmesh's device layer against the sum of Vidur's "
          "measured operator medians (MLSys 2024, microsoft/vidur, MIT; bench/data/vidur_mlp_tp1.csv), every token "
          "count Vidur profiled. No constant was fitted to these rows here (the device layer alone; the engine's "
          "fitted rates follow, scored on rows their fit did not see). Before: a training step's kernels (what "
          "serving priced with until now); after: the device layer's (`Hardware.device_kernels`). Signed medians "
          "show the bias at decode-sized (<= 256 tokens) and prefill-sized (>= 4096) batches. Whole iterations, "
          "with attention, follow below (A100 only).", "",
          *markdown_table(["part", "model", "token counts", "median error before", "median error after",
                           "after, <= 256 tokens (signed)", "after, >= 4096 tokens (signed)"], rows), "",
          "Per GPU type (after; the device layer alone, not the target): " + "; ".join(alone) + "."]
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
    layer_rows, layer_fit_rows, layer_medians = layer_rate_rows()
    held = {scheme: m for scheme, m in layer_medians.items() if scheme != "in sample"}
    verdicts = [f"{scheme}: " + ", ".join(f"{part} {e:.1%} {'PASS' if e <= BOUND else 'FAIL'}"
                                         for part, e in sorted(by_part.items())) for scheme, by_part in held.items()]
    md += ["", "The engine's own rates on the device layer's kernels (framework terms above it, "
           "`flexmesh.cost.inference.engine_rates.EngineRates`): `gemm`, a factor on the GEMMs' tensor-core rate "
           "(their memory-bound side keeps the device layer's bandwidth), and `pointwise`, a factor on the streaming "
           "kernels' bandwidth, each fitted (`fit_rate`: least squares on log(priced / measured)) to its own "
           "operators' rows of Vidur's per-operator profile (`gemm` the four GEMM columns, `pointwise` the five "
           "pointwise ones). In sample: fitted to every row; leave one model out: fitted to the rows of the other "
           "model only (Llama-2-7B rows scored by a fit to Llama-3-8B's, and the reverse); leave one GPU out: fitted "
           "to the other GPU type's rows only (A100 scored by a fit to H100's, and the reverse). Each cell: median "
           "error (signed median at <= 256 / >= 4096 tokens). Target: held-out median error <= "
           f"{BOUND:.0%} per GPU type, each scheme.", "",
           *markdown_table(["part", "model", "device layer alone", "in sample", "leave one model out",
                            "leave one GPU out"], layer_rows), "",
           "Per GPU type, held out: " + "; ".join(verdicts) + ". In sample: " + ", ".join(
               f"{part} {e:.1%}" for part, e in sorted(layer_medians["in sample"].items())) + ".", "",
           *markdown_table(["fit", "rows fitted", "rows scored", "gemm", "pointwise"], layer_fit_rows)]
    b_rows, b_medians = borrowed_rows()
    b_verdicts = [f"{p} {alone:.1%} {'PASS' if alone <= BOUND else 'FAIL'}" for p, (alone, _) in b_medians.items()]
    md += ["", "A part no kernel table measured (as `serve simulate` says: "
           + "; ".join(unmeasured_notes([DEVICE_PRESETS[p] for p in b_medians]))
           + "), against Vidur's profile of it (bench/data/vidur_mlp_a40.csv: each GPU's shard of Llama-2-7B and "
           "Llama-2-70B at tensor parallelism 1, 2, 4 and 8, the layer outside attention without its all-reduces, "
           "every token count). Held out from every fit: the device layer alone, and at sarathi-serve's rates fitted "
           "to every A100 and H100 row above (the `vllm-v0` engine's). Each cell: median error (signed median at "
           f"<= 256 / >= 2048 tokens). Target: the device layer's median error <= {BOUND:.0%} per part.", "",
           *markdown_table(["part", "model", "tp", "token counts", "device layer alone",
                            "at sarathi-serve's rates (A100, H100 fit)"], b_rows), "",
           "Per part, every row: " + "; ".join(f"{p}: device layer alone {a:.1%} "
                                               f"{'PASS' if a <= BOUND else 'FAIL'}, at sarathi-serve's rates {r:.1%}"
                                               for p, (a, r) in b_medians.items()) + "."]
    it_rows, it_medians = iteration_rows()
    part, name = PARTS[ITERATION[0]], MODELS[ITERATION[1]]
    md += ["", f"Whole iterations, {part} {name} tensor parallelism 1: every sampled row of Vidur's attention profile "
           "(bench/data/vidur_attention_a100_llama2_7b_tp1.csv; Vidur publishes no H100 attention profile in plain "
           "text) as an iteration of `num_layers` x (the layer outside attention at the step's tokens + the row's "
           "attention), Vidur's measured medians against flexmesh's device layer (`AnalyticIteration.attention_s` "
           "less its KV-cache write; `predicted` outside attention). Both sides leave out the embedding, final norm "
           "and LM head, the KV-cache write, the engine's CPU overhead and Vidur's configured batching-overhead "
           "fraction. The device layer alone (the target is judged on the engine's rates, held out, below). Signed "
           "medians "
           "(rows in brackets) by the step's tokens (prefill: chunk <= "
           f"{SHORT_CHUNK} / >= {LONG_CHUNK}; decode: batch <= {SMALL_BATCH} / >= {LARGE_BATCH}) and by the cached "
           f"context per request (<= {SHORT_CONTEXT} / >= {LONG_CONTEXT}); then attention alone (flexmesh's prefill "
           "or decode attention against Vidur's reshapes + attn_prefill or attn_decode) and its share of the measured "
           "iteration.", "",
           *markdown_table(["iterations", "rows", "median error", "small step (signed)", "large step (signed)",
                            "short context (signed)", "long context (signed)", "attention's share",
                            "attention alone, median error", "attention alone, signed", "attention, small step",
                            "attention, large step"], it_rows)]
    rate_rows, rate_fit_rows, rate_medians = iteration_rate_rows()
    md += ["", "The same iterations at the engine's rates: `gemm` and `pointwise` as above and two attention "
           "factors, `prefill_attention` on the attention FLOP rate and `decode_attention` on the rate decode "
           "attention reads the KV cache at, each fitted to its own kind's rows of the attention profile (each "
           "row's measured attention against flexmesh's, as in the table above). No whole-iteration row enters a "
           "fit. In sample: the layer rates fitted to every per-operator row, the attention rates to every "
           "attention row. Held out: the layer rates fitted without the iteration's own rows (the other two "
           "(GPU, model) profiles), and the attention rows split in two, each row's iteration priced at attention "
           "rates fitted to the other half only: every other row (sorted by kind, step tokens and context); by "
           "context (each kind's rows at or below its median cached context against those above: the fit "
           "extrapolates to longer or shorter contexts than it saw); by step (the same by the step's tokens: "
           "chunk or batch). Target: held-out median error <= "
           f"{BOUND:.0%} for prefill and for decode iterations under each split; signed medians (every other row) "
           f"by step (prefill: chunk <= {SHORT_CHUNK} / >= {LONG_CHUNK}; decode: batch <= {SMALL_BATCH} / >= "
           f"{LARGE_BATCH}).", "",
           *markdown_table(["iterations", "rows", "device layer alone", "in sample",
                            *[f"held out, {split}" for split in SPLITS],
                            "every other row, small step (signed)", "every other row, large step (signed)"],
                           rate_rows), "",
           *markdown_table(["fit", "gemm", "pointwise", "prefill_attention", "decode_attention"], rate_fit_rows)]
    rates, dev = attention_rates(), DEVICE_PRESETS[part]
    (dv, df), (pv, pf) = rates["decode"], rates["prefill"]
    md += ["", f"Attention's rates where each kind moves the most: decode, Vidur's kernel reads the KV cache at "
           f"{dv / 1e12:.2f} TB/s ({dv / (dev.hbm_gbps * 1e9):.0%} of the datasheet HBM bandwidth), flexmesh prices "
           f"{df / 1e12:.2f} TB/s; prefill, Vidur's kernel does {pv / 1e12:.0f} TFLOP/s "
           f"({pv / dev.peak_flops('bf16'):.0%} of peak), flexmesh prices {pf / 1e12:.0f} TFLOP/s."]
    print("\n".join(md))
    headline = ("vs Vidur's profiles at sarathi-serve's fitted engine rates, held-out median error: layer outside "
                "attention " + "; ".join(verdicts) + f"; whole iterations {part} {name} tp1 (every other row | by "
                "context | by step): " + ", ".join(
                    f"{kind} " + " | ".join(f"{by_kind[kind]:.1%}" for by_kind in rate_medians.values())
                    + (" PASS" if all(by_kind[kind] <= BOUND for by_kind in rate_medians.values()) else " FAIL")
                    for kind in ("prefill", "decode"))
                + "; the device layer alone: layer " + ", ".join(alone) + ", iterations " + ", ".join(
                    f"{kind} {m:.1%}" for kind, m in it_medians.items())
                + "; a part priced from another's tables, layer (tp 1-8, held out): " + ", ".join(b_verdicts))
    print(headline)
    if not args.no_record:
        record("vidur_layers", "\n".join(md), headline=headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
