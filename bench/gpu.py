"""One GPU: flexmesh's training step against transformers at the same shape, and the plan's prediction.

Model: a Llama of TinyLlama-1.1B's shape (22 layers, hidden 2048, 32 query / 4 KV heads, FFN 5632,
vocabulary 32,000; ``tinyllama-1.1b`` with 8192 positions), bf16 autocast over fp32 master weights,
AdamW (fused on CUDA for both), one process, the same initial weights (transformers initialises the
model, flexmesh loads its safetensors) and the same random token ids. Cases:

=======  ======================================  ========================  ==================
case     documents per step                      tokens per micro-batch    micro-batches
=======  ======================================  ========================  ==================
2048     16 of 2,048 tokens                      8,192 (4 documents)       4
8192     4 of 8,192 tokens                       8,192                     4
mix      40 shipped Wikipedia lengths, <= 8,192  <= 8,192, packed          as packing needs
=======  ======================================  ========================  ==================

Both run the micro-batches flexmesh's ``fixed`` policy packs under the plan's budget (the plan:
``seq_len`` the longest document, the step's documents split so that one micro-batch holds 8,192
tokens): flexmesh as one packed row per micro-batch with document-causal attention; transformers
(``LlamaForCausalLM``, ``attn_implementation="sdpa"``, eager: what its users run without
flash-attn) as the micro-batch's documents padded to its longest, each micro-batch's loss weighted
by its label tokens so that the step's loss and gradients are the global mean in both. Each system
runs in its own process, so memory, caches and compilation start fresh; the first step's time
(compilation included for flexmesh's default ``--compile``) is reported apart, throughput is over
the steps after the first two.

Columns: real (unpadded) tokens/s; model TFLOP/s counting 6N + causal attention
(``ModelSpec.model_flops``: N the linear weights and the head, attention ``6 q_dim sum(len^2)`` per
layer) over the measured step; MFU against the device preset's datasheet bf16 peak; predicted step
time from the device preset (``--cluster``, default the preset of the GPU's family) and, with
``--hardware-profile``/``--model-profile``, from profiles taken on the GPU; the loss of step 1
(before any update) in both, which must agree.

    python -m bench.gpu                   # on a CUDA machine; records "gpu" in bench/RESULTS.md
    python -m bench.gpu --model-config m  # m/config.json: the model's shape, for `flexmesh profile model --model m`
    python -m bench.gpu --cpu --no-record # the same code on a tiny model on CPU (tests/test_bench_gpu.py)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit).
DEPENDS_ON = ("flexmesh/runtime", "flexmesh/profile", "flexmesh/schedule", "flexmesh/sim", "flexmesh/cost",
              "flexmesh/data", "flexmesh/layout", "flexmesh/spec", "flexmesh/errors.py", "flexmesh/files.py",
              "flexmesh/inputs.py", "flexmesh/units.py", "bench/gpu_torchtitan.py", "bench/gpu_case.py")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_case import (  # noqa: E402
    CPU_CASES,
    GPU_CASES,
    Case,
    case_of,
    device_of,
    make_plan,
    make_steps,
    model_spec,
    schedules,
    sync,
    traced_step,
)

WARMUP = 2  # steps left out of throughput for every system compared: the first compiles, both warm the allocator


def peak_flops(cluster: str | None, dtype: str) -> float | None:
    if cluster is None:
        return None
    from flexmesh.spec.cluster import parse_cluster

    return parse_cluster(cluster).device.peak_flops(dtype)


# ---- workers (one process per system and case) ----------------------------------------------------------
def flexmesh_worker(a: argparse.Namespace) -> dict:
    import time

    import torch

    from flexmesh.runtime.launch import single_process_env
    from flexmesh.runtime.parallel.distributed import init_distributed
    from flexmesh.runtime.train.config import TrainConfig
    from flexmesh.runtime.train.trainer import Trainer

    spec, case = model_spec(a.cpu), case_of(a)
    os.environ.update(single_process_env())
    init_distributed(timeout_s=600, device="cpu" if a.cpu else "auto")
    plan = make_plan(spec, case, a.cluster or "1xA100-80GB")
    steps_docs = make_steps(spec, case, a.steps)
    costs = {}
    if a.cluster:
        from flexmesh.cost import CostModel
        from flexmesh.spec.cluster import parse_cluster

        costs["preset"] = CostModel(spec, parse_cluster(a.cluster))
    if a.hardware_profile or a.model_profile:
        from flexmesh.profile.use import cost_model_from_profiles

        costs["profile"] = cost_model_from_profiles(spec, hardware=a.hardware_profile, model=a.model_profile, world=1)
    predicted = {k: [s.predicted_step_time for s in schedules(spec, plan, steps_docs, case.doc_len, c)]
                 for k, c in costs.items()}
    steps = schedules(spec, plan, steps_docs, case.doc_len)
    variant = a.mode[1].partition("-")[2] if "-" in a.mode[1] else ""  # flexmesh-eager, -liger, -flex, -gqa
    if variant == "gqa":  # the varlen kernel given the key/value heads as they are (attention_kernels)
        from flexmesh.runtime.model import attention_kernels as AK

        AK.VARLEN_NATIVE_GQA = True
    if variant == "flex":  # FlexAttention ahead of the other kernels that serve the case (compiled, document mask)
        from flexmesh.runtime.model import attention_kernels as AK

        AK.KERNELS = {"flex": AK.KERNELS["flex"], **{k: v for k, v in AK.KERNELS.items() if k != "flex"}}
    compile_ = False if variant in ("eager", "liger") else a.compile
    config = TrainConfig(max_steps=a.steps + (1 if a.trace else 0), lr=1e-4, dtype="fp32" if a.cpu else "bf16",
                         progress=False, compile=compile_)
    t0 = time.perf_counter()
    trainer = Trainer(plan, spec, config, weights=a.weights)
    if variant == "liger":
        apply_liger(trainer.modules)
    setup = time.perf_counter() - t0
    rows = []
    for docs, schedule in zip(steps_docs, steps):
        m = trainer.step(docs, schedule)
        rows.append({"time_s": m.step_time_s, "tokens": m.tokens, "loss": m.loss, "microbatches": m.microbatches})
    kernel = m.attention_kernel + (" + Liger norms/SwiGLU/loss" if variant == "liger" else "") + (
        " (kv heads not repeated)" if variant == "gqa" and m.attention_kernel == "varlen" else "")
    out = {"setup_s": setup, "steps": rows, "kernel": kernel, "compiled": bool(trainer.config.compile),
           "predicted": predicted, "device": torch.cuda.get_device_name() if trainer.device.type == "cuda" else "CPU",
           "peak_gib": m.peak_memory_gib}
    if a.trace:  # one more step (the first step's documents again) under the profiler
        out["trace"] = traced_step(lambda: trainer.step(steps_docs[-1], steps[-1]), trainer.device.type)
    import torch.distributed as dist

    dist.destroy_process_group()
    return out


def apply_liger(modules) -> None:  # noqa: ANN001
    """Liger-Kernel's Triton kernels in place of the eager model's RMSNorm, SwiGLU and chunked loss (the
    candidate against compiled blocks, which fuse the same operations through Inductor)."""
    import torch
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy, liger_rms_norm, liger_swiglu

    import flexmesh.runtime.model.transformer as T

    def norm(self, x):  # noqa: ANN001, ANN202
        return liger_rms_norm(x, self.weight, self.eps or 1e-6, in_place=False)

    def ffn(self, x, row=None):  # noqa: ANN001, ANN202
        return self.w2(liger_swiglu(self.w1(x), self.w3(x)))

    def loss(h, weight, labels):  # noqa: ANN001, ANN202
        bf16 = torch.bfloat16
        return liger_fused_linear_cross_entropy(h.reshape(-1, h.shape[-1]).to(bf16), weight.to(bf16),
                                                labels.reshape(-1), reduction="sum", accum_dtype=torch.float32)

    for root in modules:
        for mod in root.modules():
            if isinstance(mod, torch.nn.RMSNorm):
                mod.forward = norm.__get__(mod)
            elif isinstance(mod, T.FeedForward):
                mod.forward = ffn.__get__(mod)
    T.linear_cross_entropy = loss


def transformers_worker(a: argparse.Namespace) -> dict:
    import time

    import torch
    import transformers

    from flexmesh.runtime.model.packing import IGNORE_INDEX

    spec, case = model_spec(a.cpu), case_of(a)
    device = device_of(a.cpu)
    plan = make_plan(spec, case, "1xA100-80GB")
    steps_docs = make_steps(spec, case, a.steps)
    steps = schedules(spec, plan, steps_docs, case.doc_len)
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(a.hf_folder, dtype=torch.float32,
                                                              attn_implementation="sdpa").to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                            fused=device.type == "cuda")
    setup = time.perf_counter() - t0
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=not a.cpu)
    rows = []
    for docs, schedule in zip(steps_docs, steps):
        sync(device)
        t0 = time.perf_counter()
        label_tokens = sum(len(docs[p.seq_id]) - 1 for g in schedule.groups for mb in g.microbatches for p in mb)
        total = torch.zeros((), device=device)
        for mb in schedule.groups[0].microbatches:
            rows_docs = [docs[p.seq_id][p.start:p.end] for p in mb]
            width = max(len(d) for d in rows_docs)
            ids = torch.zeros((len(rows_docs), width), dtype=torch.long)
            labels = torch.full((len(rows_docs), width), IGNORE_INDEX, dtype=torch.long)
            mask = torch.zeros((len(rows_docs), width), dtype=torch.long)
            for i, d in enumerate(rows_docs):
                ids[i, :len(d)] = torch.from_numpy(d)
                labels[i, :len(d)] = torch.from_numpy(d)
                mask[i, :len(d)] = 1
            n = sum(len(d) - 1 for d in rows_docs)
            with autocast:
                out = model(input_ids=ids.to(device), attention_mask=mask.to(device) if width * len(rows_docs)
                            != int(mask.sum()) else None, labels=labels.to(device))
            loss = out.loss * (n / label_tokens)  # transformers averages over the micro-batch's label tokens
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = float(total)
        sync(device)
        rows.append({"time_s": time.perf_counter() - t0, "tokens": sum(len(d) for d in docs), "loss": loss_value,
                     "microbatches": len(schedule.groups[0].microbatches)})
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return {"setup_s": setup, "steps": rows, "kernel": "sdpa (padded rows)", "compiled": False, "predicted": {},
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "CPU", "peak_gib": peak}


# ---- the parent: weights, workers, table ------------------------------------------------------------------
def hf_weights(spec, folder: Path, seed: int = 0) -> Path:
    """transformers' own initialisation of ``spec`` saved in ``folder`` (config.json + safetensors)."""
    import torch
    import transformers

    from flexmesh.spec.hf import to_hf_config

    cfg = transformers.AutoConfig.for_model(**to_hf_config(replace(spec, dtype="fp32")))
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return folder


def run_worker(system: str, case: Case, a: argparse.Namespace, folder: Path) -> dict:
    """``system``'s run of ``case`` in a process of its own: its result, or ``{"failed": why}`` ("OOM" where it
    ran out of memory) so that one system's failure costs its own row only."""
    out = folder / f"{system}-{case.name}.json"
    cmd = [sys.executable, "-m", "bench.gpu", "worker", system, "--case", case.name, "--steps", str(a.steps),
           "--out", str(out), "--hf-folder", str(folder / "hf"), "--weights", str(folder / "hf" / "model.safetensors")]
    for flag in ("cluster", "hardware_profile", "model_profile"):
        if getattr(a, flag):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
    if a.cpu:
        cmd.append("--cpu")
    if a.trace and system in ("flexmesh", "torchtitan"):
        cmd.append("--trace")
    if a.compile is not None:
        cmd.append("--compile" if a.compile else "--no-compile")
    from flexmesh.runtime.launch import child_env

    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {a.timeout} s"}
    if proc.returncode == 0 and out.exists():
        return json.loads(out.read_text())
    text = proc.stdout + proc.stderr
    if "OutOfMemoryError" in text or "out of memory" in text.lower():
        return {"failed": "OOM"}
    last = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
    (folder / f"{system}-{case.name}.log").write_text(text[-20000:])
    return {"failed": f"failed: {last[0].strip()[:160]}", "log": text[-4000:]}


def importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def systems_of(case: Case, a: argparse.Namespace) -> list[str]:
    """The systems that run ``case``: transformers and flexmesh, and on a GPU torchtitan where it is installed
    (for the fixed-length cases). Named by ``--systems`` only, each a measured choice that lost:
    ``flexmesh-eager`` and ``flexmesh-liger`` (Liger-Kernel's norms, SwiGLU and loss on eager blocks: 48,199
    tokens/s against compiled blocks' 53,131 at 2048 on an H100 on 2026-11-27) and ``flexmesh-flex``
    (FlexAttention ahead of the varlen kernel: 60,425 against 59,908 at 2048 and 42,228 against 43,036 at
    8192 on an H200 at f10e0c6, with a first step of 49 s against 15 s), so compiled blocks over the varlen
    kernel stay the default. ``flexmesh-gqa`` runs by default where it would differ (:func:`varlen_repeats_kv`)."""
    if a.systems:
        return a.systems.split(",")
    systems = ["transformers", "flexmesh"]
    if not a.cpu and varlen_repeats_kv():  # a candidate until measured: flexmesh-gqa
        systems.append("flexmesh-gqa")
    if not a.cpu and not case.mixed and importable("torchtitan"):
        systems.append("torchtitan")
    return systems


def varlen_repeats_kv() -> bool:
    """Whether the varlen kernel repeats keys and values to the query heads here (this torch's varlen_attn has
    no ``enable_gqa`` and ``VARLEN_NATIVE_GQA`` is off): then ``flexmesh-gqa`` runs by default beside flexmesh."""
    from flexmesh.runtime.model import attention_kernels as AK

    found = AK._torch_varlen()
    return found is not None and "enable_gqa" not in found[1] and not AK.VARLEN_NATIVE_GQA


def summarise(spec, case: Case, result: dict, peak: float | None) -> dict:
    steps = result["steps"]
    timed = steps[WARMUP:] if len(steps) > WARMUP else steps
    seconds = sum(s["time_s"] for s in timed)
    tokens = sum(s["tokens"] for s in timed)
    flops = sum(spec.model_flops(s["tokens"], s.get("sq_tokens", 0.0)) for s in timed)
    return {"tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12,
            "mfu": flops / seconds / peak if peak else None, "first_step_s": steps[0]["time_s"],
            "step_s": seconds / len(timed), "loss1": steps[0]["loss"],
            "predicted": {k: float(np.mean(v[WARMUP:] if len(v) > WARMUP else v))
                          for k, v in result["predicted"].items()},
            "microbatches": float(np.mean([s["microbatches"] for s in timed])),
            "slowest_vs_median": max(s["time_s"] for s in timed) / float(np.median([s["time_s"] for s in timed])),
            "setup_s": result["setup_s"], "peak_gib": result.get("peak_gib")}


def _predicted(summary: dict, kind: str) -> str:
    """A predicted step time and its error against the measured one, or "-" where none was priced."""
    if kind not in summary["predicted"]:
        return "-"
    t = summary["predicted"][kind]
    return f"{t:.3f} s ({t / summary['step_s'] - 1:+.1%})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="*", help=argparse.SUPPRESS)  # "worker SYSTEM" in the children
    p.add_argument("--cpu", action="store_true", help="a tiny model on CPU (what the test suite runs)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--cluster", default=None, help="one-device cluster preset that prices the prediction "
                                                   "(default: the GPU family's; none on CPU)")
    p.add_argument("--hardware-profile", default=None)
    p.add_argument("--model-profile", default=None)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--no-record", action="store_true")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per worker")
    p.add_argument("--systems", default=None, help="comma-separated systems for every case (default: transformers, "
                   "flexmesh, and on a GPU torchtitan where installed; named only: flexmesh-eager, -liger, -flex, "
                   "-gqa)")
    p.add_argument("--results", metavar="FILE", help="append each run's summary to FILE (JSON lines) as it finishes")
    p.add_argument("--trace", action="store_true",
                   help="profile one more step of flexmesh and torchtitan: device time by kernel kind")
    p.add_argument("--model-config", metavar="DIR", help="write the config.json of the GPU cases' model to DIR and "
                   "exit: `flexmesh profile model --model DIR --dtype bf16` profiles that shape")
    # worker-only
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--hf-folder", help=argparse.SUPPRESS)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.model_config:
        from flexmesh.spec.hf import to_hf_config

        Path(a.model_config).mkdir(parents=True, exist_ok=True)
        (Path(a.model_config) / "config.json").write_text(json.dumps(to_hf_config(model_spec(False)), indent=1))
        return
    if a.mode[:1] == ["worker"]:
        if a.mode[1] == "torchtitan":
            from bench.gpu_torchtitan import torchtitan_worker as worker
        else:
            worker = flexmesh_worker if a.mode[1].startswith("flexmesh") else transformers_worker
        result = worker(a)
        Path(a.out).write_text(json.dumps(result))
        return
    import torch
    from rich.console import Console
    from rich.table import Table

    cpu = a.cpu or not torch.cuda.is_available()
    if not a.cpu and cpu:
        raise SystemExit("no GPU visible: run with --cpu for the tiny CPU version")
    a.cpu = cpu
    device_name = "CPU" if cpu else torch.cuda.get_device_name()
    if a.cluster is None and not cpu:
        from flexmesh.spec.cluster import preset_of_gpu

        preset = preset_of_gpu(device_name)
        a.cluster = f"1x{preset}" if preset else None
    spec = model_spec(cpu)
    cases = [c for c in (CPU_CASES if cpu else GPU_CASES) if a.cases is None or c.name in a.cases.split(",")]
    peak = peak_flops(a.cluster, "fp32" if cpu else "bf16") if not cpu else None
    console = Console(width=max(200, Console().width))
    record: dict = {}
    results = Path(a.results) if a.results else None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        hf_weights(spec, folder / "hf")
        for case in cases:
            for system in systems_of(case, a):
                console.print(f"{case.name}: {system} ...", highlight=False)
                result = run_worker(system, case, a, folder)
                if "failed" in result:
                    summary = None
                    console.print(f"{case.name}: {system} {result['failed']}", highlight=False)
                else:
                    for s, docs in zip(result["steps"], make_steps(spec, case, a.steps)):
                        s["sq_tokens"] = float(sum(float(len(d)) ** 2 for d in docs))
                    summary = summarise(spec, case, result, peak)
                    console.print(f"{case.name}: {system} {summary['tokens_per_s']:,.0f} tokens/s, first step "
                                  f"{summary['first_step_s']:.1f} s", highlight=False)
                record[(case.name, system)] = (result, summary)
                if results is not None:  # each run as it finishes: a later crash loses nothing before it
                    with results.open("a") as f:
                        f.write(json.dumps({"case": case.name, "system": system, "device": device_name,
                                            "summary": summary, **{k: result[k] for k in ("failed", "trace", "kernel",
                                                                                         "version", "config")
                                                                  if k in result}}) + "\n")
            if not a.no_record:  # each case as it finishes: a run stopped part-way keeps the cases before
                write_record(spec, cases, record, a, device_name)
    rows = table_rows(cases, record, a)
    table = Table(title=f"{spec.name} on {device_name}, torch {torch.__version__}")
    for c in COLUMNS:
        table.add_column(c)
    for r in rows:
        table.add_row(*r)
    console.print(table)
    for line in trace_lines(record):
        console.print(line, highlight=False)
    print(json.dumps({f"{k[0]}/{k[1]}": v[1] if v[1] else {"failed": v[0]["failed"]} for k, v in record.items()}))


COLUMNS = ["case", "system", "attention", "tokens/s", "vs transformers", "vs torchtitan", "TFLOP/s", "MFU",
           "micro-batches", "step s", "slowest / median", "first step s", "peak GiB", "predicted (preset)",
           "predicted (profile)", "loss step 1"]


def table_rows(cases: list[Case], record: dict, a: argparse.Namespace) -> list[list[str]]:
    """One row per (case, system) run so far: its figures, or why it has none (OOM, failed)."""
    def ratio(case: Case, s: dict, other: str) -> str:
        base = record.get((case.name, other), (None, None))[1]
        return f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"

    rows = []
    for case in cases:
        for system in systems_of(case, a):
            if (case.name, system) not in record:
                continue
            result, s = record[(case.name, system)]
            if s is None:
                rows.append([case.name, system, result["failed"], *["-"] * (len(COLUMNS) - 3)])
                continue
            name = result["kernel"] + (", compiled" if result["compiled"] else "")
            rows.append([case.name, system, name + (f" ({result['version']})" if result.get("version") else ""),
                         f"{s['tokens_per_s']:,.0f}", ratio(case, s, "transformers"), ratio(case, s, "torchtitan"),
                         f"{s['tflops']:.1f}", f"{s['mfu']:.1%}" if s["mfu"] else "-", f"{s['microbatches']:.1f}",
                         f"{s['step_s']:.3f}", f"{s['slowest_vs_median']:.2f}", f"{s['first_step_s']:.1f}",
                         f"{s['peak_gib']:.1f}" if s["peak_gib"] else "-", _predicted(s, "preset"),
                         _predicted(s, "profile"), f"{s['loss1']:.5f}"])
    return rows


def trace_lines(record: dict) -> list[str]:
    """The profiled steps: wall time, the device's busy time and its split by kernel kind."""
    return [f"{case} {system}, one step under the profiler: wall {t['wall_s'] * 1e3:.0f} ms, device busy "
            f"{t['busy_s'] * 1e3:.0f} ms: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in t["kinds"].items())
            for (case, system), (result, _) in record.items() if (t := result.get("trace"))]


# The GPU targets (MFU at each case, the ratio to torchtitan with both compiled, the preset's prediction,
# steady steps): ``case: minimum MFU``, the ratio, the prediction's error, the slowest step over the median.
MFU_TARGETS = {"2048": 0.50, "8192": 0.45}
TORCHTITAN_RATIO, PREDICTION_ERROR, SLOWEST = 1.1, 0.05, 1.2


def target_lines(record: dict) -> list[str]:
    """Each GPU target as PASS or FAIL, for the flexmesh rows run so far."""
    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    lines = []
    for (case, system), (result, s) in record.items():
        if system != "flexmesh":
            continue
        if s is None:
            lines.append(f"{case}: flexmesh completes: {verdict(False)} ({result['failed']})")
            continue
        lines.append(f"{case}: flexmesh completes: {verdict(True)}")
        if case in MFU_TARGETS and s["mfu"]:
            want = MFU_TARGETS[case]
            lines.append(f"{case}: MFU {s['mfu']:.1%} (>= {want:.0%}): {verdict(s['mfu'] >= want)}")
        titan = record.get((case, "torchtitan"), (None, None))[1]
        if titan:
            r = s["tokens_per_s"] / titan["tokens_per_s"]
            lines.append(f"{case}: {r:.2f}x torchtitan (>= {TORCHTITAN_RATIO}x): {verdict(r >= TORCHTITAN_RATIO)}")
        if "preset" in s["predicted"]:
            e = s["predicted"]["preset"] / s["step_s"] - 1
            lines.append(f"{case}: predicted step {e:+.1%} (within {PREDICTION_ERROR:.0%}): "
                         f"{verdict(abs(e) <= PREDICTION_ERROR)}")
        lines.append(f"{case}: slowest step after the second {s['slowest_vs_median']:.2f}x the median (<= {SLOWEST}x): "
                     f"{verdict(s['slowest_vs_median'] <= SLOWEST)}")
    return lines


def write_record(spec, cases: list[Case], record: dict, a: argparse.Namespace, device_name: str) -> None:  # noqa: ANN001
    """The record of the cases run so far (rewritten after each case, so a run stopped part-way keeps them)."""
    import torch

    from bench._results import markdown_table
    from bench._results import record as write

    done = [c for c in cases if all((c.name, s) in record for s in systems_of(c, a))]
    rows = table_rows(done, record, a)
    missing = [c.name for c in cases if c not in done]
    note = (f"{spec.name} ({spec.num_layers} layers, hidden {spec.hidden}), {'fp32' if a.cpu else 'bf16 autocast'}, "
            f"one process on {device_name}, torch {torch.__version__}; {a.steps} steps per run, throughput over "
            f"the steps after the first {WARMUP}; predicted from {a.cluster or 'no preset'}"
            f"{' and profiles' if a.hardware_profile or a.model_profile else ''}.\n"
            + (f"Cases not run (the run stopped before them): {', '.join(missing)}.\n" if missing else "")
            + "Reproduce: `python -m bench.gpu " + " ".join(_portable(sys.argv[1:])) + "`\n\n")
    ours = [r for r in rows if r[1] == "flexmesh"]
    headline = "flexmesh vs transformers tokens/s: " + ", ".join(f"{r[0]} {r[4]}" for r in ours) + (
        "; vs torchtitan: " + ", ".join(f"{r[0]} {r[5]}" for r in ours if r[5] != "-")
        if any(r[5] != "-" for r in ours) else "") + (
        "; predicted (preset): " + ", ".join(r[13] for r in ours) if any(r[13] != "-" for r in ours) else "")
    if not a.cpu:
        note += "\n".join(f"- {line}" for line in target_lines(record)) + "\n\n"
    traces = trace_lines({k: v for k, v in record.items() if k[0] in {c.name for c in done}})
    if traces:
        note += "\n".join(f"- {line}" for line in traces) + "\n\n"
    write("gpu-cpu" if a.cpu else "gpu", note + "\n".join(markdown_table(COLUMNS, rows)), script="gpu",
          headline=headline, gpu=not a.cpu)


def _portable(argv: list[str]) -> list[str]:
    """``argv`` as a record shows it: an absolute path (this machine's) by its file name under OUT.

    >>> _portable(["--steps", "7", "--results", "/root/out/bench.jsonl"])
    ['--steps', '7', '--results', 'OUT/bench.jsonl']
    """
    return [f"OUT/{Path(a).name}" if a.startswith("/") else a for a in argv]


if __name__ == "__main__":
    main()

