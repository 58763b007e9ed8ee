"""The experts page of a report: how evenly a run's routed tokens fell on its ranks, step by step.

From a run's routing.jsonl (flexmesh.runtime.train.expert_training: per MoE layer and step, tokens per
expert and per rank): the imbalance the run met (the most loaded rank over the mean) against the one
static placement would have met on the same loads, per layer and over time, and how much the load
persists from one step to the next (the correlation of each layer's tokens per expert between
consecutive steps: what lets a placement made from the last step's load fit the next).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from flexmesh.errors import FlexmeshError
from flexmesh.files import write_atomic_with
from flexmesh.inputs import iter_jsonl
from flexmesh.report.report import Report

MOE_MODEL = "tiny-moe"  # the demo's mixture of experts


def _by_layer(rows: Sequence[dict]) -> dict[int, list[dict]]:
    """routing.jsonl rows grouped by MoE layer, in layer order, each layer's in step order."""
    out: dict[int, list[dict]] = {}
    for r in rows:
        out.setdefault(int(r["layer"]), []).append(r)
    return dict(sorted(out.items()))


def persistence(rows: Sequence[dict]) -> float:
    """Mean over layers and steps of the Pearson correlation of tokens per expert between consecutive
    steps (nan with fewer than two steps).

    >>> rows = [{"layer": 0, "expert_tokens": t} for t in ([1, 2, 3], [2, 4, 6], [3, 2, 1])]
    >>> round(persistence(rows), 3)
    0.0
    """
    loads = [[np.asarray(r["expert_tokens"], dtype=float) for r in rs] for rs in _by_layer(rows).values()]
    found = [float(np.corrcoef(a, b)[0, 1]) for layer in loads for a, b in zip(layer, layer[1:])
             if a.std() > 0 and b.std() > 0]
    return float(np.mean(found)) if found else float("nan")


def routing_summary(rows: Sequence[dict]) -> list[list]:
    """Per MoE layer: [layer, steps, mean imbalance met, mean static imbalance, worst imbalance met,
    tokens per expert max/mean]; the first step (placed statically by every policy) left out of the
    means where there are later ones."""
    out = []
    for layer, rs in _by_layer(rows).items():
        later = rs[1:] or rs
        skew = [max(r["expert_tokens"]) / max(np.mean(r["expert_tokens"]), 1e-9) for r in later]
        out.append([layer, len(rs), float(np.mean([r["imbalance"] for r in later])),
                    float(np.mean([r["static_imbalance"] for r in later])),
                    float(max(r["imbalance"] for r in later)), float(np.mean(skew))])
    return out


def imbalance_png(rows: Sequence[dict], path: str | Path, title: str = "routed tokens per rank, max / mean") -> Path:
    """Imbalance met (solid) and static placement's on the same loads (dashed), per layer, over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, (layer, rs) in enumerate(_by_layer(rows).items()):
        color = f"C{i % 10}"
        steps = [r["step"] for r in rs]
        ax.plot(steps, [r["imbalance"] for r in rs], color=color, label=f"layer {layer}")
        ax.plot(steps, [r["static_imbalance"] for r in rs], color=color, linestyle="--", alpha=0.6)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("max / mean")
    ax.set_title(title + " (dashed: static placement)")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    path = Path(path)
    write_atomic_with(path, lambda tmp: fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png"))
    plt.close(fig)
    return path


def add_section(rep: Report, runs: Mapping[str, Sequence[dict]], figures: Path,
                heading: str | None = "Experts") -> None:
    """The experts page for each run (label -> routing.jsonl rows), under ``heading`` (None: none)."""
    if heading:
        rep.heading(heading)
    for label, rows in runs.items():
        if not rows:
            continue
        summary = routing_summary(rows)
        met = np.mean([s[2] for s in summary])
        static = np.mean([s[3] for s in summary])
        rep.text(f"{label}: over {len(summary)} MoE layers and {summary[0][1]} steps the most loaded data rank "
                 f"computed {met:.2f}x the mean routed tokens, where static placement would have given {static:.2f}x "
                 f"on the same loads; step-to-step correlation of the tokens per expert {persistence(rows):.2f} "
                 "(routing.jsonl).")
        rep.table(["layer", "steps", "imbalance met", "static placement", "worst step", "tokens per expert max/mean"],
                  [[s[0], s[1], f"{s[2]:.3f}", f"{s[3]:.3f}", f"{s[4]:.3f}", f"{s[5]:.2f}"] for s in summary])
        rep.image(imbalance_png(rows, figures / f"experts_{label}.png", title=f"{label}: routed tokens per rank"),
                  f"expert load imbalance, {label}")


def demo_experts(out: Path, hardware: Path, *, steps: int, global_batch: int, seq_len: int, seed: int = 0,
                 device: str = "auto", profile: bool = True, corpus: str = "stdlib",
                 timeout_s: float = 1800, say: Callable[[str], None] | None = None
                 ) -> dict[str, tuple[list[dict], list[dict]]]:
    """``flexmesh demo``'s experts part: ``tiny-moe`` profiled for its plan (``flexmesh profile model --quick
    --for-plan --max-group 1``: no process groups, no pipeline stages, activations at tp = cp = 1) on 2
    processes; not with ``profile`` off, the demo's ``--quick``), then trained on 2 processes with its
    experts over both data ranks, placed statically, then following the load (``laer``) on the same
    batches; both priced by the demo's hardware profile and that model profile, the second with the
    imbalance replayed from the first's routing trace. Returns label -> (metrics.jsonl rows,
    routing.jsonl rows); ``corpus``: the trainings' (``flexmesh train --corpus``); ``say``: told a line as each
    part ends."""
    from flexmesh.files import make_folder
    from flexmesh.layout.plan import Plan, StagePlan
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.report.runs import read_metrics, run_line
    from flexmesh.runtime.launch import run_flexmesh

    out = make_folder(out)
    plan = out / "plan-moe.json"
    st = LayerStrategy.parse("tp1-dp2z2")
    Plan.uniform(model=MOE_MODEL, cluster="2xA100-80GB", world_size=2, pp=1, pipeline_schedule="1f1b",
                 virtual_stages=1, num_microbatches=1, seq_len=seq_len, global_batch=global_batch,
                 stages=(StagePlan(0, 4, (st,) * 4),)).save(plan)
    model = out / f"model-{MOE_MODEL}.json"

    def flexmesh(argv: list[str], what: str) -> None:
        run_flexmesh(argv, f"the experts' {what}", timeout=timeout_s)

    if profile:
        # --for-plan, --max-group 1: the plan has no tp, cp or pp and its runs form no cp groups (--cp 1), so
        # no layout under real process groups, no pipeline stages and no activations of a split layer price it
        flexmesh(["profile", "model", "--for-plan", str(plan), "--max-group", "1", "--quick", "--nproc", "2",
                  "--out", str(model), "--device", device], "model profile")
        if say:
            say(f"profiled {MOE_MODEL} for its plan: {model}")
    priced = ["--hardware-profile", str(hardware), *(["--model-profile", str(model)] if profile else [])]
    runs: dict[str, tuple[list[dict], list[dict]]] = {}
    for label in ("static", "laer"):
        run = out / "runs" / label
        trace = ["--routing", str(out / "runs" / "static" / "routing.jsonl")] if label != "static" else []
        flexmesh(["train", "--plan", str(plan), "--corpus", corpus, "--max-steps", str(steps), "--out", str(run),
                  "--nproc", "2", "--overwrite", "--no-progress", "--seed", str(seed), "--expert-placement", label,
                  "--cp", "1",
                  *priced, "--device", device, *trace],
                 f"{label} run")
        routing = [row for _, row in iter_jsonl(run / "routing.jsonl", FlexmeshError)]
        runs[label] = (read_metrics(run / "metrics.jsonl"), routing)
        if say:
            say(run_line(label, runs[label][0]))
    return runs


def add_demo_section(rep: Report, runs: Mapping[str, tuple[list[dict], list[dict]]], figures: Path) -> None:
    """The demo's experts runs: throughput, predicted against measured step, and the experts page."""
    rep.heading("A mixture of experts: static against load-following placement")
    rows = []
    base = None
    for label, (metrics, routing) in runs.items():
        later = metrics[1:] or metrics
        step = float(np.mean([r["step_time_s"] for r in later]))
        base = base or step
        pred = [r["predicted_step_time_s"] for r in later if r.get("predicted_step_time_s")]
        met = [r["imbalance"] for r in routing if r["step"] > 1] or [r["imbalance"] for r in routing]
        rows.append([label, f"{np.mean([r['tokens_per_s'] for r in later]):,.0f}", f"{step:.3f}", f"{base / step:.2f}x",
                     f"{np.mean(met):.3f}", f"{np.mean(pred):.3f}" if pred else "-",
                     f"{(np.mean(pred) - step) / step:+.1%}" if pred else "-", f"{metrics[-1]['loss']:.6f}"])
    rep.text(f"`{MOE_MODEL}` (8 experts, top 2) on 2 processes, its experts sharded over both data ranks (each step "
             "gathering the experts its placement gives it), the same batches under both placements: the losses "
             "are equal, the time differs by how evenly the routed tokens fall (routing.jsonl of each run).")
    rep.table(["placement", "tokens/s", "mean step (s)", "vs static", "imbalance met", "predicted step (s)",
               "predicted - measured", "final loss"], rows)
    add_section(rep, {label: routing for label, (_, routing) in runs.items()}, figures, heading=None)
