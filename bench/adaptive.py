"""Adaptive per-step schedules, measured: tokens/s against ``fixed``, and the simulator against the clock.

On this machine: the ``tiny`` model (4 layers, hidden 256; fp32, CPU), ``--nproc`` processes (gloo),
the Python standard library's sources tokenized by the project's BPE (heavy-tailed: a few dozen
tokens to hundreds of thousands, truncated to ``--max-len``), ``--steps`` steps of
``--global-batch`` documents. Every run trains with ``flexmesh train`` on the same batches (same
seed, same loader) from the same initial weights, with a replicated ZeRO-2 layout over all ranks:

- ``fixed`` with each static context-parallel degree (1, 2, 4 ranks per slot; its best is the baseline);
- ``hdp`` and ``milp`` (adaptive: scheduled in the background, ``hdp`` when late), with group sizes and
  micro-batch counts chosen per step.

Schedules are priced by profiles of this machine (``flexmesh profile hardware|model --quick`` with
the same number of processes), and each schedule's predicted step time is the step simulator's.
Reported per run: tokens/s (the first step left out as warm-up), mean per-step imbalance of measured
busy time (max / mean over ranks), fallbacks, and the median |predicted - measured| / measured step
time. Records the section "adaptive" of bench/RESULTS.md.

    python -m bench.adaptive             # full run (about 8 minutes on 2 cores)
    python -m bench.adaptive --quick     # 3 steps, small batches, prints only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flexmesh.runtime.launch import child_env  # noqa: E402  (after the path: `python bench/adaptive.py` works)

MODEL = "tiny"


def flexmesh(argv: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "flexmesh", *argv], env=child_env(), capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"flexmesh {' '.join(argv)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def batch_ratios(global_batch: int, max_len: int, steps: int, seed: int) -> np.ndarray:
    """max / min document length of each step's batch, as the trainer's loader draws them."""
    from flexmesh.data.corpus import stdlib_corpus
    from flexmesh.data.loader import DocumentLoader, load_corpus_tokens
    from flexmesh.spec.model import parse_model

    tokens, _ = load_corpus_tokens(stdlib_corpus(), vocab_size=parse_model(MODEL).vocab)
    loader = DocumentLoader(tokens, global_batch=global_batch, max_len=max_len, seed=seed)
    out = []
    for _ in range(steps):
        lens = [len(d) for d in next(loader)]
        out.append(max(lens) / min(lens))
    return np.array(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=6)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profiles", help="folder holding hardware.json and model.json to reuse instead of profiling")
    ap.add_argument("--quick", action="store_true", help="3 steps of 6 documents up to 2048 tokens; prints only")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.global_batch, args.max_len = 3, 6, 2048

    from rich.console import Console
    from rich.table import Table

    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.report.demo import run_summary
    from flexmesh.spec.model import parse_model

    console = Console(width=max(Console().width, 140))
    n = args.nproc
    runs = {f"fixed cp={c}": ["--policy", "fixed", "--cp", str(c)] for c in (1, 2, 4) if c <= n}
    runs["hdp"] = ["--policy", "hdp"]
    runs["milp (adaptive, hdp fallback)"] = ["--policy", "milp", "--adaptive", "--fallback-policy", "hdp"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prof = Path(args.profiles) if args.profiles else tmp
        hw, mp = prof / "hardware.json", prof / "model.json"
        if not args.profiles:
            console.print(f"profiling this machine and {MODEL} with {n} processes", highlight=False)
            flexmesh(["profile", "hardware", "--quick", "--nproc", str(n), "--out", str(hw), "--no-progress"])
            flexmesh(["profile", "model", "--model", MODEL, "--quick", "--nproc", str(n), "--out", str(mp),
                      "--no-progress"])
        spec = parse_model(MODEL)
        s = LayerStrategy.parse(f"tp1-dp{n}z2")
        plan = Plan(model=MODEL, cluster=f"{n}xcpu", world_size=n, pp=1, pipeline_schedule="1f1b", num_microbatches=1,
                    seq_len=args.max_len, global_batch=args.global_batch,
                    stages=(StagePlan(0, spec.num_layers, (s,) * spec.num_layers),), cost_source="profile")
        plan_path = tmp / "plan.json"
        plan.save(plan_path)
        metrics = {}
        for i, (label, extra) in enumerate(runs.items()):
            console.print(f"training {args.steps} steps: {label}", highlight=False)
            out = tmp / f"run{i}"
            flexmesh(["train", "--plan", str(plan_path), "--corpus", "stdlib", "--max-steps", str(args.steps),
                      "--out", str(out), "--nproc", str(n), "--no-resume", "--no-progress", "--seed", str(args.seed),
                      "--hardware-profile", str(hw), "--model-profile", str(mp), *extra])
            metrics[label] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    ratios = batch_ratios(args.global_batch, args.max_len, args.steps, args.seed)
    sums = {k: run_summary(v) for k, v in metrics.items()}
    fixed = {k: v for k, v in sums.items() if k.startswith("fixed")}
    best_fixed = max(fixed, key=lambda k: fixed[k]["tokens_per_s"])
    adaptive = {k: v for k, v in sums.items() if not k.startswith("fixed")}
    best = max(adaptive, key=lambda k: adaptive[k]["tokens_per_s"])
    base = sums[best_fixed]["tokens_per_s"]
    table = Table(title=f"{MODEL} on {n} CPU processes, stdlib corpus, {args.global_batch} documents <= {args.max_len} "
                        f"tokens per step, {args.steps} steps")
    cols = ("run", "tokens/s", "vs best fixed", "mean step s", "imbalance", "fallbacks", "median step-time error")
    for c in cols:
        table.add_column(c, justify="left" if c == "run" else "right")
    md_rows = []
    for label, d in sums.items():
        cells = (label, f"{d['tokens_per_s']:,.0f}", f"{d['tokens_per_s'] / base:.2f}x", f"{d['step_time_s']:.2f}",
                 f"{d['imbalance']:.3f}", str(d["fallbacks"]),
                 "-" if d["predicted_error"] is None else f"{d['predicted_error']:.1%}")
        table.add_row(*cells)
        md_rows.append(cells)
    console.print(table)
    pred = [(r["predicted_step_time_s"], r["step_time_s"]) for v in metrics.values() for r in v[1:]
            if r.get("predicted_step_time_s")]
    from flexmesh.report import median_abs_error

    err = median_abs_error([p for p, _ in pred], [m for _, m in pred])
    lines = [f"best adaptive ({best}) vs fixed with its best static degree ({best_fixed}): "
             f"{sums[best]['tokens_per_s'] / base:.2f}x tokens/s",
             f"simulator vs measured step time, all runs: median |error| {err:.1%} over {len(pred)} steps",
             f"document lengths per batch, max/min: median {np.median(ratios):.0f}x, min {ratios.min():.0f}x, "
             f"{(ratios >= 100).mean():.0%} of batches >= 100x"]
    for line in lines:
        console.print(line, highlight=False)
    if not args.quick:
        from bench._results import markdown_table, record

        md = [f"`{MODEL}` (4 layers, hidden 256, fp32) on {n} processes of this machine ({os.cpu_count()} cores, gloo, "
              f"OMP_NUM_THREADS=1); Python standard-library sources, {args.global_batch} documents per step truncated "
              f"to {args.max_len} tokens, {args.steps} steps, the same batches and initial weights for every run; "
              "replicated ZeRO-2 layout over all ranks; schedules priced by quick profiles of this machine; "
              "tokens/s leaves out the first step.", "",
              *markdown_table(cols, md_rows), "",
              *[f"- {line}" for line in lines]]
        record("adaptive", "\n".join(md))


if __name__ == "__main__":
    main()
