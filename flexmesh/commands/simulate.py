"""``flexmesh simulate``: compare per-step scheduling policies on simulated steps.

Draws ``--steps`` global batches from a length distribution (sequences longer than ``--context`` are
truncated to it), schedules each with every policy, simulates the step on the plan given by the flags
and prints, per policy, mean step time, tokens/s, speedup over the best static ``fixed`` setting,
imbalance, ratio to the lower bound and scheduler time. See docs/cli-simulate.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass, replace
from pathlib import Path

from flexmesh.errors import FlexmeshError, SpecError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("simulate", help="compare scheduling policies on simulated training steps",
                       description=__doc__.split("\n\n")[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="model preset, gpt:L:H:A, or a Hugging Face config.json")
    p.add_argument("--cluster", help="NODESxPERNODExDEVICE (e.g. 8x8xA100-40GB) or a file; "
                                     "optional with --hardware-profile (its node)")
    p.add_argument("--hardware-profile", metavar="PATH", help="a `flexmesh profile hardware` file to price with")
    p.add_argument("--model-profile", metavar="PATH", help="a `flexmesh profile model` file to price with")
    p.add_argument("--context", type=int, required=True,
                   help="maximum sequence length; longer sequences are truncated to it")
    p.add_argument("--lengths", default="wikipedia", help="shipped distribution name or a .txt/.json file")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--global-batch", type=int, default=None, help="sequences per step (default 512)")
    size.add_argument("--tokens-per-batch", type=int, default=None, help="tokens per step instead of sequences")
    p.add_argument("--policies", default="fixed,balanced,hdp", help="comma-separated scheduling policies")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel degree")
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved"),
                   help="pipeline schedule (pp > 1)")
    p.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (interleaved)")
    p.add_argument("--zero", type=int, default=3, choices=(0, 1, 2, 3),
                   help="ZeRO stage, sharded over all data ranks")
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=True,
                   help="full activation recomputation")
    p.add_argument("--cp-kind", default="ulysses", choices=("ulysses", "ring"), help="context-parallel kind")
    p.add_argument("--slow", default="", metavar="RANK=FACTOR,...",
                   help="speed factors of individual devices, e.g. 3=0.5 (device 3 at half speed)")
    p.add_argument("--json", action="store_true", help="print plain JSON instead of a table")
    p.add_argument("--plots", metavar="DIR", default=None, help="write a Gantt and a load PNG per policy here")
    p.set_defaults(func=run)
    return p


def _slow(text: str, world: int) -> tuple[float, ...]:
    if not text:
        return ()
    f = [1.0] * world
    for item in text.split(","):
        try:
            rank, factor = item.split("=")
            r, x = int(rank), float(factor)
        except ValueError:
            raise SpecError(f"--slow: cannot read {item!r}; write RANK=FACTOR, e.g. 3=0.5") from None
        if not 0 <= r < world or x <= 0:
            raise SpecError(f"--slow {item!r}: rank must be in 0..{world - 1} and the factor > 0")
        f[r] = x
    return tuple(f)


def build_context(args):
    """The ScheduleContext (and per-lane speeds) of the plan the flags describe."""
    from flexmesh.cost import CostModel
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.schedule.context import ScheduleContext
    from flexmesh.sim.timeline import lane_speeds
    from flexmesh.spec import parse_model

    from flexmesh.profile.use import cost_model_for

    base = cost_model_for(parse_model(args.model), args.cluster, getattr(args, "hardware_profile", None),
                          getattr(args, "model_profile", None))
    cluster = base.cluster
    cluster = replace(cluster, speed_factors=_slow(args.slow, cluster.world_size) or cluster.speed_factors)
    for name in ("tp", "pp", "virtual_stages", "steps", "context"):
        if getattr(args, name) < 1:
            raise FlexmeshError(f"--{name.replace('_', '-')} must be >= 1")
    if args.pp == 1 and (args.virtual_stages != 1 or args.schedule == "interleaved"):
        raise FlexmeshError("--virtual-stages and --schedule interleaved need --pp > 1")
    if args.virtual_stages > 1 and args.schedule != "interleaved":
        raise FlexmeshError("--virtual-stages > 1 needs --schedule interleaved")
    world = cluster.world_size
    if world % (args.tp * args.pp):
        raise FlexmeshError(f"{world} devices are not divisible by tp {args.tp} x pp {args.pp}; change --tp or --pp")
    speeds = lane_speeds(cluster, args.tp, args.pp)
    cost = base if cluster == base.cluster else CostModel(base.model, cluster, base.hw, base.profile)
    ctx = ScheduleContext(cost=cost, base=LayerStrategy(tp=args.tp, zero=args.zero,
                                                                              recompute=args.recompute),
                          num_ranks=world // (args.tp * args.pp), pp=args.pp, pipeline_schedule=args.schedule,
                          cp_kind=args.cp_kind, speed=tuple(float(x) for x in speeds.min(axis=0)))
    return ctx, speeds


@dataclass
class Simulation:
    """What ``flexmesh simulate`` computed: the setup, one PolicyRun per policy, and PNGs written."""

    setup: dict
    runs: list
    plots: dict
    ctx: object


def simulate(args) -> Simulation:
    """Draw the batches, schedule and simulate them under every policy (with a progress bar when long)."""
    import numpy as np
    from rich.console import Console
    from rich.progress import Progress

    from flexmesh.data.lengths import BatchSampler, load_lengths
    from flexmesh.sim.compare import compare_policies, fixed_runs_needed

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise FlexmeshError("--policies is empty; give e.g. fixed,balanced,hdp")
    ctx, speeds = build_context(args)
    size = {"tokens_per_batch": args.tokens_per_batch} if args.tokens_per_batch else \
        {"seqs_per_batch": args.global_batch or 512}
    sampler = BatchSampler(load_lengths(args.lengths), args.seed, max_len=args.context, **size)
    batches = list(itertools.islice(sampler, args.steps))
    total = fixed_runs_needed(ctx, args.context, policies) * args.steps
    common = dict(context=args.context, seed=args.seed, virtual_stages=args.virtual_stages, speed=speeds)
    if args.json or total < 40:
        runs = compare_policies(policies, batches, ctx, **common)
    else:
        with Progress(console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("scheduling and simulating", total=total)
            runs = compare_policies(policies, batches, ctx, on_step=lambda: bar.advance(task), **common)
    plots = {}
    if args.plots:
        from flexmesh.sim.plots import gantt_png, load_png

        out = Path(args.plots)
        for r in runs:
            name = r.policy
            plots[r.label] = [str(gantt_png(r.first_timeline, out / f"{name}_gantt.png", f"{r.label}, step 0")),
                              str(load_png(r.first_timeline, out / f"{name}_load.png", f"{r.label}, step 0"))]
    setup = {"model": ctx.cost.model.name, "cluster": ctx.cost.cluster.label, "tp": args.tp, "pp": args.pp,
             "schedule": args.schedule, "virtual_stages": args.virtual_stages, "zero": args.zero,
             "recompute": args.recompute, "cp_kind": args.cp_kind, "data_ranks": ctx.num_ranks,
             "context": args.context, "lengths": args.lengths, "steps": args.steps, "seed": args.seed,
             "mean_sequences_per_step": float(np.mean([len(b) for b in batches])),
             "mean_tokens_per_step": float(np.mean([b.sum() for b in batches]))}
    return Simulation(setup, runs, plots, ctx)


def print_table(sim: Simulation, console) -> None:
    """The per-policy comparison as a rich table, then the plot files."""
    from rich.table import Table

    setup, ctx = sim.setup, sim.ctx
    table = Table(title=f"{setup['model']} on {setup['cluster']} ({ctx.num_ranks} data ranks, tp{setup['tp']} "
                        f"pp{setup['pp']}), context {setup['context']}, {setup['lengths']}, "
                        f"{setup['mean_sequences_per_step']:.0f} seqs / {setup['mean_tokens_per_step'] / 1e3:.0f}K "
                        f"tokens per step, {setup['steps']} steps")
    for col in ("policy", "step time (s)", "tokens/s", "speedup", "imbalance", "ratio to LB", "sched ms/step",
                "utilisation"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in sim.runs:
        d = r.to_dict()
        table.add_row(r.label, f"{d['mean_step_time_s']:.3f}", f"{d['tokens_per_s']:,.0f}",
                      "-" if d["speedup_vs_fixed"] is None else f"{d['speedup_vs_fixed']:.2f}x",
                      f"{d['imbalance']:.3f}", f"{d['ratio_to_lower_bound']:.3f}",
                      f"{d['scheduler_ms_per_step']:.1f}", f"{d['utilisation']:.0%}")
    console.print(table)
    for label, files in sim.plots.items():
        console.print(f"plots for {label}: {', '.join(files)}", highlight=False)


def run(args) -> int:
    from rich.console import Console

    sim = simulate(args)
    if args.json:
        print(json.dumps({"setup": sim.setup, "policies": [r.to_dict() for r in sim.runs], "plots": sim.plots},
                         indent=2))
        return 0
    print_table(sim, Console())
    return 0
