"""Per-step dispatch over a mixed cluster's replica groups against fixed shares, simulated.

The plan: what ``flexmesh plan`` writes for Llama 2 13B on one node of 8 H100 and two of 8 A100-40GB
(flexmesh.search.mixed, device presets), for sequences of ``--contexts`` tokens (4096 and 32768), with
the global batch of ``--batch`` sequences per step. Each step draws that many real document lengths
(flexmesh/data/lengths: Wikipedia, the ProLong sample, the 128K production-like mix), truncated to the
context, and schedules them:

- ``shares``: the plan's fixed shares: group ``g`` takes the next ``share_g`` documents in its
  ``m_g`` micro-batches of equal document counts (what the runtime ran before per-step dispatch);
- ``shares+P``: the same fixed shares, each packed inside its group by the per-step policy ``P``
  (flexmesh.schedule.groups.packed_shares_schedule): fixed shares at their best, the baseline;
- ``dispatch+P``: each step's documents dispatched over the groups by predicted time under each
  group's memory (flexmesh.schedule.groups.dispatch_sequences), then packed inside each group by the per-step
  policy ``P`` (``fixed``, ``balanced``, ``hdp``; Hydraulis's two stages).

Every schedule is priced by the same simulator and compared with the per-step lower bound
(flexmesh.sim.groups.compare_groups, what ``flexmesh simulate --plan`` runs). Targets: the best
dispatch >= 1.25x ``shares`` and within 1.05x of the bound; its ratio to the best fixed-share schedule
(``shares`` or any ``shares+P``) is printed beside.

    OMP_NUM_THREADS=1 python -m bench.mixed_dispatch            # records "mixed_dispatch" in bench/RESULTS.md
    OMP_NUM_THREADS=1 python -m bench.mixed_dispatch --quick    # fewer steps, prints only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit).
DEPENDS_ON = ("flexmesh/schedule", "flexmesh/sim", "flexmesh/cost", "flexmesh/data", "flexmesh/layout",
              "flexmesh/spec", "flexmesh/search", "flexmesh/errors.py", "flexmesh/files.py",
              "flexmesh/inputs.py", "flexmesh/units.py")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL, CLUSTER = "llama2-13b", "1x8xH100+2x8xA100-40GB"
LENGTHS = ("wikipedia", "prolong", "wlbllm")
POLICIES = ("fixed", "balanced", "hdp")


def run_case(context: int, batch: int, lengths_name: str, steps: int, seed: int = 0) -> dict:
    from flexmesh.cost.training.mixed import MixedCosts
    from flexmesh.data.lengths import load_lengths
    from flexmesh.schedule.groups import groups_context
    from flexmesh.search.mixed import plan_mixed
    from flexmesh.sim.groups import compare_groups
    from flexmesh.spec.cluster import parse_mixed_cluster
    from flexmesh.spec.model import parse_model

    spec, cluster = parse_model(MODEL), parse_mixed_cluster(CLUSTER)
    costs = MixedCosts(spec, cluster)
    plan = plan_mixed(spec, cluster, context, batch, costs).plan
    gctx = groups_context(plan, spec, costs)
    pool = load_lengths(lengths_name)
    rng = np.random.default_rng(seed)
    batches = [np.clip(rng.choice(pool, size=batch), 2, context) for _ in range(steps)]
    runs = compare_groups(gctx, batches, POLICIES, seed=seed, virtual_stages=[g.virtual_stages for g in plan.groups])
    return {"plan": plan.layout, "groups": len(plan.groups), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--batch", type=int, default=256, help="sequences per step (the plan's global batch)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="3 steps, one length set, prints only")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    steps = 3 if args.quick else args.steps
    lengths = LENGTHS[:1] if args.quick else LENGTHS
    rows, verdicts = [], []
    for context in (int(c) for c in args.contexts.split(",")):
        for name in lengths:
            r = run_case(context, args.batch, name, steps)
            runs = {x.name: x for x in r["runs"]}
            base = runs["shares"].tokens_per_s
            strongest = max((x for x in r["runs"] if x.kind == "baseline"), key=lambda x: x.tokens_per_s)
            best = max((x for x in r["runs"] if x.kind == "adaptive"), key=lambda x: x.tokens_per_s)
            verdicts.append((context, name, best.tokens_per_s / base, best.tokens_per_s / strongest.tokens_per_s,
                             strongest.name, best.ratio_to_bound))
            for x in r["runs"]:
                d = x.to_dict()
                rows.append([str(context), name, x.name, f"{x.tokens_per_s:,.0f}", f"{x.tokens_per_s / base:.3f}x",
                             f"{x.tokens_per_s / strongest.tokens_per_s:.3f}x", f"{x.ratio_to_bound:.3f}",
                             f"{d['scheduler_ms_per_step']:.1f}"])
            print(f"context {context}, {name}: plan of {r['groups']} replica groups: {r['plan'].splitlines()[0]} ...",
                  flush=True)
    cols = ["context", "lengths", "schedule", "tokens/s", "vs shares", "vs best fixed-share", "step / bound",
            "scheduler ms"]
    table = Table(title=f"{MODEL} on {CLUSTER}, {args.batch} sequences per step, {steps} steps, simulated")
    for c in cols:
        table.add_column(c, justify="left" if c in ("lengths", "schedule") else "right")
    for r in rows:
        table.add_row(*r)
    Console(width=170).print(table)
    lines = [f"- context {c}, {n}: best dispatch {g:.3f}x `shares` ({'PASS' if g >= 1.25 else 'FAIL'}, target "
             f">= 1.25x), {s:.3f}x the best fixed-share schedule ({b}), {r:.3f}x the bound "
             f"({'PASS' if r <= 1.05 else 'FAIL'}, target <= 1.05x)" for c, n, g, s, b, r in verdicts]
    print("\n".join(lines))
    if not args.quick:
        from bench._results import markdown_table, record

        note = (f"{MODEL} on {CLUSTER} (device presets), the mixed-cluster planner's plan for each context, "
                f"{args.batch} sequences per step drawn from each shipped length set (truncated to the context), "
                f"{steps} steps; every schedule priced by the same simulator (each replica group on its own device, "
                "the slowest group, then the exposed gradient all-reduce across groups; flexmesh.sim.groups). "
                "`step / bound`: the simulated step over the per-step lower bound (fluid LP over the groups) plus "
                "the step's tail (the slowest group's gradient sync and optimizer, and the all-reduce across "
                "groups), mean over steps.\n\n")
        by_context: dict = {}
        for c, n, _, s, _, _ in verdicts:
            by_context.setdefault(c, {})[n] = f"{s:.3f}x"
        names = ", ".join(next(iter(by_context.values())))
        record("mixed_dispatch", note + "\n".join(markdown_table(cols, rows)) + "\n\n" + "\n".join(lines),
               headline=f"best dispatch / best fixed-share schedule ({names}): " + "; ".join(
                   f"{', '.join(v.values())} at context {c}" for c, v in by_context.items()))


if __name__ == "__main__":
    main()
