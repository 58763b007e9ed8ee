"""Scheduler run time and quality per policy: llama2-7b, ZeRO-3, A100-40GB, wikipedia lengths at 192K.

Two scales: 512 sequences over 64 data ranks (8x8 GPUs; targets p95 <= 20 ms for heuristics, <= 2 s
for milp) and 32K sequences over 4096 data ranks (heuristics <= 1 s). Prints a table and records it
in bench/RESULTS.md. Usage: ``OMP_NUM_THREADS=1 python -m bench.scheduler_speed [--batches 20]``.
"""

from __future__ import annotations

import argparse
import os
from itertools import islice

import numpy as np
from rich.console import Console
from rich.table import Table

from bench._results import record
from flexmesh.cost import CostModel
from flexmesh.data.lengths import BatchSampler, load_lengths
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.registry import make_schedule
from flexmesh.spec.cluster import parse_cluster
from flexmesh.spec.model import parse_model

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit).
DEPENDS_ON = ("flexmesh/schedule", "flexmesh/cost", "flexmesh/data", "flexmesh/layout", "flexmesh/spec",
              "flexmesh/errors.py", "flexmesh/files.py", "flexmesh/inputs.py", "flexmesh/units.py")

CONTEXT = 192 * 1024


def context(nodes: int) -> ScheduleContext:
    cost = CostModel(parse_model("llama2-7b"), parse_cluster(f"{nodes}x8xA100-40GB"))
    return ScheduleContext(cost=cost, base=LayerStrategy(zero=3), num_ranks=nodes * 8)


def run(policies, ctx: ScheduleContext, batches) -> list[list[str]]:
    rows = []
    for p in policies:
        secs, ratio, imb = [], [], []
        for b in batches:
            s = make_schedule(p, b, ctx)
            secs.append(s.scheduler_seconds)
            ratio.append(s.extra["ratio_to_lower_bound"])
            imb.append(s.extra["imbalance"])
        rows.append([f"{len(batches[0])} seq / {ctx.num_ranks} ranks", p, f"{1e3 * np.median(secs):.1f}",
                     f"{1e3 * np.percentile(secs, 95):.1f}", f"{np.mean(ratio):.3f}", f"{np.mean(imb):.3f}"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()
    src = load_lengths("wikipedia")
    small = list(islice(BatchSampler(src, seed=0, seqs_per_batch=512, max_len=CONTEXT), args.batches))
    big = list(islice(BatchSampler(src, seed=1, seqs_per_batch=32768, max_len=CONTEXT), 2))
    rows = run(["fixed", "padded", "balanced", "wlb", "hdp", "milp"], context(8), small)
    rows += run(["fixed", "padded", "balanced", "wlb", "hdp"], context(512), big)
    # The scheduler's own predicted micro-batch phase over the lower bound (StepSchedule.extra), not
    # bench/schedule.py's "ratio to LB", which is the simulated step over the lower bound plus the tail.
    head = ["scale", "policy", "p50 ms", "p95 ms", "predicted / lower bound", "imbalance"]
    table = Table(*head, title=f"scheduler speed (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    for r in rows:
        table.add_row(*r)
    Console().print(table)
    if not args.no_record:
        md = "| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n"
        md += "".join("| " + " | ".join(r) + " |\n" for r in rows)
        md += (f"\nllama2-7b ZeRO-3 on A100-40GB, wikipedia lengths truncated to {CONTEXT}; baselines at their default "
               f"cp (smallest group holding the longest sequence). Predicted / lower bound: the scheduler's "
               f"predicted micro-batch phase over the lower bound (bench/schedule.py's ratio to LB is the "
               f"simulated step over the lower bound plus the step's tail). Load average {os.getloadavg()[0]:.1f} on "
               f"{os.cpu_count()} cores while measuring (the machine is shared).\n")
        record("scheduler_speed", md, headline="; ".join(f"{r[1]} p95 {r[3]} ms at {r[0]}" for r in rows
                                                         if r[1] == "hdp"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
