"""What ``flexmesh plan`` prints of a search or a checked plan: the best plans and the baselines as a
table or JSON, and ``--explain``'s breakdown of the step's time and memory with where the numbers come
from (the device's datasheet and measured tables, or the profiles)."""

from __future__ import annotations

from rich.console import Console, JustifyMethod
from rich.table import Table

from flexmesh.cost import CostModel, Evaluation
from flexmesh.layout.plan import Plan
from flexmesh.layout.stack import RUNTIME_STACK
from flexmesh.profile.timing import ProfiledTiming
from flexmesh.search import Candidate, SearchResult
from flexmesh.search.uniform_baselines import runtime_runs
from flexmesh.sim.expected import Expected
from flexmesh.spec.devices import FLASH2
from flexmesh.spec.shape import ModelSpec
from flexmesh.units import GIB


def _row(c: Candidate, e: Expected | None = None) -> dict:
    ev = c.evaluation
    row = {"layout": c.plan.layout, "origin": c.origin, "step_time_s": ev.step_time, "tokens_per_s": ev.tokens_per_s,
           "mfu": ev.mfu, "peak_memory_gib": [m["total"] / GIB for m in ev.memory]}
    if e is not None:  # --lengths: the expected step, the cost model's at --seq-len beside it
        row.update(step_time_s=e.step_time, tokens_per_s=e.tokens_per_s, policy=e.policy,
                   fixed_length_step_time_s=ev.step_time, fixed_length_tokens_per_s=ev.tokens_per_s)
    return row


def result_json(r: SearchResult, plan: Plan, expected: dict[str, Expected], pick: int = 1) -> dict:
    """The search as ``plan --json`` prints it; ``plan`` (the ``pick``-th of the list, as written) under
    ``picked``, and under ``best`` too when it is the best."""
    chosen = r.plans[pick - 1]
    best_plan = plan if pick == 1 else r.best.plan
    return {
        "search_seconds": r.search_seconds,
        "mode": r.mode,
        "configurations": r.configurations,
        "best": {**_row(r.best, expected.get(r.best.plan.layout)), "plan": best_plan.to_dict()},
        "picked": {"rank": pick, **_row(chosen, expected.get(chosen.plan.layout)), "plan": plan.to_dict()},
        "plans": [_row(c, expected.get(c.plan.layout)) for c in r.plans],
        "baselines": {k: (_row(v, expected.get(v.plan.layout)) if v else None) for k, v in r.baselines.items()},
        "baselines_missing": dict(r.baseline_misses),  # why a baseline that is null has no layout
    }


def print_table(out: Console, r: SearchResult, expected: dict[str, Expected], model: ModelSpec | None = None) -> None:
    """The best plans and the baselines; with --lengths (``expected``) their expected steps first."""
    t = Table(title=f"best plans ({r.mode} search, {r.configurations} configurations, {r.search_seconds:.2f} s)")
    cols = (("expected s", "tokens/s", "s at --seq-len") if expected else ("step s", "tokens/s", "MFU"))
    right: JustifyMethod = "right"
    columns: tuple[tuple[str, JustifyMethod], ...] = (("#", "right"), ("layout", "left"), *((c, right) for c in cols),
                                                      ("peak GiB per stage", "left"), ("from", "left"))
    for col, just in columns:
        t.add_column(col, justify=just, overflow="fold")
    for i, c in enumerate(r.plans, 1):
        ev, e = c.evaluation, expected.get(c.plan.layout)
        mem = " ".join(f"{m['total'] / GIB:.1f}" for m in ev.memory)
        figures = ((f"{e.step_time:.4g}", f"{e.tokens_per_s:,.0f}", f"{ev.step_time:.4g}") if e is not None else
                   (f"{ev.step_time:.4g}", f"{ev.tokens_per_s:,.0f}", f"{ev.mfu:.1%}"))
        t.add_row(str(i), c.plan.layout, *figures, mem, c.origin)
    out.print(t)
    for name, b in r.baselines.items():
        e = expected.get(b.plan.layout) if b is not None else None
        if b is not None and model is not None and not runtime_runs(name, model):
            name += " (whole experts over expert-parallel ranks, as Megatron-LM runs them; flexmesh's runtime does not)"
        if b is None:
            why = r.baseline_misses.get(name)
            out.print(f"baseline {name}: no layout of this family fits{f': {why}' if why else ''}", highlight=False)
        elif e is not None:
            out.print(f"baseline {name}: expected {e.step_time:.4g} s, {e.tokens_per_s:,.0f} tokens/s "
                      f"({b.evaluation.step_time:.4g} s at --seq-len)  ({b.plan.layout})", highlight=False)
        else:
            out.print(f"baseline {name}: {b.evaluation.step_time:.4g} s, {b.evaluation.tokens_per_s:,.0f} tokens/s, "
                      f"MFU {b.evaluation.mfu:.1%}  ({b.plan.layout})", highlight=False)


def framework_terms(cost: CostModel) -> str:
    """What the cost model charges a micro-batch beyond its kernels and collectives, and where it comes from."""
    t = cost.timing
    if isinstance(t, ProfiledTiming):  # a model profile's whole-model fit
        if t.profile.pipeline:
            per_stage = (f"; {t.stage_fixed_s() * 1e3:.2f} ms per pipeline chunk per micro-batch, forward and "
                         "backward, beside its sends (the runtime's schedule over the model cut into more stages)")
        else:
            per_stage = ("; no fixed cost per pipeline stage (the profile predates its measurement: re-run "
                         "`flexmesh profile model`)")
        return (f"framework: the model profile's whole-model fit, forward {t.k_fwd:.2f}x its layers + "
                f"{t.fixed_fwd * 1e3:.2f} ms, backward {t.k_bwd:.2f}x + {t.fixed_bwd * 1e3:.2f} ms per micro-batch "
                f"(the fixed part once per micro-batch, with the head on the last pipeline stage){per_stage}")
    return ("framework: no fixed cost per micro-batch or pipeline stage beyond each kernel's 3 us launch "
            "(no source gives one for a preset; `flexmesh profile model` measures this runtime's)")


def explain(out: Console, ev: Evaluation, cost: CostModel) -> None:
    d, stack = cost.hw.cluster.device, getattr(cost.timing, "stack", None)
    if cost.hw.source.startswith("preset:"):  # where the device's numbers come from (a profile: measured)
        out.print(f"device {d.name} ({d.architecture}, {d.intra_link}), {cost.model.dtype} peak "
                  f"{d.peak_tflops[cost.model.dtype]:g} TFLOP/s; GEMM efficiency {d.mm_efficiency:.3f}, "
                  f"attention {d.attn_efficiency:.3f}: "
                  f"{d.efficiency_source}; datasheet: {d.source}", highlight=False)
        flash2 = FLASH2.get(d.architecture)
        if stack is not None and stack.attention == "flash2" and flash2 is not None:
            out.print(f"attention as the runtime runs it, FlashAttention-2 (not the fused kernel above): forward "
                      f"{flash2['fwd_efficiency']:.3f} of peak + {flash2['fwd_overhead_keys']:.0f} keys per query "
                      f"tile, backward {flash2['bwd_efficiency']:.3f} + {flash2['bwd_overhead_keys']:.0f}: measured, "
                      f"{flash2['source']} (flexmesh.cost.device.flash2; --attention fused prices the faster kernel)",
                      highlight=False)
        links = (f"measured NCCL times of a {d.comm_table} node by message size (aiconfigurator-core, "
                 "flexmesh.cost.device.comm_tables)" if d.comm_table else
                 f"{d.intra_node_gbps(cost.hw.cluster.devices_per_node):g} GB/s x {d.intra_efficiency:g} "
                 "+ NCCL's tuning model's latency per ring step (no measured table of this part)")
        out.print(f"collectives inside a node: {links}; across nodes: {d.node_net_gbps:g} GB/s per node x "
                  f"{d.inter_efficiency:g} + {d.inter_latency_us:g} us per step; all-to-all at FlexSP's fitted "
                  f"efficiencies", highlight=False)
    elif hasattr(cost.hw, "describe"):  # a hardware profile (flexmesh.profile.timing.ProfiledHardware)
        out.print(cost.hw.describe(), highlight=False)
    out.print(framework_terms(cost), highlight=False)
    if stack is not None and stack.label != RUNTIME_STACK.label:
        out.print(f"layers priced as another stack runs them: {stack.label}", highlight=False)
    t = Table(title="step time (busiest pipeline rank)")
    t.add_column("part")
    t.add_column("seconds", justify="right")
    t.add_column("share", justify="right")
    parts = [("compute", ev.compute), ("exposed communication", ev.exposed_comm), ("pipeline bubble", ev.bubble),
             ("gradient sync + optimizer", ev.grad_sync)]
    for name, v in parts:
        t.add_row(name, f"{v:.4f}", f"{v / ev.step_time:.1%}")
    t.add_row("step", f"{ev.step_time:.4f}", "")
    out.print(t)
    m = Table(title=f"memory per pipeline rank, GiB (usable {ev.budget / GIB:.1f})")
    keys = ["states", "activations", "transient", "logits", "total"]
    m.add_column("rank", justify="right")
    for k in keys:
        m.add_column(k, justify="right")
    for r, mem in enumerate(ev.memory):
        m.add_row(str(r), *(f"{mem.get(k, 0.0) / GIB:.2f}" for k in keys))
    out.print(m)
