"""Predicted vs published per-GPU throughput of the fitting set, and the planner against each layout.

For every fitting row (flexmesh.cost.training.calibrate: Megatron-LM 2104.04473 Table 1 on A100, Llama 3
2407.21783 Table 4 on H100, llm-foundry's benchmarking tables on both): the published throughput, the prediction
with the presets (in sample), with the constants refitted without the row (leave-one-out), without the row's source
(leave-one-source-out) and without its table (leave-one-table-out), and the planner's own best plan
(``mode="fast"``) against the published layout under the same cost model, with both breakdowns: a
tuned published layout should not be beaten by more than 1.3x without the breakdown saying why.
Prints the tables (and the fits) and records them in bench/RESULTS.md.

Run: OMP_NUM_THREADS=1 python -m bench.published
"""

from __future__ import annotations

import time

from bench._results import fold_plan, record
from flexmesh.commands.plan_terms import plan_terms
from flexmesh.cost.training import calibrate
from flexmesh.cost.training.breakdown import TERMS, step_terms
from flexmesh.errors import PlanError
from flexmesh.search import SearchRequest, best_plans

# The code these figures depend on (`python -m bench.status` diffs it against each record's commit).
DEPENDS_ON = ("flexmesh/search", "flexmesh/cost", "flexmesh/layout", "flexmesh/spec",
              "flexmesh/commands/plan_terms.py", "flexmesh/console.py", "flexmesh/errors.py", "flexmesh/files.py",
              "flexmesh/inputs.py",
              "flexmesh/units.py")

# The planner may claim at most this much over a tuned published layout without an explanation.
CLAIM_LIMIT = 1.3


def _breakdown(ev) -> str:  # noqa: ANN001
    return (f"compute {ev.compute:.2f} s, exposed comm {ev.exposed_comm:.2f} s, bubble {ev.bubble:.2f} s, "
            f"sync+optim {ev.grad_sync:.2f} s")


def planner_vs_published(run: calibrate.PublishedRun) -> dict:
    """The planner's best plan for the run's model, cluster, batch and length vs its published layout,
    both priced by the run's cost model."""
    cost = run.cost_model()
    published = run.predict()
    t0 = time.perf_counter()
    try:
        best = best_plans(SearchRequest(run.model, run.cluster(), run.seq_len, run.global_batch, cost=cost, top=1,
                                        mode="fast")).best
    except PlanError as e:
        return {"plan": f"none ({e})", "speedup": float("nan"), "seconds": time.perf_counter() - t0,
                "published_breakdown": _breakdown(published), "plan_breakdown": "", "why": ""}
    ev = best.evaluation
    # Term by term (flexmesh.cost.training.breakdown, what `flexmesh plan --explain --against` prints); the
    # published layout is priced as it ran (no overlap option: 2021 Megatron-LM had no TP overlap).
    s = run.strategy()
    L, n = run.model.num_layers, run.pp * run.virtual_stages
    chunks = [[s] * (L // n + (1 if i < L % n else 0)) for i in range(n)]
    pub_terms = step_terms(cost, chunks, run.pp, run.pipeline_schedule, run.global_batch // (run.dp * run.micro_batch),
                           run.virtual_stages, run.dp * run.micro_batch, run.seq_len)
    plan_t = plan_terms(cost, best.plan)
    saved = {k: pub_terms[k] - plan_t[k] for k in TERMS}
    why = ", ".join(f"{k} {-v:+.2f} s" for k, v in sorted(saved.items(), key=lambda kv: -kv[1])[:3])
    if run.recompute and not any(s.recompute for st in best.plan.stages for s in st.strategies):
        why += " (the published run recomputes every layer's forward; the plan fits without)"
    why += f"; plan overlap: {best.plan.overlap.label}"
    return {"plan": best.plan.layout, "speedup": published.step_time / ev.step_time,
            "seconds": time.perf_counter() - t0, "published_breakdown": _breakdown(published),
            "plan_breakdown": _breakdown(ev), "why": why, "terms": (pub_terms, plan_t)}


def _terms_table(terms: tuple[dict[str, float], dict[str, float]]) -> list[str]:
    pub, plan = terms
    lines = ["| term | published s | plan s | plan - published s |", "|---|---|---|---|"]
    lines += [f"| {k} | {pub[k]:.3f} | {plan[k]:.3f} | {plan[k] - pub[k]:+.3f} |" for k in TERMS]
    return lines


def main() -> None:
    calibrate.main()
    rows = calibrate.calibration_table()
    lines = ["| run | device | layout | published tokens/s/GPU | predicted | in-sample ratio | leave-one-out ratio "
             "| leave-one-source-out ratio | leave-one-table-out ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['device']} | {r['layout']} | {r['published_tokens_per_gpu']:.0f} | "
                     f"{r['predicted_tokens_per_gpu']:.0f} | {r['ratio']:.3f} | {r['loo_ratio']:.3f} | "
                     f"{r['loso_ratio']:.3f} | {r['loto_ratio']:.3f} |")
    lines += ["", "|error| of predicted throughput, median and worst:", "",
              "| held out | rows | A100 | H100 |", "|---|---|---|---|"]
    for key, what in calibrate.HELD_OUT:
        for framework in (None, "megatron", "llm-foundry"):
            summary = calibrate.error_summary(rows, key, framework)
            lines.append(f"| {what} | {framework or 'all'} | " + " | ".join(
                f"{m:.1%}, {w:.1%}" for m, w in summary.values()) + " |")
    lines += ["", "Planner (fast search) vs the published layout, same cost model:", "",
              "| run | planner's best plan | speed-up claimed | where it gains | search s | published layout "
              "| planner's plan |", "|---|---|---|---|---|---|---|"]
    explained = []
    for run in calibrate.PUBLISHED_RUNS:
        p = planner_vs_published(run)
        flag = " (over the 1.3x limit: see the term-by-term breakdown below)" if p["speedup"] > CLAIM_LIMIT else ""
        print(f"{run.name}: planner {p['speedup']:.2f}x{flag} in {p['seconds']:.1f} s ({p['why']}): {p['plan']}\n"
              f"  published: {p['published_breakdown']}\n  planner:   {p['plan_breakdown']}")
        plan = fold_plan(p["plan"].replace("|", "/"))
        lines.append(f"| {run.name} | `{plan}` | {p['speedup']:.2f}x{flag} | {p['why']} | {p['seconds']:.1f} | "
                     f"{p['published_breakdown']} | {p['plan_breakdown']} |")
        if flag:
            table = _terms_table(p["terms"])
            print("\n".join(table))
            explained += ["", f"{run.name}, {p['speedup']:.2f}x, per step (busiest pipeline rank):", ""] + table
    lines += explained
    fits = calibrate.fit_constants(calibrate.PUBLISHED_RUNS)
    intra, inter = calibrate.fit_a2a_efficiency()
    notes = (f"\nFits redone by this run, training priced on the device layer's measured kernel forms: A100 "
             f"mm_efficiency {fits['A100']:.3f} (the 2021 runs priced with unfused attention kernel by kernel, no "
             f"sequence parallelism, dropout), H100 mm_efficiency {fits['H100']:.3f}, llm-foundry gemm_share "
             f"{fits['llm-foundry']:.3f}, attn_efficiency {calibrate.fit_attn_efficiency():.3f}, all-to-all "
             f"{intra:.3f} / {inter:.3f}. Sources: Megatron-LM 2104.04473 Table 1 (A100), Llama 3 2407.21783 Table 4 "
             "(H100), llm-foundry's benchmarking tables at 2048 tokens (A100 and H100, the second source of each "
             "family), FlexSP 2412.01523 (attention, all-to-all). Leave-one-out: every constant refitted without the "
             "row. Leave-one-source-out: without every row of the row's publication (a stack never seen is priced as "
             "the reference stacks, share 1). Leave-one-table-out: without the row's table (llm-foundry's other "
             "family predicts it through the device layer). See docs/cost-model.md, Calibration.")
    loso, loto = calibrate.error_summary(rows, "loso_ratio"), calibrate.error_summary(rows, "loto_ratio")
    record("published", "\n".join(lines) + "\n" + notes, headline="leave-one-source-out error: " + "; ".join(
        f"{f} median {m:.1%}, worst {w:.1%}" for f, (m, w) in loso.items()) + "; leave-one-table-out: " + "; ".join(
        f"{f} median {m:.1%}, worst {w:.1%}" for f, (m, w) in loto.items()))


if __name__ == "__main__":
    main()
