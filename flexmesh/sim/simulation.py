"""One simulated policy comparison end to end: what ``flexmesh simulate`` computes, without its flags.

A :class:`SimulationConfig` names the plan (tp, pp, ZeRO, ...) and the workload (length
distribution, batch size, steps). From a CostModel, :func:`simulation_context` builds the
scheduler's view of the plan; :func:`sample_batches` draws the global batches (sequences truncated
to the context); :func:`run_policies` schedules and simulates them under every policy
(:func:`flexmesh.sim.compare.compare_policies`); :func:`summarise` adds the setup and the PNGs into a
:class:`Simulation`, which gives the JSON document and the comparison table's rows.

>>> cfg = SimulationConfig(policies=("hdp",), context=4096, lengths="prolong", steps=2, seqs_per_batch=8)
>>> [len(b) for b in sample_batches(cfg)], max(int(b.max()) for b in sample_batches(cfg)) <= 4096
([8, 8], True)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from flexmesh.cost import CostModel
from flexmesh.data.lengths import BatchSampler, load_lengths
from flexmesh.layout.overlap import NO_OVERLAP, Overlap
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.schedule.context import ScheduleContext
from flexmesh.sim.compare import (
    BASELINES,
    PolicyRun,
    best_baseline,
    compare_policies,
    recommendation,
    run_policy,
    runs_needed,
)
from flexmesh.sim.predict import simulated_price
from flexmesh.sim.timeline import lane_speeds

# The comparison table: one row per policy (see comparison_row).
# The speedup is over the best baseline (see flexmesh.sim.compare), named under the table.
COLUMNS = ("policy", "kind", "step time (s)", "tokens/s", "speedup", "imbalance", "ratio to LB", "sched ms/step",
           "utilisation")
# Added after them when devices run at different speeds (see with_static).
SPEED_COLUMNS = ("static tokens/s", "vs static")


@dataclass(frozen=True)
class SimulationConfig:
    """The plan and the workload of one comparison; exactly one batch size is set.

    ``speed_factors`` (one per device, empty for all at nominal speed) replace the cluster's own.
    """

    policies: tuple[str, ...]
    context: int  # longest sequence: longer ones are truncated to it
    lengths: str = "wikipedia"  # shipped distribution name or a .txt/.json file
    steps: int = 20
    seed: int = 0
    seqs_per_batch: int | None = 512
    tokens_per_batch: int | None = None
    tp: int = 1
    pp: int = 1
    pipeline_schedule: str = "1f1b"
    virtual_stages: int = 1
    zero: int = 3
    recompute: bool = True
    cp_kind: str = "ulysses"
    speed_factors: tuple[float, ...] = ()
    overlap: Overlap = NO_OVERLAP  # the plan's overlap options (flexmesh.layout.overlap)
    chunk_layers: tuple[int, ...] = ()  # a plan's layers per pipeline chunk (ScheduleContext.chunk_layers)


def simulation_context(base: CostModel, cfg: SimulationConfig) -> tuple[ScheduleContext, np.ndarray]:
    """The ScheduleContext of the plan ``cfg`` describes on ``base``'s cluster, and the per-lane speeds.

    Each data rank's speed is that of its slowest lane (a pipeline runs at its slowest stage).
    """
    cluster = replace(base.cluster, speed_factors=cfg.speed_factors or base.cluster.speed_factors)
    speeds = lane_speeds(cluster, cfg.tp, cfg.pp)
    # the same cost model on devices of these speeds (their hardware the base's, which prices no speed)
    cost = base if cluster == base.cluster else CostModel(base.model, cluster, base.hw, base.timing, parts=base.parts)
    cost = cost.replace(step_overlap=cfg.overlap)
    ctx = ScheduleContext(cost=cost, base=LayerStrategy(tp=cfg.tp, zero=cfg.zero, recompute=cfg.recompute),
                          num_ranks=cluster.world_size // (cfg.tp * cfg.pp), pp=cfg.pp,
                          pipeline_schedule=cfg.pipeline_schedule, cp_kind=cfg.cp_kind,
                          speed=tuple(float(x) for x in speeds.min(axis=0)), chunk_layers=cfg.chunk_layers,
                          price=simulated_price(cfg.virtual_stages))  # chunked chooses as train's does
    return ctx, speeds


def sample_batches(cfg: SimulationConfig) -> list[np.ndarray]:
    """``cfg.steps`` global batches of lengths drawn from ``cfg.lengths``, truncated to the context."""
    size = {"tokens_per_batch": cfg.tokens_per_batch} if cfg.tokens_per_batch else \
        {"seqs_per_batch": cfg.seqs_per_batch}
    sampler = BatchSampler(load_lengths(cfg.lengths), cfg.seed, max_len=cfg.context, **size)
    return list(itertools.islice(sampler, cfg.steps))


def uneven(ctx: ScheduleContext) -> bool:
    """Whether some data rank runs at other than nominal speed."""
    return any(s != 1.0 for s in ctx.speed)


def policy_steps(cfg: SimulationConfig, ctx: ScheduleContext) -> int:
    """Steps :func:`run_policies` schedules and simulates at most (each baseline once per static degree,
    and each kept run once more for :func:`with_static` when speeds differ)."""
    kept = len(set(cfg.policies) | set(BASELINES)) if uneven(ctx) else 0
    return (runs_needed(ctx, cfg.context, cfg.policies) + kept) * cfg.steps


def run_policies(cfg: SimulationConfig, ctx: ScheduleContext, speeds: np.ndarray, batches: list[np.ndarray],
                 on_step: Callable[[], None] | None = None) -> list[PolicyRun]:
    """Every policy of ``cfg`` over ``batches``; ``on_step`` is called after each simulated step."""
    runs = compare_policies(cfg.policies, batches, ctx, context=cfg.context, seed=cfg.seed,
                            virtual_stages=cfg.virtual_stages, speed=speeds, on_step=on_step)
    return with_static(cfg, ctx, speeds, batches, runs, on_step) if uneven(ctx) else runs


def with_static(cfg: SimulationConfig, ctx: ScheduleContext, speeds: np.ndarray, batches: list[np.ndarray],
                runs: list[PolicyRun], on_step: Callable[[], None] | None = None) -> list[PolicyRun]:
    """``runs`` with ``static_tokens_per_s``: each policy at the same options with its schedules made
    for nominal speed (the scheduler not told), simulated at the true ``speeds``: what the speed-aware
    schedules gain over a plan that ignores the slow devices."""
    nominal = replace(ctx, speed=(), _cache={})
    out = []
    for r in runs:
        slot = cfg.context if r.policy == "padded" else None  # as compare_policies simulates padded slots
        blind = run_policy(r.policy, batches, nominal, seed=cfg.seed, options=r.options, label=r.label,
                           virtual_stages=cfg.virtual_stages, speed=speeds, slot_tokens=slot, on_step=on_step)
        out.append(replace(r, static_tokens_per_s=blind.tokens_per_s))
    return out


@dataclass
class Simulation:
    """What a comparison computed: the setup, one PolicyRun per policy, and the PNGs written."""

    setup: dict[str, Any]
    runs: list[PolicyRun]
    plots: dict[str, list[str]]  # run label -> [Gantt PNG, load PNG] of its first step
    ctx: ScheduleContext

    def to_dict(self) -> dict[str, Any]:
        """The JSON document of ``flexmesh simulate --json``."""
        return {"setup": self.setup, "policies": [r.to_dict() for r in self.runs], "plots": self.plots,
                "recommendation": recommendation(self.runs).to_dict()}

    def reference(self) -> str:
        """One line naming the best baseline (every speedup's reference) and its own ratio to the lower bound."""
        b = self.setup["best_baseline"]
        return (f"speedup: tokens/s over the best baseline, {b['label']}, whose step is "
                f"{b['ratio_to_lower_bound']:.3f}x the lower bound")

    def static_note(self) -> str | None:
        """One line explaining the static columns, when devices run at different speeds."""
        if not any(r.static_tokens_per_s is not None for r in self.runs):
            return None
        slow = sum(1 for f in self.ctx.cost.cluster.speed_factors if f != 1.0)
        return (f"static: the same policy and options with schedules made for nominal speed, run at the true speeds "
                f"({slow} device{'s' * (slow != 1)} at other than nominal speed; each data rank runs at its slowest "
                f"device); vs static: tokens/s of the speed-aware schedules over it")

    def title(self) -> str:
        """One line naming the model, cluster, plan and workload (the comparison table's title)."""
        s = self.setup
        return (f"{s['model']} on {s['cluster']} ({self.ctx.num_ranks} data ranks, tp{s['tp']} pp{s['pp']}), "
                f"context {s['context']}, {s['lengths']}, {s['mean_sequences_per_step']:.0f} seqs / "
                f"{s['mean_tokens_per_step'] / 1e3:.0f}K tokens per step, {s['steps']} steps")


def comparison_row(run: PolicyRun) -> list[str]:
    """One policy's cells of the comparison table, in :data:`COLUMNS` order."""
    d = run.to_dict()
    return [run.label, run.kind, f"{d['mean_step_time_s']:.3f}", f"{d['tokens_per_s']:,.0f}",
           "-" if d["speedup_vs_best_baseline"] is None else f"{d['speedup_vs_best_baseline']:.2f}x",
           f"{d['imbalance']:.3f}", f"{d['ratio_to_lower_bound']:.3f}", f"{d['scheduler_ms_per_step']:.1f}",
           f"{d['utilisation']:.0%}"]


def static_cells(run: PolicyRun) -> list[str]:
    """The :data:`SPEED_COLUMNS` cells of a run with a static comparison (:func:`with_static`), else dashes."""
    if run.static_tokens_per_s is None:
        return ["-"] * len(SPEED_COLUMNS)
    return [f"{run.static_tokens_per_s:,.0f}", f"{run.tokens_per_s / run.static_tokens_per_s:.2f}x"]


def summarise(cfg: SimulationConfig, ctx: ScheduleContext, batches: list[np.ndarray], runs: list[PolicyRun],
              plots_dir: str | Path | None = None) -> Simulation:
    """The Simulation of ``runs``; with ``plots_dir``, a Gantt and a load PNG of each run's first step."""
    plots = {}
    if plots_dir:
        # Imported here: matplotlib is slow to import and only pictures need it.
        from flexmesh.sim.plots import gantt_png, load_png

        out = Path(plots_dir)
        for r in runs:
            if r.first_timeline is None:  # every run keeps its first step's timeline; this guards the type
                continue
            name = r.policy
            plots[r.label] = [str(gantt_png(r.first_timeline, out / f"{name}_gantt.png", f"{r.label}, step 0")),
                              str(load_png(r.first_timeline, out / f"{name}_load.png", f"{r.label}, step 0"))]
    setup = {"model": ctx.cost.model.name, "cluster": ctx.cost.cluster.label, "tp": cfg.tp, "pp": cfg.pp,
             "pipeline_schedule": cfg.pipeline_schedule, "virtual_stages": cfg.virtual_stages, "zero": cfg.zero,
             "recompute": cfg.recompute, "cp_kind": cfg.cp_kind, "data_ranks": ctx.num_ranks,
             "context": cfg.context, "lengths": cfg.lengths, "steps": cfg.steps, "seed": cfg.seed,
             "mean_sequences_per_step": float(np.mean([len(b) for b in batches])),
             "mean_tokens_per_step": float(np.mean([b.sum() for b in batches]))}
    base = best_baseline(runs)
    setup["best_baseline"] = {"label": base.label, "tokens_per_s": base.tokens_per_s,
                              "ratio_to_lower_bound": base.mean_ratio_to_lower_bound}
    return Simulation(setup, runs, plots, ctx)
