"""flexmesh's iteration prices against DistServe's profiles of two engines on one A100-80GB node.

DistServe (Zhong et al., OSDI 2024; github.com/LLMServe/DistServe, Apache-2.0, ``bench/data/distserve_LICENSE``)
timed two engines on one A100-80GB node over one grid of batches (``evaluation/0-test-single-forward-performance``):
its vLLM baseline (a fork of vLLM 0.2, ``vllm.LLM`` with Ray workers) and its own engine (SwiftTransformer's C++
kernels, its workers Ray actors), both fp16 with dummy weights, 1 to 192 prompts of 4 to 2020 tokens each within a
token limit per model and tp, each run prefilling the batch in one iteration and decoding 16 tokens. It fitted the
times to ``a + b x + c y`` (``evaluation/1-fit-time-usage``: least squares on relative error; prefill ``x`` =
tokens, ``y`` = sum of the prompts' squared lengths; decode ``x`` = the batch's context tokens, ``y`` = requests,
one fit below 96 requests and one above) and ships the fits for its simulator
(``simdistserve/estimators/profile_data/profiler-a100-80g.{vllm,distserve}.json``; ``bench/data/distserve_a100.csv``).
The raw times are not published, so the fits stand for them here, each within its own fit error (not published
either).

flexmesh prices the same iterations on the catalogue's A100-80GB, OPT-13B and OPT-66B from their config.json's
fields, at every grid point of DistServe's profiling script (OPT-13B at tp 1, 2, 4; OPT-66B at tp 2, 3, 4: the model
and tp pairs whose grid the script lists). DistServe's vLLM baseline is priced with the ``vllm-v0`` engine
description (prompts first and whole, Ray workers; its kernel rates fitted to Vidur's profiles of sarathi-serve,
another vLLM 0.2 fork, by ``bench/vidur_layers.py``), and beside it with every iteration eager (``cuda_graphs =
false``): vLLM before 0.2.6 had no CUDA graphs, and which version DistServe's fork is was not published. DistServe's
own engine is priced with the ``distserve`` preset, written from DistServe's repository without a profile of its
kernels: prompts first and whole, every iteration eager (DistServe captures no CUDA graphs), vLLM's CPU costs, no
worker RPC beyond tp 1 (its workers are Ray actors at every tp) and the device layer's kernels at their own rates.
No constant was fitted to these rows: every figure is out of sample. Per engine, model and tp: the median and signed
median relative error of prefill and decode iterations; then each engine's large prefills (8 prompts of 1024
tokens), where the GEMMs' rate decides the time; then the tp speedups of OPT-13B each way.

Usage: ``python -m bench.distserve_vllm [--no-record]``.
"""

from __future__ import annotations

import argparse
import csv
from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np

from bench._results import markdown_table, record
from flexmesh.cost.device.hardware import Hardware
from flexmesh.serve.layout.engine import EngineSpec, engine_spec
from flexmesh.spec.cluster import parse_cluster
from flexmesh.spec.hf_priced import priced_from_hf_dict
from flexmesh.spec.model import ModelSpec

DEPENDS_ON = ("flexmesh/cost", "flexmesh/serve/layout", "flexmesh/spec", "flexmesh/errors.py", "flexmesh/files.py",
              "flexmesh/inputs.py", "flexmesh/units.py", "bench/data/distserve_a100.csv")
DATA = Path(__file__).parent / "data" / "distserve_a100.csv"
BOUND = 0.15  # #75's bound on a per-layer profile's median error, held here by whole iterations
# The models' config.json fields (facebook/opt-13b, facebook/opt-66b on the Hugging Face Hub)
CONFIGS = {
    "facebook/opt-13b": {"model_type": "opt", "num_hidden_layers": 40, "hidden_size": 5120, "num_attention_heads": 40,
                         "ffn_dim": 20480, "vocab_size": 50272, "max_position_embeddings": 2048,
                         "torch_dtype": "float16"},
    "facebook/opt-66b": {"model_type": "opt", "num_hidden_layers": 64, "hidden_size": 9216, "num_attention_heads": 72,
                         "ffn_dim": 36864, "vocab_size": 50272, "max_position_embeddings": 2048,
                         "torch_dtype": "float16"},
}
# DistServe's profiling grid (evaluation/0-test-single-forward-performance/main.py, get_profiling_params): batch
# sizes, prompt lengths, 16 tokens decoded, and the most tokens a batch may hold per (model, tp), rounded up to 16
BATCHES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192)
LENGTHS = (4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 284, 512, 768, 1024, 1536, 2020)
OUTPUT = 16
LIMITS = {("facebook/opt-13b", 1): 49152, ("facebook/opt-13b", 2): 98304, ("facebook/opt-13b", 4): 250000,
          ("facebook/opt-66b", 2): 8192, ("facebook/opt-66b", 3): 36864, ("facebook/opt-66b", 4): 65000}
CLUSTER = "1x8xA100-80GB"
# each profiled engine and the descriptions that price it, the first the one its verdicts are on
PRICED_BY = {"vllm": ("vllm-v0", "vllm-v0, eager"), "distserve": ("distserve",)}
ENGINES = PRICED_BY["vllm"]
LARGE = (8, 1024)  # a large prefill (prompts, tokens each) every model and tp's grid holds


@cache
def profile() -> dict[tuple[str, str, int, str], tuple[float, float, float, int]]:
    """(engine, model, tp, kind) -> DistServe's fit (a ms, b, c) and its decode threshold."""
    with open(DATA) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return {(r["engine"], r["model"], int(r["tp"]), r["kind"]): (float(r["a_ms"]), float(r["b"]), float(r["c"]),
                                                                 int(r["threshold"])) for r in rows}


def profile_s(model: str, tp: int, kind: str, batch: int, length: int, engine: str = "vllm") -> float:
    """DistServe's fitted seconds of one iteration of ``engine``: a prefill of ``batch`` prompts of ``length``
    tokens, or a decode step of ``batch`` requests of ``length`` context tokens each."""
    if kind == "prefill":
        a, b, c, _ = profile()[engine, model, tp, "prefill"]
        return (a + b * batch * length + c * batch * length ** 2) * 1e-3
    threshold = profile()[engine, model, tp, "decode_small"][3]
    a, b, c, _ = profile()[engine, model, tp, "decode_small" if batch <= threshold else "decode_large"]
    return (a + b * batch * length + c * batch) * 1e-3


def grid(model: str, tp: int) -> list[tuple[int, int]]:
    """The (batch, prompt length) pairs DistServe profiled ``model`` at ``tp`` on."""
    limit = LIMITS[model, tp]
    return [(b, n) for b in BATCHES for n in LENGTHS if b * ((n + 15) // 16 * 16) <= limit]


@cache
def model_spec(model: str) -> ModelSpec:
    return priced_from_hf_dict(CONFIGS[model], model.split("/")[1])


def engine(name: str) -> EngineSpec:
    """A preset (``vllm-v0``, ``distserve``), or ``vllm-v0`` with every iteration eager."""
    if name in ("vllm-v0", "distserve"):
        return engine_spec(name)
    if name == "vllm-v0, eager":
        return replace(engine_spec("vllm-v0"), cuda_graphs=False, graph_batch=0, graph_tokens=0)
    raise ValueError(f"unknown description {name!r}; known: {', '.join(n for d in PRICED_BY.values() for n in d)}")


@cache
def _iteration(name: str, model: str, tp: int):  # noqa: ANN202
    m = model_spec(model)
    return engine(name).iteration(m, Hardware(parse_cluster(CLUSTER), m.dtype), tp)


def priced_s(name: str, model: str, tp: int, kind: str, batch: int, length: int) -> float:
    """flexmesh's seconds of the same iteration (a decode step at the middle of the 16 tokens decoded)."""
    it = _iteration(name, model, tp)
    if kind == "prefill":
        return it.iteration_s([(0, length)] * batch)
    return it.iteration_s([(length + OUTPUT // 2, 1)] * batch)


def cases() -> list[dict]:
    """Every grid point of every profiled engine, with each description's relative error."""
    out = []
    for eng, names in PRICED_BY.items():
        for model, tp in LIMITS:
            for batch, length in grid(model, tp):
                for kind in ("prefill", "decode"):
                    measured = profile_s(model, tp, kind, batch, length, eng)
                    row = {"engine": eng, "model": model, "tp": tp, "kind": kind, "batch": batch, "length": length,
                           "measured": measured}
                    for name in names:
                        row[name] = priced_s(name, model, tp, kind, batch, length) / measured - 1
                    out.append(row)
    return out


def speedups(name: str, kind: str, points: list[tuple[int, int]], eng: str = "vllm") -> list[str]:
    """OPT-13B's tp 2 and tp 4 over tp 1 at ``points`` (batch, length): DistServe's fits of ``eng`` and
    flexmesh's prices by the description ``name``."""
    model = "facebook/opt-13b"
    out = []
    for batch, length in points:
        fit = [profile_s(model, tp, kind, batch, length, eng) for tp in (1, 2, 4)]
        ours = [priced_s(name, model, tp, kind, batch, length) for tp in (1, 2, 4)]
        cells = [f"{fit[0] / fit[k]:.2f}x / {ours[0] / ours[k]:.2f}x" for k in (1, 2)]
        out.append(f"{kind} {batch}x{length}: tp2 {cells[0]}, tp4 {cells[1]}")
    return out


def large_prefills() -> list[list[str]]:
    """Per model and tp, each engine's fitted time of the large prefill and the price of its description."""
    rows = []
    for model, tp in LIMITS:
        cells = [model.split("/")[1], f"tp{tp}"]
        for eng, names in PRICED_BY.items():
            measured = profile_s(model, tp, "prefill", *LARGE, eng)
            priced = priced_s(names[0], model, tp, "prefill", *LARGE)
            cells += [f"{measured * 1e3:.1f}", f"{priced * 1e3:.1f}", f"{priced / measured - 1:+.1%}"]
        rows.append(cells)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    args = ap.parse_args(argv)
    every = cases()
    rows, verdicts, worst = [], [], 0.0
    for eng, names in PRICED_BY.items():
        for model, tp in LIMITS:
            for kind in ("prefill", "decode"):
                cs = [c for c in every if (c["engine"], c["model"], c["tp"], c["kind"]) == (eng, model, tp, kind)]
                for name in names:
                    e = np.array([c[name] for c in cs])
                    med = float(np.median(np.abs(e)))
                    verdict = ""
                    if name == "vllm-v0":
                        verdicts.append(med <= BOUND)
                        worst = max(worst, med)
                        verdict = f" {'PASS' if med <= BOUND else 'FAIL'}"
                    rows.append([eng, name, model.split("/")[1], f"tp{tp}", kind, str(len(cs)), f"{med:.1%}{verdict}",
                                 f"{float(np.median(e)):+.1%}"])
    doc = (__doc__ or "").split("\n\n")
    md = [doc[1].replace("\n", " "), "", doc[2].replace("\n", " "), "",
          f"Median |priced / DistServe's fit - 1| per engine, description, model, tp and kind (bound {BOUND:.0%}, "
          "held on the `vllm-v0` rows), and the signed median (negative: priced faster):", "",
          *markdown_table(["engine", "priced as", "model", "tp", "iterations", "grid points", "median error",
                           "signed"], rows), "",
          f"Large prefills ({LARGE[0]} prompts of {LARGE[1]} tokens), DistServe's fit and flexmesh's price (ms): vLLM "
          "by `vllm-v0`, DistServe by `distserve`:", "",
          *markdown_table(["model", "tp", "vLLM fit", "priced", "error", "DistServe fit", "priced", "error"],
                          large_prefills()), "",
          "OPT-13B's tensor-parallel speedup over tp 1, DistServe's fit / flexmesh's price:", ""]
    md += [f"- vLLM, {s}" for s in speedups("vllm-v0", "prefill", [(1, 128), (1, 2020), (8, 1024)])
           + speedups("vllm-v0", "decode", [(1, 512), (16, 512), (128, 512)])]
    md += [f"- DistServe, {s}" for s in
           speedups("distserve", "prefill", [(1, 128), (1, 2020), (8, 1024)], "distserve")
           + speedups("distserve", "decode", [(1, 512), (16, 512), (128, 512)], "distserve")]
    body = "\n".join(md)
    print(body)
    if not args.no_record:
        record("distserve_vllm", body, headline=f"vllm-v0 iterations vs DistServe's vLLM profile on A100-80GB: "
               f"{sum(verdicts)} of {len(verdicts)} model/tp/kind medians within {BOUND:.0%} (worst {worst:.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
