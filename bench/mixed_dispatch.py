"""Per-step dispatch over a mixed cluster's replica groups against fixed shares, simulated.

The plan: what ``flexmesh plan`` writes for Llama 2 13B on one node of 8 H100 and two of 8 A100-40GB
(flexmesh.plan.mixed, device presets), for sequences of ``--contexts`` tokens (4096 and 32768), with
the global batch of ``--batch`` sequences per step. Each step draws that many real document lengths
(flexmesh/data/lengths: Wikipedia, the ProLong sample, the 128K production-like mix), truncated to the
context, and schedules them:

- ``shares``: the plan's fixed shares: group ``g`` takes the next ``share_g`` documents in its
  ``m_g`` micro-batches of equal document counts (what the runtime ran before per-step dispatch);
- ``shares+P``: the same fixed shares, each packed inside its group by the per-step policy ``P``
  (flexmesh.schedule.groups.packed_shares_schedule): fixed shares at their best, the baseline;
- ``dispatch+P``: each step's documents dispatched over the groups by predicted time under each
  group's memory (flexmesh.schedule.groups.dispatch), then packed inside each group by the per-step
  policy ``P`` (``fixed``, ``balanced``, ``hdp``; Hydraulis's two stages).

Every schedule is priced by the same simulator (flexmesh.sim.predict.simulate_groups: each group on
its own device's cost model, the slowest group, then the exposed gradient all-reduce across groups)
and compared with the per-step lower bound (flexmesh.schedule.groups.groups_lower_bound, plus the
same all-reduce). Targets: the best dispatch >= 1.25x the best fixed-share schedule (``shares`` or
any ``shares+P``) and within 1.05x of the bound.

    OMP_NUM_THREADS=1 python -m bench.mixed_dispatch            # records "mixed_dispatch" in bench/RESULTS.md
    OMP_NUM_THREADS=1 python -m bench.mixed_dispatch --quick    # fewer steps, prints only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL, CLUSTER = "llama2-13b", "1x8xH100+2x8xA100-40GB"
LENGTHS = ("wikipedia", "prolong", "wlbllm")
POLICIES = ("fixed", "balanced", "hdp")
SHARED = ("shares", *(f"shares+{p}" for p in POLICIES))  # the fixed-share baselines
SCHEDULES = (*SHARED, *(f"dispatch+{p}" for p in POLICIES))


def run_case(context: int, batch: int, lengths_name: str, steps: int, seed: int = 0) -> dict:
    from flexmesh.cost.mixed import MixedCosts
    from flexmesh.data.lengths import load_lengths
    from flexmesh.plan.mixed import plan_mixed
    from flexmesh.schedule.groups import groups_context, groups_lower_bound, groups_schedule, packed_shares_schedule
    from flexmesh.sim.predict import simulate_groups
    from flexmesh.spec.cluster import parse_mixed_cluster
    from flexmesh.spec.model import parse_model

    spec, cluster = parse_model(MODEL), parse_mixed_cluster(CLUSTER)
    costs = MixedCosts(spec, cluster)
    plan = plan_mixed(spec, cluster, context, batch, costs).plan
    gctx = groups_context(plan, spec, costs)
    pool = load_lengths(lengths_name)
    rng = np.random.default_rng(seed)
    batches = [np.clip(rng.choice(pool, size=batch), 2, context) for _ in range(steps)]
    times: dict[str, list[float]] = {p: [] for p in SCHEDULES}
    bound, seconds = [], {p: 0.0 for p in times}
    for lens in batches:
        bound.append(groups_lower_bound(lens, gctx) + gctx.cross_sync_s)
        for policy in times:
            t0 = time.perf_counter()
            kind, _, inner = policy.partition("+")
            s = groups_schedule(inner or kind, lens, gctx) if kind != "shares" or not inner else \
                packed_shares_schedule(inner, lens, gctx)
            seconds[policy] += time.perf_counter() - t0
            s.validate(gctx.num_ranks)
            times[policy].append(simulate_groups(gctx, s))
    tokens = float(sum(b.sum() for b in batches))
    out = {"plan": plan.layout, "groups": len(plan.groups), "bound_tok_s": tokens / sum(bound)}
    for policy, ts in times.items():
        out[policy] = {"tok_s": tokens / sum(ts), "ratio_to_bound": float(np.mean(np.array(ts) / np.array(bound))),
                       "scheduler_ms": 1e3 * seconds[policy] / steps}
    return out


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
            base = r["shares"]["tok_s"]
            strongest = max(r[p]["tok_s"] for p in SHARED)
            best = max((p for p in SCHEDULES if p.startswith("dispatch")), key=lambda p: r[p]["tok_s"])
            gain, ratio = r[best]["tok_s"] / strongest, r[best]["ratio_to_bound"]
            verdicts.append((context, name, gain, ratio))
            for policy in SCHEDULES:
                x = r[policy]
                rows.append([str(context), name, policy, f"{x['tok_s']:,.0f}", f"{x['tok_s'] / base:.3f}x",
                             f"{x['ratio_to_bound']:.3f}", f"{x['scheduler_ms']:.1f}"])
            rows.append([str(context), name, "lower bound", f"{r['bound_tok_s']:,.0f}", "", "1.000", ""])
            print(f"context {context}, {name}: plan of {r['groups']} replica groups: {r['plan'].splitlines()[0]} ...",
                  flush=True)
    cols = ["context", "lengths", "schedule", "tokens/s", "vs shares", "step / bound", "scheduler ms"]
    table = Table(title=f"{MODEL} on {CLUSTER}, {args.batch} sequences per step, {steps} steps, simulated")
    for c in cols:
        table.add_column(c, justify="left" if c in ("lengths", "schedule") else "right")
    for r in rows:
        table.add_row(*r)
    Console(width=160).print(table)
    lines = [f"- context {c}, {n}: best dispatch {g:.3f}x the best fixed-share schedule "
             f"({'PASS' if g >= 1.25 else 'FAIL'}, target >= 1.25x), {b:.3f}x the bound "
             f"({'PASS' if b <= 1.05 else 'FAIL'}, target <= 1.05x)" for c, n, g, b in verdicts]
    print("\n".join(lines))
    if not args.quick:
        from bench._results import markdown_table, record

        note = (f"{MODEL} on {CLUSTER} (device presets), the mixed-cluster planner's plan for each context, "
                f"{args.batch} sequences per step drawn from each shipped length set (truncated to the context), "
                f"{steps} steps; every schedule priced by the same simulator (each replica group on its own device, "
                "the slowest group, then the exposed gradient all-reduce across groups). `step / bound`: the "
                "simulated step over the per-step lower bound (fluid LP over the groups, plus the same all-reduce), "
                "mean over steps.\n\n")
        record("mixed_dispatch", note + "\n".join(markdown_table(cols, rows)) + "\n\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
