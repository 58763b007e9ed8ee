"""A plan of two replica groups on devices of different speeds, measured: fixed shares against per-step dispatch.

On this machine: the ``tiny`` model (4 layers, hidden 256, fp32, CPU), 2 processes (gloo,
OMP_NUM_THREADS=1: one process per core), a plan of two one-rank replica groups whose cluster file
says rank 1 runs at ``--factor`` of rank 0's speed, and rank 1's compute **emulated** that slow
(``flexmesh train --emulate-speed 1=FACTOR``: each forward and backward stretched by a busy wait). The
plan's shares follow the speeds (``--global-batch`` documents per step, rank 1 a ``FACTOR`` share of
rank 0's), each group packing micro-batches of up to ``--max-len`` tokens: what a planner that knows the
speeds but not each step's lengths gives. ``--steps`` steps of the Python standard library's sources laid
out as bench/adaptive.py's workload does (every step one or two documents of ``--max-len`` tokens,
``--medium`` of 1/16 to 1/2 of it, the rest at most 1/100 of it), the same batches in every run (same
corpus, tokenizer, seed; checked through each step's tokens).

- ``shares``: ``--policy shares``: group ``g`` takes the next ``share_g`` documents of each batch,
  blind to their lengths (what the runtime ran on such plans before per-step dispatch);
- ``dispatch+P``: ``--policy P``: each step's documents dispatched over the two groups by their
  predicted time at each group's speed, then packed inside each group by ``P`` (balanced, hdp).

Schedules are priced by profiles of this machine (``flexmesh profile hardware|model``; ``--quick``: the
quick sweeps), the slow rank by the plan's cluster file; each step's prediction is the simulator's
(``predicted_step_time_s``). Straggler re-planning is off (``--no-replan``), so the schedules stay as
made for the planned speeds. Every run trains ``--repeats`` times and each step counts its median
repeat (runs go one after another on a shared machine: the load average is recorded). Per run:
measured tokens/s (first step left out), the speedup over ``shares`` measured and predicted (the
simulator's step times of the same schedules). Targets: the best dispatch >= 1.2x ``shares``, its
predicted speedup within 0.05 of the measured one. Records the section "mixed_measured" of
bench/RESULTS.md with the commit (not with ``--quick``).

    python -m bench.mixed_measured                  # 10 steps of 12 documents <= 1024 tokens, 3 runs x 3 repeats,
                                                    # about 5 minutes, plus about 6 minutes of profiling
    python -m bench.mixed_measured --profiles DIR   # reuse hardware.json and model.json in DIR
    python -m bench.mixed_measured --quick          # 4 steps, 1 repeat, quick profiles; prints only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.adaptive import MODEL, flexmesh, machine_profiles, median_rows, summarise, workload  # noqa: E402

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit): it
# runs `flexmesh` commands, so the whole package.
DEPENDS_ON = ("flexmesh", "bench/adaptive.py")

NPROC = 2
POLICIES = ("balanced", "hdp")
TARGETS = {"speedup": 1.2, "prediction": 0.05}


def plan_file(folder: Path, global_batch: int, max_len: int, factor: float) -> Path:
    """Two one-rank groups of the whole model; shares by speed; one document per micro-batch slot of
    ``max_len`` tokens (the packing budget); the cluster file names the slow rank."""
    from flexmesh.layout.shares import split_by_weight
    from flexmesh.spec.model import parse_model

    layers = parse_model(MODEL).num_layers
    cluster = folder / "cluster.json"
    cluster.write_text(json.dumps({"nodes": 1, "devices_per_node": NPROC, "device": "A100-80GB",
                                   "speed_factors": [1.0, factor]}))
    shares = split_by_weight(global_batch, [1.0, factor])
    groups = [{"ranks": [str(r)], "share": b, "num_microbatches": b,
               "stages": [{"layers": [0, layers], "strategies": ["tp1-dp1z0"] * layers}]}
              for r, b in enumerate(shares)]
    plan = folder / "plan.json"
    plan.write_text(json.dumps({"version": 4, "model": MODEL, "cluster": str(cluster), "world_size": NPROC,
                                "seq_len": max_len, "global_batch": global_batch, "pipeline_schedule": "1f1b",
                                "groups": groups}))
    return plan


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=12)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--factor", type=float, default=0.5, help="rank 1's speed (default 0.5)")
    ap.add_argument("--medium", type=int, default=2, help="documents of 1/16 to 1/2 of --max-len per step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profiles", type=Path, help="reuse (or profile into) hardware.json and model.json here")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    steps, repeats = (4, 1) if args.quick else (args.steps, args.repeats)
    console = Console(width=150)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        hw, mp, provenance = machine_profiles(args.profiles or tmp / "profiles", NPROC, args.quick, console)
        plan = plan_file(tmp, args.global_batch, args.max_len, args.factor)
        corpus, tokenizer, batches, _ = workload(tmp, steps, args.global_batch, args.max_len, args.seed,
                                                 medium=args.medium)
        load_before = os.getloadavg()[0]
        runs = {"shares": ["--policy", "shares"], **{f"dispatch+{p}": ["--policy", p] for p in POLICIES}}
        metrics: dict[str, list[list[dict]]] = {name: [] for name in runs}
        for k in range(repeats):
            for name, flags in runs.items():
                console.print(f"round {k + 1}/{repeats}: {name}", highlight=False)
                out = tmp / f"{name}-{k}"
                flexmesh(["train", "--nproc", str(NPROC), "--plan", str(plan), "--corpus", str(corpus), "--tokenizer",
                          str(tokenizer), "--seed", str(args.seed), "--max-steps", str(steps), "--max-len",
                          str(args.max_len), "--out", str(out), "--no-progress",
                          "--hardware-profile", str(hw), "--model-profile", str(mp), "--emulate-speed",
                          f"1={args.factor}", "--no-replan", "--cache-dir", str(tmp / "cache"), *flags])
                metrics[name].append([json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()])
        load_after = os.getloadavg()[0]
    rows = {name: median_rows(reps) for name, reps in metrics.items()}
    tokens = {name: [r["tokens"] for r in rs] for name, rs in rows.items()}
    want = [int(b.sum()) for b in batches]
    assert all(t == want for t in tokens.values()), f"runs trained other batches than dealt: {tokens} vs {want}"
    figures = {name: summarise(rs) for name, rs in rows.items()}
    base = figures["shares"]
    table, record_rows = Table(title="plan of two replica groups, rank 1 at "
                                     f"{args.factor:g}x speed (emulated), measured on 2 processes"), []
    cols = ["run", "tokens/s", "speedup (measured)", "predicted tokens/s", "speedup (predicted)", "step s",
            "predicted step s"]
    for c in cols:
        table.add_column(c, justify="left" if c == "run" else "right")
    verdicts = []
    for name, d in figures.items():
        meas = d["tokens_per_s"] / base["tokens_per_s"]
        pred = (d["predicted_tokens_per_s"] / base["predicted_tokens_per_s"]
                if d["predicted_tokens_per_s"] and base["predicted_tokens_per_s"] else None)
        row = [name, f"{d['tokens_per_s']:,.0f}", f"{meas:.3f}x",
               f"{d['predicted_tokens_per_s']:,.0f}" if d["predicted_tokens_per_s"] else "-",
               f"{pred:.3f}x" if pred else "-", f"{d['step_time_s']:.3f}",
               f"{d['predicted_step_time_s']:.3f}" if d["predicted_step_time_s"] else "-"]
        table.add_row(*row)
        record_rows.append(row)
        if name != "shares":
            verdicts.append((name, meas, pred))
    console.print(table)
    best, meas, pred = max(verdicts, key=lambda v: v[1])
    lines = [f"- best dispatch {best}: {meas:.3f}x shares measured ({'PASS' if meas >= TARGETS['speedup'] else 'FAIL'}"
             f", target >= {TARGETS['speedup']}x); predicted {pred:.3f}x, off by {abs(pred - meas):.3f} "
             f"({'PASS' if abs(pred - meas) <= TARGETS['prediction'] else 'FAIL'}, target <= {TARGETS['prediction']})",
             f"- load average {load_before:.2f} before, {load_after:.2f} after (2 cores)"]
    same = [(n, f) for n, f in figures.items() if n != "shares"]
    if len({round(f["predicted_step_time_s"] or 0.0, 9) for _, f in same}) == 1 and len(same) > 1:
        spread = max(f["tokens_per_s"] for _, f in same) / min(f["tokens_per_s"] for _, f in same)
        lines.append(f"- {' and '.join(n for n, _ in same)} ran the same schedules (one data rank per group: every "
                     f"policy packs alike) and measured {spread - 1:.0%} apart: the spread of this clock here")
    console.print("\n".join(lines), highlight=False)
    if not args.quick:
        from bench._results import markdown_table, record

        note = (f"`tiny` on 2 processes of this machine (one per core), a plan of two one-rank replica groups, rank 1 "
                f"emulated at {args.factor:g}x speed and so named in the plan's cluster file; shares by speed "
                f"({args.global_batch} documents per step), micro-batches of up to {args.max_len} tokens, "
                f"{steps} steps of standard-library sources (bench/adaptive.py's workload, {args.medium} medium "
                f"documents per step), {repeats} repeats (each step's median), first step left out, straggler "
                f"re-planning off; schedules priced by {provenance}. Predicted: the simulator's step times of the "
                "same schedules.\n\n")
        record("mixed_measured", note + "\n".join(markdown_table(cols, record_rows)) + "\n\n" + "\n".join(lines),
               headline=f"{best} {meas:.3f}x fixed shares measured, {pred:.3f}x predicted")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
