"""Experts over data ranks on this machine, measured: static, load-following and per-micro-batch placement.

The ``tiny-moe`` model (4 layers, hidden 256, 8 experts of 512, top 2, fp32, CPU) on 2 processes (gloo,
OMP_NUM_THREADS=1: one process per core), its experts sharded over both data ranks (ZeRO-2 for the
rest), ``--steps`` steps of ``--global-batch`` Python standard-library sources cut to ``--seq-len``
tokens, the same seed (so the same batches, weights and losses) under three placements:

- ``static``: experts 0-3 on rank 0, 4-7 on rank 1, never moved (Megatron-style expert parallelism);
- ``laer``: each step placed from the last step's load (LAER-MoE), replicas in the spare slot;
- ``current``: every layer of every micro-batch placed from its own routing.

The routing of a randomly initialised router is skewed (the static run records how much: its
routing.jsonl). Schedules are priced by profiles of this machine (``flexmesh profile hardware`` and
``model``, quick sweeps) with the expert imbalance replayed from the static run's routing trace
(``--routing``: each placement's own max/mean at 2 ranks); the static run, which records that trace,
is priced with the default figures. Figures: tokens/s and mean step time (steps after the first),
the speedup over static, the imbalance each met (max/mean routed tokens per rank, routing.jsonl), the
scheduler's predicted step against the measured one, the final loss (equal across placements: they
change who computes, not what). Writes a report with the experts page to ``--out`` and records the
section "experts_measured" of bench/RESULTS.md (not with ``--quick``); the machine is shared, so only
figures from a quiet machine count.

    python -m bench.experts_measured                  # 12 steps of 16 documents <= 512 tokens, about 3 minutes
    python -m bench.experts_measured --profiles DIR   # reuse hardware.json and model.json in DIR
    python -m bench.experts_measured --quick          # 4 steps; prints only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._results import markdown_table, record
from flexmesh.layout.plan import Plan, StagePlan
from flexmesh.layout.strategy import LayerStrategy

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit): it
# runs `flexmesh` commands, so the whole package.
DEPENDS_ON = ("flexmesh",)

MODEL = "tiny-moe"
PLACEMENTS = ("static", "laer", "current")


def flexmesh(*args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "flexmesh", *args], check=True, env=env)


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--profiles", type=Path, help="a folder holding hardware.json and model.json to reuse")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "flexmesh-experts-measured")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    steps = 4 if args.quick else args.steps
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    prof = args.profiles or out / "profiles"
    hw, mp = prof / "hardware.json", prof / "model.json"
    if not (hw.is_file() and mp.is_file()):
        prof.mkdir(parents=True, exist_ok=True)
        flexmesh("profile", "hardware", "--quick", "--nproc", "2", "--out", str(hw))
        flexmesh("profile", "model", "--model", MODEL, "--quick", "--nproc", "2", "--out", str(mp))
    st = LayerStrategy.parse("tp1-dp2z2")
    plan = out / "plan.json"
    Plan.uniform(model=MODEL, cluster="2xA100-80GB", world_size=2, pp=1, pipeline_schedule="1f1b", virtual_stages=1,
                 num_microbatches=1, seq_len=args.seq_len, global_batch=args.global_batch,
                 stages=(StagePlan(0, 4, (st,) * 4),)).save(plan)
    runs: dict[str, tuple[list[dict], list[dict]]] = {}
    for placement in PLACEMENTS:
        run = out / "runs" / placement
        trace = ["--routing", str(out / "runs" / "static" / "routing.jsonl")] if placement != "static" else []
        flexmesh("train", "--nproc", "2", "--plan", str(plan), "--corpus", "stdlib", "--max-steps", str(steps),
                 "--out", str(run), "--overwrite", "--no-progress", "--expert-placement", placement,
                 "--hardware-profile", str(hw), "--model-profile", str(mp), *trace)
        runs[placement] = (rows_of(run / "metrics.jsonl"), rows_of(run / "routing.jsonl"))

    table = []
    base = statistics.mean(r["step_time_s"] for r in runs["static"][0][1:])
    for placement, (metrics, routing) in runs.items():
        later = metrics[1:]
        step = statistics.mean(r["step_time_s"] for r in later)
        pred = statistics.mean(r["predicted_step_time_s"] for r in later)
        tokens = statistics.mean(r["tokens_per_s"] for r in later)
        met = statistics.mean(r["imbalance"] for r in routing if r["step"] > 1)
        static = statistics.mean(r["static_imbalance"] for r in routing if r["step"] > 1)
        table.append([placement, f"{tokens:,.0f}", f"{step:.3f}", f"{base / step:.2f}x", f"{met:.3f}", f"{static:.3f}",
                      f"{pred:.3f}", f"{(pred - step) / step:+.1%}", "trace" if placement != "static" else "defaults",
                      f"{metrics[-1]['loss']:.6f}"])
    load = os.getloadavg()[0]
    md = [f"{MODEL}, 2 processes x 1 thread, experts over both data ranks (tp1-dp2z2), {steps} steps of "
          f"{args.global_batch} standard-library files <= {args.seq_len} tokens; load average {load:.2f} at the "
          "end.", "",
          *markdown_table(["placement", "tokens/s", "mean step (s)", "vs static", "imbalance met",
                           "static on the same loads", "predicted step (s)", "predicted - measured",
                           "imbalance priced from", "final loss"], table)]
    print("\n".join(md))
    from flexmesh.report.experts import add_section
    from flexmesh.report.report import Report

    rep = Report("experts on this machine", out)
    rep.text("\n".join(md))
    add_section(rep, {k: v[1] for k, v in runs.items()}, out / "figures")
    print(f"report: {rep.write()}")
    if not args.quick:
        record("experts_measured", "\n".join(md), headline="tokens/s vs static placement: " + ", ".join(
            f"{r[0]} {r[3]}" for r in table if r[0] != "static"))


if __name__ == "__main__":
    main()
