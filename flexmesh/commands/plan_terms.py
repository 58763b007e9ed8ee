"""``flexmesh plan --explain --against PLAN``: the chosen plan against another, term by term.

Both plans are priced by the same cost model (:func:`flexmesh.cost.training.breakdown.step_terms`), so a
speed-up over a known layout (a published one, the one in use) shows where it comes from: less
recomputation, TP communication hidden, a smaller bubble, a cheaper gradient sync.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from flexmesh.cost import CostModel
from flexmesh.cost.training.breakdown import TERMS, step_terms
from flexmesh.layout.plan import Plan


def plan_terms(cost: CostModel, plan: Plan) -> dict[str, float]:
    """:func:`~flexmesh.cost.training.breakdown.step_terms` of a plan (its own overlap options)."""
    return step_terms(cost, [st.strategies for st in plan.stages], plan.pp, plan.pipeline_schedule,
                      plan.num_microbatches, plan.virtual_stages, plan.microbatch_size, plan.seq_len, plan.overlap)


def print_against(out: Console, cost: CostModel, chosen: Plan, other: Plan) -> None:
    """Print each term of ``chosen`` and ``other`` and their difference, and the speed-up."""
    a, b = plan_terms(cost, chosen), plan_terms(cost, other)
    t = Table(title=f"chosen plan against {other.layout}")
    for col in ("term", "chosen s", "against s", "chosen - against s"):
        t.add_column(col, justify="left" if col == "term" else "right", overflow="fold")
    for k in TERMS:
        t.add_row(k, f"{a[k]:.4f}", f"{b[k]:.4f}", f"{a[k] - b[k]:+.4f}")
    sa, sb = sum(a.values()), sum(b.values())
    t.add_row("step", f"{sa:.4f}", f"{sb:.4f}", f"{sa - sb:+.4f}")
    out.print(t)
    out.print(f"speed-up of the chosen plan: {sb / sa:.2f}x ({chosen.overlap.label} against "
              f"{other.overlap.label})", highlight=False)
