"""``flexmesh simulate``: compare per-step scheduling policies on simulated steps.

Draws ``--steps`` global batches from a length distribution (sequences longer than ``--seq-len`` are
truncated to it), schedules each with every policy, simulates the step on the plan given by the flags
and prints, per policy, mean step time, tokens/s, speedup over the best baseline (the static settings
people run: fixed, padded, balanced, wlb, each at its best degree; they always run), imbalance,
ratio to the lower bound and scheduler time. See docs/cli-simulate.md.
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from flexmesh.commands.args import (
    DEFAULT_CLUSTER,
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_LENGTHS,
    DEFAULT_MODEL,
    DEFAULT_POLICIES,
    DEFAULT_SEQ_LEN,
    TASKS_HELP,
    DefaultsHelpFormatter,
    add_slow_arg,
    add_stack_args,
    folder,
    nonempty,
    nonneg_int,
    old_names,
    positive_int,
    seq_len,
    sequences,
    stack_of,
    steps,
    tasks_of,
    tokens,
)
from flexmesh.cost.training.parts import Parts
from flexmesh.errors import FlexmeshError
from flexmesh.job import Job, build_job, plan_sizes
from flexmesh.layout.plan import PIPELINE_SCHEDULES, Plan, load_plan
from flexmesh.layout.plan_model import plan_model
from flexmesh.profile.use import cost_model_for
from flexmesh.report.tables import print_table as print_fitted
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.scheduler import plan_costs
from flexmesh.sim.compare import Recommendation, recommendation
from flexmesh.sim.simulation import (
    COLUMNS,
    SPEED_COLUMNS,
    Simulation,
    SimulationConfig,
    comparison_row,
    policy_steps,
    run_policies,
    sample_batches,
    simulation_context,
    static_cells,
    summarise,
)
from flexmesh.spec.model import parse_model
from flexmesh.spec.speeds import slow_devices, speeds_of

if TYPE_CHECKING:
    from rich.console import Console

SHORTER = "fewer --steps or --policies, or a shorter --context, to shorten it"  # said when a simulation is long


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``flexmesh simulate`` and its flags."""
    p = sub.add_parser("simulate", help="compare scheduling policies on simulated training steps",
                       description=__doc__.split("\n\n")[1], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--plan", metavar="PLAN", help="simulate the layout of this plan file (any version; default "
                   "model and cluster: the plan's); a plan of several replica groups compares its fixed shares "
                   "with each step dispatched over its groups, and the layout flags (--tp ... --cp-kind) do not apply")
    p.add_argument("--model", type=nonempty,
                   help="model preset, gpt:L:H:A, or a Hugging Face config.json (default: the plan's, "
                   f"else {DEFAULT_MODEL})")
    p.add_argument("--cluster", type=nonempty, help="NODESxPERNODExDEVICE (e.g. 8x8xA100-40GB) or a file (default: "
                                     f"the plan's, else the hardware profile's node, else {DEFAULT_CLUSTER})")
    p.add_argument("--hardware-profile", metavar="PATH", help="a `flexmesh profile hardware` file to price with")
    p.add_argument("--model-profile", metavar="PATH", help="a `flexmesh profile model` file to price with")
    p.add_argument("--seq-len", type=seq_len, help="the longest sequence, in tokens; longer ones are truncated "
                                                       f"to it (default: the plan's, else {DEFAULT_SEQ_LEN})")
    old_names(p, "--context", dest="seq_len", type=seq_len)
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="shipped distribution name or a .txt/.json file")
    p.add_argument("--tasks", metavar="FILE", help=TASKS_HELP)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--global-batch", type=sequences, default=None,
                      help=f"sequences per step (default: the plan's, else {DEFAULT_GLOBAL_BATCH})")
    size.add_argument("--tokens-per-batch", type=tokens, default=None,
                      help="tokens per step instead of sequences")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="comma-separated scheduling policies, run besides the baselines (fixed, padded, balanced, "
                        "wlb), which always run")
    p.add_argument("--steps", type=steps, default=20, help="global batches to draw and simulate")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed of the length draws and the policies")
    # the layout simulated without --plan (None: not given, the default in LAYOUT_DEFAULTS; beside --plan, refused)
    p.add_argument("--tp", type=positive_int, help="tensor parallel degree (default 1)")
    p.add_argument("--pp", type=positive_int, help="pipeline parallel degree (default 1)")
    p.add_argument("--pipeline-schedule", "--schedule", dest="pipeline_schedule", choices=PIPELINE_SCHEDULES,
                   help="pipeline schedule (pp > 1; default 1f1b); --schedule is the old name")
    p.add_argument("--virtual-stages", type=positive_int, help="model chunks per rank (interleaved; default 1)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3),
                   help="ZeRO stage, sharded over all data ranks (default 3)")
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction,
                   help="full activation recomputation (default on)")
    p.add_argument("--cp-kind", choices=("ulysses", "ring"), help="context-parallel kind (default ulysses)")
    add_slow_arg(p, "slow", "--speed")  # the table then adds tokens/s with schedules made for nominal speed
    p.add_argument("--json", action="store_true", help="print plain JSON instead of a table")
    p.add_argument("--plots", metavar="DIR", default=None, type=folder,
                   help="write a Gantt and a load PNG per policy here")
    add_stack_args(p)
    p.set_defaults(func=run)
    return p


def _slow(pairs: list[tuple[int, float]], world: int) -> tuple[float, ...]:
    """``--slow`` as one speed factor per device (() for none), checked as plan and train check it."""
    return speeds_of(slow_devices(pairs, world), world)


LAYOUT_DEFAULTS: dict[str, Any] = {"tp": 1, "pp": 1, "pipeline_schedule": "1f1b", "virtual_stages": 1, "zero": 3,
                                   "recompute": True, "cp_kind": "ulysses"}


@dataclass(frozen=True)
class _Layout:
    """The layout simulated: ``--plan``'s, else the layout flags' (:data:`LAYOUT_DEFAULTS` where not given)."""

    tp: int
    pp: int
    pipeline_schedule: str
    virtual_stages: int
    zero: int
    recompute: bool
    cp_kind: str

    @classmethod
    def of(cls, args: argparse.Namespace | None, plan: Plan | None) -> _Layout:
        given = {k: getattr(args, k, None) for k in LAYOUT_DEFAULTS}
        if plan is None:
            return cls(**{k: LAYOUT_DEFAULTS[k] if v is None else v for k, v in given.items()})
        named = [k for k, v in given.items() if v is not None]
        if named:
            flag = "--[no-]recompute" if named[0] == "recompute" else f"--{named[0].replace('_', '-')}"
            raise FlexmeshError(f"{flag} sets the layout simulated without --plan; with --plan the plan's layout "
                                "holds: drop it, or drop --plan")
        s = plan.layer_strategies()[0]
        return cls(s.tp, plan.pp, str(plan.pipeline_schedule), plan.virtual_stages, s.zero, bool(s.recompute),
                   str(s.cp_kind) if s.cp > 1 else "ulysses")


def simulate_job(args: argparse.Namespace, plan: Plan | None) -> Job:
    """The job the flags describe, ``--plan``'s model, cluster, sequence cap and batch where they say
    nothing (a plan of several groups: its groups' shares scaled to the batch, each device group's cost
    model assembled as one group's is)."""
    if plan is None:
        model, cluster = parse_model(args.model or DEFAULT_MODEL), args.cluster
        seq_len, global_batch = args.seq_len or DEFAULT_SEQ_LEN, args.global_batch or DEFAULT_GLOBAL_BATCH
    else:
        model = plan_model(plan, args.model, args.plan)
        cluster = args.cluster if args.cluster is not None or args.hardware_profile else plan.cluster
        # a step counted in tokens without --global-batch: the default batch, not the plan's
        batch = DEFAULT_GLOBAL_BATCH if args.global_batch is None and args.tokens_per_batch else args.global_batch
        seq_len, global_batch = plan_sizes(plan, args.seq_len, batch)
    if plan is not None and len(plan.groups) > 1:
        if args.hardware_profile or args.model_profile:
            raise FlexmeshError("profiles describe one device type; a plan of several replica groups is priced "
                                "from the presets of its cluster: drop --hardware-profile / --model-profile")
        if args.tokens_per_batch:
            raise FlexmeshError("--tokens-per-batch does not apply to a plan of replica groups, whose shares count "
                                "sequences; give --global-batch")
        plan = plan.with_global_batch(global_batch)
        mixed = plan_costs(plan, model).cluster  # the plan's cluster, checked against the plan
        parts = Parts(stack_of(args), tasks=tasks_of(args.tasks, model))  # LoRA adapters, another stack's layers
        return build_job(model, seq_len, global_batch, cluster=mixed, parts=parts, plan=plan)
    base = cost_model_for(model, cluster, args.hardware_profile, args.model_profile, default_cluster=DEFAULT_CLUSTER)
    parts = Parts(stack_of(args), tasks=tasks_of(args.tasks, base.model))
    return build_job(base.model, seq_len, global_batch, base=base, tokens_per_batch=args.tokens_per_batch,
                     parts=parts, plan=plan)


def _config(args: argparse.Namespace, job: Job, layout: _Layout, policies: tuple[str, ...],
            speed_factors: tuple[float, ...]) -> SimulationConfig:
    return SimulationConfig(policies=policies, context=job.seq_len, lengths=args.lengths, steps=args.steps,
                            seed=args.seed, seqs_per_batch=job.global_batch, tokens_per_batch=job.tokens_per_batch,
                            tp=layout.tp, pp=layout.pp, pipeline_schedule=layout.pipeline_schedule,
                            virtual_stages=layout.virtual_stages, zero=layout.zero, recompute=layout.recompute,
                            cp_kind=layout.cp_kind, speed_factors=speed_factors)


def _with_plan(cfg: SimulationConfig, plan: Plan) -> SimulationConfig:
    """``cfg`` with what a plan of one group fixes beyond its layout: its overlap and layers per chunk."""
    return replace(cfg, overlap=plan.overlap, chunk_layers=tuple(st.num_layers for st in plan.group.stages))


def plan_recommendation(plan: Plan, job: Job, batches: list[np.ndarray], seed: int = 0) -> Recommendation:
    """What ``simulate --plan`` recommends for ``plan`` on ``batches`` (``job``: its model, sequence cap and
    cost model; for several groups the groups' costs): one group, its default ``--policies`` against the
    baselines; several, train's choices (flexmesh.sim.groups.RECOMMENDED_AMONG), as train chooses among them.
    ``plan`` prints it for the plan it writes."""
    from flexmesh.schedule.groups import groups_context
    from flexmesh.sim.groups import recommend_dispatch

    if len(plan.groups) > 1:
        assert job.costs is not None
        gctx = groups_context(plan, job.model, job.costs)
        return recommend_dispatch(gctx, batches, seed=seed, virtual_stages=[g.virtual_stages for g in plan.groups])
    if job.cost is None:  # one group from a mixed cluster's search: priced as `simulate --plan` prices it
        job = replace(job, cost=cost_model_for(job.model, plan.cluster).replace(parts=job.parts))
    assert job.cost is not None
    layout = _Layout.of(None, plan)
    cfg = _with_plan(SimulationConfig(
        policies=tuple(DEFAULT_POLICIES.split(",")), context=job.seq_len, steps=len(batches), seed=seed,
        seqs_per_batch=job.global_batch, tp=layout.tp, pp=layout.pp, pipeline_schedule=layout.pipeline_schedule,
        virtual_stages=layout.virtual_stages, zero=layout.zero, recompute=layout.recompute, cp_kind=layout.cp_kind),
        plan)
    ctx, speeds = simulation_context(job.cost, cfg)
    return recommendation(run_policies(cfg, ctx, speeds, batches))


def _prepare(args: argparse.Namespace,
             policies: tuple[str, ...]) -> tuple[SimulationConfig, ScheduleContext, np.ndarray]:
    """Check the flags and build the plan they describe (errors in the order a user meets them)."""
    plan = load_plan(args.plan) if args.plan else None
    layout = _Layout.of(args, plan)
    job = simulate_job(args, plan)
    assert job.cost is not None
    world = job.cost.cluster.world_size
    cfg = _config(args, job, layout, policies, _slow(args.slow, world))
    if plan is not None:
        cfg = _with_plan(cfg, plan)
    if layout.pp == 1 and (layout.virtual_stages != 1 or layout.pipeline_schedule == "interleaved"):
        raise FlexmeshError("--virtual-stages and --pipeline-schedule interleaved need --pp > 1")
    if layout.virtual_stages > 1 and layout.pipeline_schedule != "interleaved":
        raise FlexmeshError("--virtual-stages > 1 needs --pipeline-schedule interleaved")
    if world % (layout.tp * layout.pp):
        raise FlexmeshError(f"{world} devices are not divisible by tp {layout.tp} x pp {layout.pp}; change --tp or "
                            "--pp")
    chunks, layers = layout.pp * layout.virtual_stages, job.model.num_layers
    if plan is None and chunks > layers:  # flags' chunks take ceil(layers / chunks) each: one, where there is none
        raise FlexmeshError(f"--pp {layout.pp} x --virtual-stages {layout.virtual_stages} = {chunks} pipeline chunks "
                            f"but {job.model.name} has {layers} layer{'s' * (layers != 1)}; lower --pp or "
                            "--virtual-stages")
    return (cfg, *simulation_context(job.cost, cfg))


def build_context(args: argparse.Namespace) -> tuple[ScheduleContext, np.ndarray]:
    """The ScheduleContext (and per-lane speeds) of the plan the flags describe."""
    _, ctx, speeds = _prepare(args, ())
    return ctx, speeds


def simulate(args: argparse.Namespace):  # noqa: ANN201 - a Simulation, or a GroupsSimulation for several groups
    """Draw the batches, schedule and simulate them under every policy (with progress on stderr, and an
    estimate when long: flexmesh.console.progress_steps)."""
    from flexmesh.console import progress_steps

    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    if not policies:
        raise FlexmeshError("--policies is empty; give e.g. hdp,milp")
    if args.plan and len(load_plan(args.plan).groups) > 1:
        return simulate_groups(args, policies)
    cfg, ctx, speeds = _prepare(args, policies)
    batches = sample_batches(cfg)
    total = policy_steps(cfg, ctx)
    if total < 40:
        runs = run_policies(cfg, ctx, speeds, batches)
    else:  # on stderr, so --json's stdout stays the JSON alone
        with progress_steps("scheduling and simulating", total,
                            hint=SHORTER) as advance:
            runs = run_policies(cfg, ctx, speeds, batches, on_step=advance)
    sim = summarise(cfg, ctx, batches, runs, plots_dir=args.plots)
    if args.plan:
        sim.setup["plan_step"] = _plan_step(load_plan(args.plan), cfg, ctx, speeds, batches)
    return sim


def _plan_step(plan: Plan, cfg: SimulationConfig, ctx: ScheduleContext, speeds: np.ndarray,
               batches: list[np.ndarray]) -> dict:
    """The plan's own layout as it trains by default (``fixed`` packing at the plan's context-parallel
    degree, where the baselines sweep every degree, into micro-batches of the plan's token budget, as the
    runtime's scheduler packs them), beside the step the plan file predicts."""
    from flexmesh.sim.compare import run_policy

    cp = plan.layer_strategies()[0].cp
    context = max(cfg.context, plan.microbatch_tokens * cp)
    own = run_policy("fixed", batches, ctx, options={"cp": cp, "context": context}, seed=cfg.seed,
                     virtual_stages=cfg.virtual_stages, speed=speeds)
    return {"cp": cp, "simulated_step_s": own.mean_step_time,
            "predicted_step_s": plan.predicted.get("step_time_s") if plan.predicted else None}


def print_table(sim: Simulation, console: Console) -> None:
    """The per-policy comparison as a rich table, then the plot files."""
    from rich.table import Table

    table = Table(title=sim.title())
    note = sim.static_note()
    for col in COLUMNS + (SPEED_COLUMNS if note else ()):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in sim.runs:
        table.add_row(*comparison_row(r), *(static_cells(r) if note else ()))
    print_fitted(console, table)
    console.print(sim.reference(), highlight=False)
    console.print(recommendation(sim.runs).line, highlight=False)
    own = sim.setup.get("plan_step")
    if own:
        predicted = own["predicted_step_s"]
        console.print(f"the plan's own layout (fixed, cp={own['cp']}): {own['simulated_step_s']:.3f} s per step"
                      + (f"; the plan file predicts {predicted:.3f} s at its --seq-len" if predicted else ""),
                      highlight=False)
    if note:
        console.print(note, highlight=False)
    for label, files in sim.plots.items():
        console.print(f"plots for {label}: {', '.join(files)}", highlight=False)


def run(args: argparse.Namespace) -> int:
    """``flexmesh simulate``: the comparison as a table, or as JSON with ``--json``."""
    from flexmesh.console import plain_console
    from flexmesh.files import make_folder

    if args.plots:
        make_folder(args.plots, create=False)  # a symlink or a file there: refused before simulating
    sim = simulate(args)
    if args.json:
        print(json.dumps(sim.to_dict(), indent=2))
        return 0
    sim.print(plain_console()) if isinstance(sim, GroupsSimulation) else print_table(sim, plain_console())
    return 0


# ---- a plan of several replica groups -----------------------------------------------------------------
@dataclass
class GroupsSimulation:
    """What ``simulate --plan`` computed for a plan of several replica groups (flexmesh.sim.groups)."""

    setup: dict
    runs: list

    def to_dict(self) -> dict:
        from flexmesh.sim.groups import groups_recommendation

        return {"setup": self.setup, "schedules": [r.to_dict() for r in self.runs],
                "recommendation": groups_recommendation(self.runs).to_dict()}

    def print(self, console: Console) -> None:
        from rich.table import Table

        from flexmesh.sim.groups import best_baseline, groups_recommendation

        s, base = self.setup, best_baseline(self.runs)
        table = Table(title=f"{s['model']} on {s['cluster']}: {s['groups']} replica groups, sequences up to "
                            f"{s['context']}, {s['lengths']}, {s['global_batch']} seqs per step, {s['steps']} steps")
        for col in ("schedule", "step s", "tokens/s", "speedup", "step/LB", "sched ms"):
            # the schedule's name whole (never cut: the names are the comparison), 80 columns in all
            table.add_column(col, justify="left" if col == "schedule" else "right", overflow="fold",
                             min_width=17 if col == "schedule" else None)
        for r in self.runs:
            d = r.to_dict()
            table.add_row(r.name, f"{d['mean_step_time_s']:.3f}", f"{r.tokens_per_s:,.0f}",
                          f"{r.tokens_per_s / base.tokens_per_s:.2f}x", f"{r.ratio_to_bound:.3f}",
                          f"{d['scheduler_ms_per_step']:.1f}")
        print_fitted(console, table)
        console.print(f"speedup: tokens/s over the best fixed-share schedule, {base.name}; shares: each group its "
                      "planned share in order, shares+P: packed inside each group by P, dispatch+P: each step's "
                      "sequences dispatched over the groups, then packed by P; step/LB: the simulated step over "
                      "the per-step lower bound", highlight=False)
        console.print(groups_recommendation(self.runs).line, highlight=False)


def simulate_groups(args: argparse.Namespace, policies: tuple[str, ...]) -> GroupsSimulation:
    """The groups of ``--plan`` on its cluster's presets, ``--slow`` devices at their speeds (each data
    rank at its slowest device), on ``--global-batch`` sequences per step (the plan's by default; its
    groups' shares scaled to it)."""
    from flexmesh.schedule.groups import groups_context
    from flexmesh.sim.groups import compare_groups, device_speeds

    job = simulate_job(args, load_plan(args.plan))
    plan, spec, costs = job.plan, job.model, job.costs
    assert plan is not None and costs is not None
    slow = _slow(args.slow, plan.world_size)
    gctx = device_speeds(groups_context(plan, spec, costs), plan, slow)  # in place of the cluster's own speeds
    layout = _Layout(1, 1, "1f1b", 1, 3, True, "ulysses")  # each group's own: the flags' do not apply
    batches = sample_batches(_config(args, job, layout, policies, ()))
    from flexmesh.console import progress_steps

    total = (1 + 2 * len(policies)) * len(batches)
    with (progress_steps("scheduling and simulating", total, hint="fewer --steps or --policies to shorten it")
          if total >= 40 else nullcontext()) as advance:
        runs = compare_groups(gctx, batches, policies, seed=args.seed,
                              virtual_stages=[g.virtual_stages for g in plan.groups], on_step=advance)
    setup = {"model": spec.name, "cluster": plan.cluster, "plan": plan.layout.split("\n"), "groups": len(plan.groups),
             "context": job.seq_len, "lengths": args.lengths, "steps": args.steps, "seed": args.seed,
             "global_batch": plan.global_batch, "speed_factors": list(slow)}
    return GroupsSimulation(setup, runs)
