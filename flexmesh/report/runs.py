"""The demo's training runs as the reports read them: the plan they train (:func:`training_plan`) and
their metrics.jsonl rows (:func:`read_metrics`) summed up (:func:`run_summary`).

>>> plan = training_plan(nproc=2, seq_len=512, global_batch=6)
>>> plan.model, plan.world_size, plan.layout
('tiny', 2, 'pp1 1f1b m1 | [0,4) 4x tp1-dp2z2')
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from flexmesh.errors import FlexmeshError
from flexmesh.inputs import iter_jsonl
from flexmesh.layout.enums import PipelineSchedule
from flexmesh.layout.plan import Plan, StagePlan
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.report.report import median_abs_error
from flexmesh.spec.model import parse_model

TRAIN_MODEL = "tiny"  # the model the demo profiles and trains: small enough for a few CPU processes


def training_plan(nproc: int, seq_len: int, global_batch: int, model: str = TRAIN_MODEL) -> Plan:
    """The demo's training plan: ``model`` sharded over ``nproc`` local CPU processes (ZeRO-2, no tp,
    pp or cp), sequences of up to ``seq_len`` tokens, ``global_batch`` documents per step; priced by
    profiles."""
    spec = parse_model(model)
    strategy = LayerStrategy.parse(f"tp1-dp{nproc}z2")
    return Plan.uniform(model=model, cluster=f"{nproc}xcpu", world_size=nproc, pp=1,
                pipeline_schedule=PipelineSchedule.ONE_F_ONE_B,
                num_microbatches=1, seq_len=seq_len, global_batch=global_batch,
                stages=(StagePlan(0, spec.num_layers, (strategy,) * spec.num_layers),), cost_source="profile")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's ``metrics.jsonl`` (one JSON object per line; blank lines skipped)."""
    return [row for _, row in iter_jsonl(path, FlexmeshError, finite=False)]


def throughput(rows: list[dict], warmup: int = 1) -> float:
    """Tokens/s of metrics rows, the first ``warmup`` steps left out when there are more steps."""
    timed = rows[warmup:] if len(rows) > warmup else rows
    return sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed)


def run_line(label: str, rows: list[dict], warmup: int = 1) -> str:
    """One line on a finished run from its metrics.jsonl rows (throughput as :func:`throughput` counts it).

    >>> run_line("static", [{"tokens": 100, "step_time_s": t} for t in (2.0, 1.0, 0.25)])
    'static: 3 steps, 160 tokens/s over steps 2-3'
    """
    first = warmup + 1 if len(rows) > warmup else 1
    return f"{label}: {len(rows)} steps, {throughput(rows, warmup):,.0f} tokens/s over steps {first}-{len(rows)}"


def run_summary(rows: list[dict], warmup: int = 1) -> dict:
    """Figures of one measured run from its metrics.jsonl rows (the first ``warmup`` steps left out
    of throughput, when there are more steps than that).

    >>> rows = [{"step": s, "loss": 5.0, "tokens": 100, "step_time_s": t, "busy_s": [t, t / 2],
    ...          "predicted_step_time_s": 1.0, "policy": "hdp", "fallback": s == 2}
    ...         for s, t in ((1, 2.0), (2, 1.0), (3, 1.0))]
    >>> d = run_summary(rows); d["tokens_per_s"], d["imbalance"], d["fallbacks"], d["predicted_error"]
    (100.0, 1.3333333333333333, 1, 0.0)
    """
    timed = rows[warmup:] if len(rows) > warmup else rows
    busy = np.array([r["busy_s"] for r in timed], dtype=float)
    pred = [(r["predicted_step_time_s"], r["step_time_s"]) for r in timed if r.get("predicted_step_time_s")]
    return {
        "steps": len(rows),
        "step_time_s": float(np.mean([r["step_time_s"] for r in timed])),
        "tokens_per_s": throughput(rows, warmup),
        "imbalance": float(np.mean(busy.max(axis=1) / np.maximum(busy.mean(axis=1), 1e-12))),
        "policies": sorted({r.get("policy", "?") for r in rows}),
        "fallbacks": sum(bool(r.get("fallback")) for r in rows),
        "predicted_error": median_abs_error([p for p, _ in pred], [m for _, m in pred]) if pred else None,
        "final_loss": rows[-1]["loss"],
    }
