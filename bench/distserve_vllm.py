"""flexmesh's iteration prices of vLLM V0 against DistServe's profile of its vLLM baseline on A100-80GB.

DistServe (Zhong et al., OSDI 2024; github.com/LLMServe/DistServe, Apache-2.0, ``bench/data/distserve_LICENSE``)
timed its vLLM baseline (a fork of vLLM 0.2, ``vllm.LLM`` with Ray workers, fp16; its
``evaluation/0-test-single-forward-performance``) on one A100-80GB node over a grid of batches: 1 to 192 prompts of
4 to 2020 tokens each, within a token limit per model and tp, each run prefilling the batch in one iteration and
decoding 16 tokens. It fitted the times to ``a + b x + c y`` (``evaluation/1-fit-time-usage``: least squares on
relative error; prefill ``x`` = tokens, ``y`` = sum of the prompts' squared lengths; decode ``x`` = the batch's
context tokens, ``y`` = requests, one fit below 96 requests and one above) and ships the fits for its simulator
(``simdistserve/estimators/profile_data/profiler-a100-80g.vllm.json``; ``bench/data/distserve_vllm_a100.csv``).
The raw times are not published, so the fits stand for them here, each within its own fit error (not published
either).

flexmesh prices the same iterations with the ``vllm-v0`` engine description (prompts first and whole, Ray
workers; its kernel rates fitted to Vidur's profiles of sarathi-serve, another vLLM 0.2 fork, by
``bench/vidur_layers.py``) on the catalogue's A100-80GB, OPT-13B and OPT-66B from their config.json's fields, at
every grid point of DistServe's profiling script (OPT-13B at tp 1, 2, 4; OPT-66B at tp 2, 3, 4: the model and tp
pairs whose grid the script lists). No constant was fitted to these rows: every figure is out of sample. Beside
it, the same description with every iteration eager (``cuda_graphs = false``): vLLM before 0.2.6 had no CUDA
graphs, and which version DistServe's fork is was not published. Per model and tp: the median and signed median
relative error of prefill and decode iterations, then the tp speedups of OPT-13B each way.

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
              "flexmesh/inputs.py", "flexmesh/units.py", "bench/data/distserve_vllm_a100.csv")
DATA = Path(__file__).parent / "data" / "distserve_vllm_a100.csv"
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
ENGINES = ("vllm-v0", "vllm-v0, eager")


@cache
def profile() -> dict[tuple[str, int, str], tuple[float, float, float, int]]:
    """(model, tp, kind) -> DistServe's fit (a ms, b, c) and its decode threshold."""
    with open(DATA) as f:
        rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
    return {(r["model"], int(r["tp"]), r["kind"]): (float(r["a_ms"]), float(r["b"]), float(r["c"]),
                                                    int(r["threshold"])) for r in rows}


def profile_s(model: str, tp: int, kind: str, batch: int, length: int) -> float:
    """DistServe's fitted seconds of one iteration: a prefill of ``batch`` prompts of ``length`` tokens, or a decode
    step of ``batch`` requests of ``length`` context tokens each."""
    if kind == "prefill":
        a, b, c, _ = profile()[model, tp, "prefill"]
        return (a + b * batch * length + c * batch * length ** 2) * 1e-3
    threshold = profile()[model, tp, "decode_small"][3]
    a, b, c, _ = profile()[model, tp, "decode_small" if batch <= threshold else "decode_large"]
    return (a + b * batch * length + c * batch) * 1e-3


def grid(model: str, tp: int) -> list[tuple[int, int]]:
    """The (batch, prompt length) pairs DistServe profiled ``model`` at ``tp`` on."""
    limit = LIMITS[model, tp]
    return [(b, n) for b in BATCHES for n in LENGTHS if b * ((n + 15) // 16 * 16) <= limit]


@cache
def model_spec(model: str) -> ModelSpec:
    return priced_from_hf_dict(CONFIGS[model], model.split("/")[1])


def engine(name: str) -> EngineSpec:
    """The ``vllm-v0`` description, or it with every iteration eager."""
    base = engine_spec("vllm-v0")
    return base if name == "vllm-v0" else replace(base, cuda_graphs=False, graph_batch=0, graph_tokens=0)


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
    out = []
    for model, tp in LIMITS:
        for batch, length in grid(model, tp):
            for kind in ("prefill", "decode"):
                measured = profile_s(model, tp, kind, batch, length)
                row = {"model": model, "tp": tp, "kind": kind, "batch": batch, "length": length,
                       "measured": measured}
                for name in ENGINES:
                    row[name] = priced_s(name, model, tp, kind, batch, length) / measured - 1
                out.append(row)
    return out


def speedups(name: str, kind: str, points: list[tuple[int, int]]) -> list[str]:
    """OPT-13B's tp 2 and tp 4 over tp 1 at ``points`` (batch, length): DistServe's fits and flexmesh's prices."""
    model = "facebook/opt-13b"
    out = []
    for batch, length in points:
        fit = [profile_s(model, tp, kind, batch, length) for tp in (1, 2, 4)]
        ours = [priced_s(name, model, tp, kind, batch, length) for tp in (1, 2, 4)]
        cells = [f"{fit[0] / fit[k]:.2f}x / {ours[0] / ours[k]:.2f}x" for k in (1, 2)]
        out.append(f"{kind} {batch}x{length}: tp2 {cells[0]}, tp4 {cells[1]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--no-record", action="store_true", help="print only: leave bench/RESULTS.md alone")
    args = ap.parse_args(argv)
    every = cases()
    rows, verdicts, worst = [], [], 0.0
    for model, tp in LIMITS:
        for kind in ("prefill", "decode"):
            cs = [c for c in every if c["model"] == model and c["tp"] == tp and c["kind"] == kind]
            cells = [model.split("/")[1], f"tp{tp}", kind, str(len(cs))]
            for name in ENGINES:
                e = np.array([c[name] for c in cs])
                med = float(np.median(np.abs(e)))
                ok = med <= BOUND
                if name == ENGINES[0]:
                    verdicts.append(ok)
                    worst = max(worst, med)
                cells += [f"{med:.1%}" + (f" {'PASS' if ok else 'FAIL'}" if name == ENGINES[0] else ""),
                          f"{float(np.median(e)):+.1%}"]
            rows.append(cells)
    md = [(__doc__ or "").split("\n\n")[1].replace("\n", " "), "",
          f"Median |priced / DistServe's fit - 1| per model, tp and kind (bound {BOUND:.0%}, on the `vllm-v0` "
          "description), and the signed median (negative: priced faster):", "",
          *markdown_table(["model", "tp", "iterations", "grid points", "vllm-v0 median error", "vllm-v0 signed",
                           "eager median error", "eager signed"], rows), "",
          "OPT-13B's tensor-parallel speedup over tp 1, DistServe's fit / flexmesh's `vllm-v0` price:", ""]
    md += [f"- {s}" for s in speedups("vllm-v0", "prefill", [(1, 128), (1, 2020), (8, 1024)])
           + speedups("vllm-v0", "decode", [(1, 512), (16, 512), (128, 512)])]
    body = "\n".join(md)
    print(body)
    if not args.no_record:
        record("distserve_vllm", body, headline=f"vllm-v0 iterations vs DistServe's vLLM profile on A100-80GB: "
               f"{sum(verdicts)} of {len(verdicts)} model/tp/kind medians within {BOUND:.0%} (worst {worst:.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
