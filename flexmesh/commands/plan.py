"""``flexmesh plan``: search the best parallel layout, or ``--check`` a plan file."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from flexmesh.commands.args import (
    DEFAULT_CLUSTER,
    DEFAULT_GLOBAL_BATCH,
    DEFAULT_MODEL,
    DEFAULT_POLICIES,
    DEFAULT_SEQ_LEN,
    TASKS_HELP,
    add_slow_arg,
    add_stack_args,
    chunk_counts,
    given_flags,
    new_file,
    nonempty,
    positive_int,
    seq_len,
    sequences,
    stack_of,
    tasks_of,
    tokens,
)
from flexmesh.commands.experts_args import add_expert_args, check_lsh, experts_of
from flexmesh.commands.plan_lengths import (
    RESCORED,
    SEED,
    STEPS,
    PlanWorkload,
    recommendation_batches,
    score_baselines,
    score_mixed,
    score_uniform,
    with_expected,
    workload,
)
from flexmesh.commands.plan_output import explain, print_table, result_json
from flexmesh.commands.plan_replicas import replica_command
from flexmesh.commands.plan_terms import print_against
from flexmesh.console import plain_console, styled
from flexmesh.cost import CostModel
from flexmesh.cost.training.experts import ExpertParallel
from flexmesh.cost.training.mixed import MixedCosts
from flexmesh.cost.training.parts import Parts
from flexmesh.errors import FlexmeshError, PlanError, SpecError
from flexmesh.files import check_file_target
from flexmesh.job import Job, build_job
from flexmesh.layout.overlap import RUNTIME
from flexmesh.layout.plan import PIPELINE_SCHEDULES, Plan, load_plan
from flexmesh.layout.plan_model import plan_model
from flexmesh.layout.stack import RUNTIME_STACK
from flexmesh.profile.use import LOCAL, cost_model_for
from flexmesh.report.plan_tables import baseline_table, ratios, replica_table, stage_table
from flexmesh.search import SearchRequest, SearchResult, SearchSpace, best_plans
from flexmesh.search.baselines import BaselinePlans, mixed_baselines
from flexmesh.search.check import check_groups, check_plan
from flexmesh.search.mixed import MixedResult, MixedSearch
from flexmesh.search.space import FULL_SPACE, SEARCH_MODES
from flexmesh.sim.compare import Recommendation
from flexmesh.sim.expected import Expected
from flexmesh.spec.cluster import MixedCluster, parse_mixed_cluster
from flexmesh.spec.model import ModelSpec, parse_model, precision_suffix
from flexmesh.spec.model_file import ModelFile
from flexmesh.spec.speeds import slow_devices, speeds_of

# The most sequences a step may hold for ``plan`` to recommend a step policy unasked: the policies simulated on
# STEPS steps of up to 512 sequences take 1-5 s on a 2-core machine; 1,920 sequences on 1,024 devices, 40 s.
RECOMMEND_SEQUENCES = 512

PROGRESS_AFTER_S = 1.0  # show a progress bar only for searches that take longer than this


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``flexmesh plan`` and its options."""
    p = subparsers.add_parser(
        "plan", help="search the fastest parallel layout that fits, or --check a plan file",
        description="Search per-layer strategies, pipeline split, schedule and micro-batches; print the best plans.")
    p.add_argument("--model", type=nonempty,
                   help="preset name, gpt:LAYERS:HIDDEN:HEADS[:VOCAB], or a config.json path or a folder "
                   f"holding one (default {DEFAULT_MODEL}; with --check, the plan's model)")
    p.add_argument("--cluster", default=None, type=nonempty,
                   help="e.g. 8xH100, 8x8xA100-40GB, device groups joined by '+' (1x8xH100+2x8xA100-40GB: a "
                        "mixed cluster, planned as replica groups), a JSON/TOML cluster file, or NxLOCAL (N devices "
                        "of this machine, priced by its saved profiles) (default: the hardware profile's node, else "
                        f"{DEFAULT_CLUSTER})")
    p.add_argument("--hardware-profile", metavar="PATH",
                   help="price compute and communication with this `flexmesh profile hardware` file")
    p.add_argument("--model-profile", metavar="PATH",
                   help="price layers and activations with this `flexmesh profile model` file")
    p.add_argument("--seq-len", type=seq_len, default=DEFAULT_SEQ_LEN,
                   help="tokens per sequence; with --lengths the longest (longer ones are truncated) "
                        f"(default {DEFAULT_SEQ_LEN})")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--global-batch", type=sequences, default=None,
                      help=f"sequences per step (default {DEFAULT_GLOBAL_BATCH})")
    size.add_argument("--tokens-per-batch", type=tokens, default=None,
                      help="tokens per step instead of sequences: as many --seq-len sequences as they hold, moved "
                           "by up to 2%% to the count that splits over the most data-parallel ranks (--global-batch "
                           "keeps an exact count)")
    p.add_argument("--lengths", metavar="NAME_OR_FILE", type=nonempty,
                   help="plan for this length distribution (a shipped name such as wikipedia, or a .txt/.json "
                        "file of lengths, as for simulate): plans ranked by their expected step, simulated on "
                        f"{STEPS} steps drawn with seed {SEED}, --seq-len the cap")
    p.add_argument("--out", type=new_file, help="write the best plan as JSON here (atomically)")
    p.add_argument("--top", type=positive_int, default=5, help="plans to list (default 5)")
    p.add_argument("--pick", type=positive_int, default=1, metavar="N",
                   help="the N-th plan of the list is the one --out writes and --explain explains (default 1: "
                        "the best); the list grows to hold it")
    p.add_argument("--explain", action="store_true",
                   help="break the best (or --pick) plan's time and memory into parts")
    p.add_argument("--against", metavar="PLAN", help="with --explain: compare the best plan term by term with "
                   "this plan file (for instance a published layout), priced by the same cost model; on a mixed "
                   "cluster: any plan of that cluster, beside the baselines")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout (no table, no progress)")
    p.add_argument("--recommend", action=argparse.BooleanOptionalAction, default=None,
                   help="simulate the step policies on the written plan and recommend one (default: when a step "
                        f"holds at most {RECOMMEND_SEQUENCES} sequences, where it takes seconds; larger steps make "
                        "it a minute's simulation, and the output says how to ask for it)")
    p.add_argument("--check", metavar="PLAN",
                   help="validate this plan file (any version) against --model and --cluster (a plan of several "
                        "replica groups: default cluster the one it names); with --out, write it in this version")
    p.add_argument("--same-mesh", action="store_true",
                   help="every layer on the same (tp, cp, dp) mesh; ZeRO and recompute stay per layer")
    p.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    p.add_argument("--pipeline-schedules", "--schedules", dest="pipeline_schedules",
                   default=",".join(PIPELINE_SCHEDULES),
                   help="comma-separated pipeline schedules to consider (--schedules is the old name)")
    p.add_argument("--virtual-stages", type=chunk_counts, default=FULL_SPACE.virtual_stages, metavar="V[,V...]",
                   help=f"chunks per rank the interleaved schedule may try (default "
                        f"{','.join(map(str, FULL_SPACE.virtual_stages))}; more than 2 only where they split the "
                        "layers evenly, the embedding and loss counted as a layer each where that evens them; one "
                        "device type)")
    p.add_argument("--overlap", choices=("search", "runtime"), default="search",
                   help="communication the plan may hide under compute: search: every option frameworks run (TP "
                        "overlap as Megatron-Core's --tp-comm-overlap; docs/cost-model.md); runtime: only what "
                        "`flexmesh train` runs (no TP overlap), to plan for this runtime")
    p.add_argument("--tasks", metavar="FILE", help=TASKS_HELP + "; plans layouts adapters train on (pp 1)")
    p.add_argument("--replicas", action="store_true",
                   help="with --tasks: a mix of replica layouts and per-step dispatch for the tasks' lengths "
                        "(each task's `lengths`, else --lengths), against every single layout")
    add_slow_arg(p)
    add_stack_args(p)
    add_expert_args(p)
    p.add_argument("--mode", choices=SEARCH_MODES, default="auto",
                   help="exact: layer DP + every layer split (small models); fast: closed form per stage")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Check a plan file, or search: the flags resolved once into a Job (flexmesh.job), then the search
    request built from it; print or write the result."""
    args.started = time.perf_counter()
    slowed = _slowed(args) if args.slow else None
    if args.check:
        given = {"--lengths": args.lengths, "--tokens-per-batch": args.tokens_per_batch,
                 "--seq-len": args.seq_len != DEFAULT_SEQ_LEN, "--global-batch": args.global_batch is not None,
                 "--top": args.top != 5, "--pick": args.pick != 1}
        named = given_flags(given)
        if named:
            raise PlanError(f"--check validates a plan file as it is (its own sequence cap and batch); {named[0]} "
                            "steers a new search: drop it (flexmesh simulate --plan FILE --seq-len/--lengths ... "
                            "scores a plan on other sequences)")
    if args.out:
        check_file_target(args.out)  # a device, fifo or symlink there: refused before searching
    loaded = load_plan(args.check) if args.check else None
    if loaded is not None and not loaded.in_rank_order:
        return check_groups_command(args, loaded)
    if slowed is not None and not slowed.uniform:  # devices of different speeds: planned as a mixed cluster
        return run_mixed(args, slowed)
    if loaded is None and args.cluster is not None and not LOCAL.fullmatch(args.cluster.strip()):
        mixed = parse_mixed_cluster(args.cluster)
        if not mixed.uniform:  # several device groups, or devices of different speeds
            return run_mixed(args, mixed)
    spec = (parse_model(args.model or DEFAULT_MODEL) if loaded is None
            else plan_model(loaded, args.model, args.check, recheck=True))
    # --check: the plan's own cluster unless --cluster or a hardware profile says otherwise
    own = loaded.cluster if loaded is not None and args.cluster is None and not args.hardware_profile else None
    try:
        base = cost_model_for(spec, args.cluster or own, args.hardware_profile, args.model_profile,
                              default_cluster=DEFAULT_CLUSTER)
    except SpecError as e:
        if own is None:
            raise
        raise SpecError(f"plan {args.check} records cluster {own!r}, which prices nothing here ({e}); pass "
                        "--cluster") from None
    if slowed is not None:  # every device at one speed: the uniform search, each device at it (its pace)
        base = CostModel(spec, slowed.groups[0])
    # the model in the profiles' dtype when profiles are given (base.model)
    parts = _parts(args, base.model, base.cluster.world_size)
    tasks = parts.tasks
    if args.replicas:
        if tasks is None:
            raise PlanError("--replicas plans replicas for LoRA tasks: give --tasks FILE")
        job = build_job(base.model, args.seq_len, args.global_batch or 8 * len(tasks), base=base, parts=parts)
        return replica_command(job, args.lengths, args.json, args.out, record=lambda plan: recorded(plan, args.model))
    out = plain_console()
    if loaded is not None:
        job = build_job(base.model, loaded.seq_len, loaded.global_batch, base=base, parts=parts, plan=loaded)
        cost = _cost(job)
        ev = check_plan(loaded, job.model, cost.cluster, cost)
        if args.out:
            recorded(loaded, args.model).save(args.out)  # in today's version: --check old.json --out new.json upgrades
        if args.json:
            print(json.dumps({"valid": True, "layout": loaded.layout, **ev.to_dict()}, indent=2))
        else:
            out.print(styled("valid", "green", f": {loaded.layout}"))
            explain(out, ev, cost)
        return 0
    schedules = tuple(s.strip() for s in args.pipeline_schedules.split(",") if s.strip())
    unknown = [s for s in schedules if s not in PIPELINE_SCHEDULES]
    if unknown or not schedules:
        raise PlanError(f"unknown schedule(s) {unknown}; choose from {', '.join(PIPELINE_SCHEDULES)}")
    work = workload(args.seq_len, args.global_batch, args.tokens_per_batch, args.lengths, base.cluster.world_size)
    job = build_job(base.model, work.seq_len, work.global_batch, base=base, tokens_per_batch=work.tokens_per_batch,
                    parts=parts)
    cost = _cost(job)
    # --no-recompute: none; else the full space's none / selective / full; LoRA: adapters train with pp 1
    space = SearchSpace(pipeline_schedules=schedules, recompute=(False,) if args.no_recompute else FULL_SPACE.recompute,
                        same_mesh=args.same_mesh, overlaps=(RUNTIME,) if args.overlap == "runtime" else None,
                        virtual_stages=args.virtual_stages, pp=(1,) if tasks else FULL_SPACE.pp)
    shown = max(args.top, args.pick)
    top = max(shown, RESCORED) if work.lengths else shown  # with --lengths: re-scored, then cut to what is shown
    request = SearchRequest(job.model, cost.cluster, job.seq_len, job.global_batch, space, cost, top=top,
                            mode=args.mode)
    result = _run_search(request, quiet=args.json)
    expected: dict[str, Expected] = {}
    if work.lengths:
        result, expected = score_uniform(result, cost, work, shown)
    if args.pick > len(result.plans):
        raise PlanError(f"--pick {args.pick}: the search found {len(result.plans)} plans that fit; pick 1 to "
                        f"{len(result.plans)}")
    best = result.plans[args.pick - 1]
    plan = recorded(with_expected(best.plan, expected[best.plan.layout], work) if expected else best.plan, args.model)
    if args.out:
        plan.save(args.out)
    found = _recommended(plan, job, work, args.recommend)
    if args.json:
        print(json.dumps({**result_json(result, plan, expected, args.pick), "workload": work.to_dict(),
                          "recommendation": _recommended_json(found),
                          "recommendation_seconds": found.seconds}, indent=2))
        return 0
    out.print(job.model.describe(), highlight=False)
    print_table(out, result, expected, job.model)
    out.print(work.describe(), highlight=False)
    if moved := work.factoring():
        out.print(moved, highlight=False)
    if cost.cluster.pace != 1.0:
        out.print(f"every device priced at speed {cost.cluster.pace:g}: the cluster's devices all run at it (its "
                  "speed_factors), compute stretched, communication not", highlight=False)
    _print_recommended(out, found)
    if args.explain:
        explain(out, best.evaluation, cost)
        if args.against:
            other = load_plan(args.against)
            check_plan(other, job.model, cost.cluster, cost)  # same model and cluster, a layout that can run
            print_against(out, cost, best.plan, other)
    if args.out:
        out.print(f"wrote {'the best plan' if args.pick == 1 else f'plan {args.pick} of the list'} to {args.out}",
                  highlight=False)
    _print_phases(out, args.started, search=result.search_seconds, recommendation=found.seconds)
    return 0


def _slowed(args: argparse.Namespace) -> MixedCluster:
    """``--cluster`` (default the default cluster) with ``--slow``'s devices at their speeds, in place of the
    cluster's own speed factors (as simulate and train take them: flexmesh.spec.speeds.slow_devices)."""
    if args.check or args.replicas:
        raise PlanError("--slow plans a new layout for slow devices; --check and --replicas do not search one: drop "
                        "--slow (flexmesh simulate --plan FILE --slow ... prices a written plan with slow devices)")
    if args.hardware_profile or args.model_profile or (args.cluster and LOCAL.fullmatch(args.cluster.strip())):
        raise PlanError("--slow prices devices of different speeds from the cluster's device presets, as for a mixed "
                        "cluster; drop --hardware-profile / --model-profile, or give a preset cluster (e.g. 8xH100)")
    cluster = parse_mixed_cluster(args.cluster or DEFAULT_CLUSTER)
    return cluster.with_speeds(speeds_of(slow_devices(args.slow, cluster.world_size), cluster.world_size))


@dataclass(frozen=True)
class Recommended:
    """The step policy recommended for the plan written (None: not computed, or the layout cannot schedule
    the batches), what it was computed on or why not, and the seconds it took."""

    recommendation: Recommendation | None
    sentence: str
    seconds: float = 0.0


def _recommended(plan: Plan, job: Job, work: PlanWorkload, asked: bool | None) -> Recommended:
    """The policy ``simulate --plan`` recommends for the plan written (flexmesh.commands.simulate.
    plan_recommendation on :func:`recommendation_batches`): computed when ``asked`` (``--recommend``), or
    by default when a step holds at most :data:`RECOMMEND_SEQUENCES` sequences."""
    from flexmesh.commands.simulate import plan_recommendation
    from flexmesh.sim.groups import RECOMMENDED_AMONG

    t0 = time.perf_counter()
    batches, lengths = recommendation_batches(work)
    policies = ",".join(RECOMMENDED_AMONG) if len(plan.groups) > 1 else DEFAULT_POLICIES
    table = (f"flexmesh simulate --plan FILE --lengths {lengths} --steps {len(batches)} --policies {policies} shows "
             "the table")
    most = max(len(b) for b in batches)
    if asked is False or (asked is None and most > RECOMMEND_SEQUENCES):
        why = "--no-recommend" if asked is False else (
            f"steps of up to {most:,} sequences make it a long simulation; --recommend computes it here")
        return Recommended(None, f"policy not recommended ({why}); {table}")
    try:
        rec = plan_recommendation(plan, replace(job, plan=plan), batches, SEED)
    except FlexmeshError:
        return Recommended(None, "", time.perf_counter() - t0)
    return Recommended(rec, f"on {len(batches)} steps of {lengths} lengths up to {work.seq_len} tokens: {table}",
                       time.perf_counter() - t0)


def _print_recommended(out: Console, found: Recommended) -> None:
    if found.recommendation is not None:
        out.print(f"{found.recommendation.line} ({found.sentence})", highlight=False, soft_wrap=True)
    elif found.sentence:
        out.print(found.sentence, highlight=False, soft_wrap=True)  # one line, however wide


def _recommended_json(found: Recommended) -> dict | None:
    if found.recommendation is None:
        return None
    return {**found.recommendation.to_dict(), "computed_on": found.sentence}


def _print_phases(out: Console, started: float, **phases: float) -> None:
    """One line of where the command's time went: each phase, and the rest (model, cost model, lengths,
    baselines' pricing, output)."""
    total = time.perf_counter() - started
    parts = [f"{name} {s:.2f} s" for name, s in phases.items() if s > 0]
    rest = total - sum(phases.values())
    out.print(f"took {total:.2f} s: {', '.join(parts + [f'the rest {rest:.2f} s'])}", highlight=False)


def _parts(args: argparse.Namespace, model: ModelSpec, world: int) -> Parts:
    """The job's parts by the flags (flexmesh.cost.training.parts): another stack's layers, how a mixture of
    experts runs (the default placement for a dense model), the LoRA tasks' adapters."""
    check_lsh(args, model)
    experts = (experts_of(model, world, args.expert_placement, args.expert_imbalance, args.routing,
                          lsh=args.expert_lsh) if model.is_moe else ExpertParallel())
    return Parts(stack=stack_of(args), experts=experts, tasks=tasks_of(args.tasks, model))


def _cost(job: Job) -> CostModel:
    """The job's cost model of one device type (a job of the uniform search or check has one)."""
    assert job.cost is not None
    return job.cost


def recorded(plan: Plan, model: str | None) -> Plan:
    """``plan`` recording the config.json that ``--model`` names (its path and sha256), so that a command
    run from another folder finds the model again (flexmesh.layout.plan_model), a ``gpt:`` model's text, and the
    precision ``--model`` asks for (``@fp16``: in the plan's model, which every command reads it from)."""
    found = ModelFile.of(model) if model else None
    out = plan if found is None else replace(plan, model_config=found)
    if model and model.startswith("gpt:"):  # its name (gpt-LxHxA) drops the vocabulary: the text itself
        return replace(out, model=model)
    precision = precision_suffix(model) if model else None
    if precision is not None and precision_suffix(out.model) is None:
        out = replace(out, model=f"{out.model}@{precision}")
    return out


def _run_search(request: SearchRequest, quiet: bool) -> SearchResult:
    if quiet:
        return best_plans(request)
    t0 = time.perf_counter()
    state: dict = {}

    def progress(done: int, total: int) -> None:
        # Start the bar lazily so that fast searches print nothing extra.
        if "bar" not in state and time.perf_counter() - t0 > PROGRESS_AFTER_S and done < total:
            bar = Progress(TextColumn("searching"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                           TimeElapsedColumn(), console=plain_console(stderr=True), transient=True)
            bar.start()
            state["bar"], state["task"] = bar, bar.add_task("search", total=total)
        if "bar" in state:
            state["bar"].update(state["task"], completed=done)

    try:
        return best_plans(request, progress=progress)
    finally:
        if "bar" in state:
            state["bar"].stop()


# ---- mixed clusters -----------------------------------------------------------------------------------
def _no_profiles(args: argparse.Namespace) -> None:
    if args.hardware_profile or args.model_profile:
        raise PlanError("profiles describe one device type; a mixed cluster is priced from the device presets "
                        "of its groups: drop --hardware-profile / --model-profile")


def check_groups_command(args: argparse.Namespace, plan: Plan) -> int:
    """Validate a plan of replica groups against --model and --cluster (default: the cluster it names),
    priced as the flags say (the stack's layers, the tasks' adapters, the experts' placement) as a plan
    of one group is: the same job, each device group's cost model assembled alike."""
    _no_profiles(args)
    cluster = parse_mixed_cluster(args.cluster if args.cluster is not None else plan.cluster)
    model = plan_model(plan, args.model, args.check, recheck=True)
    job = build_job(model, plan.seq_len, plan.global_batch, cluster=cluster,
                    parts=_parts(args, model, cluster.world_size), plan=plan)
    ev = check_groups(plan, model, cluster, job.costs)
    if args.out:
        recorded(plan, args.model).save(args.out)  # in today's version: --check old.json --out new.json upgrades
    if args.json:
        print(json.dumps({"valid": True, "layout": plan.layout.split("\n"), **ev.to_dict()}, indent=2))
        return 0
    out = plain_console()
    out.print(styled("valid", "green", f": {len(plan.groups)} replica groups on {cluster.label}, predicted step "
                                       f"{ev.step_time:.3f} s, {ev.tokens_per_s:,.0f} tokens/s"))
    if job.parts.stack != RUNTIME_STACK:
        out.print(f"layers priced as another stack runs them: {job.parts.stack.label}", highlight=False)
    out.print(replica_table(plan, ev, cluster, "replica groups"))
    out.print(stage_table(plan, ev))
    return 0


def _uniform_only(args: argparse.Namespace) -> list[str]:
    """The flags given that steer the search of one device type, which a mixed cluster's search has no
    counterpart for."""
    given = {"--top": args.top != 5, "--same-mesh": args.same_mesh, "--no-recompute": args.no_recompute,
             "--mode": args.mode != "auto",
             "--pipeline-schedules": args.pipeline_schedules != ",".join(PIPELINE_SCHEDULES)}
    return given_flags(given)


def run_mixed(args: argparse.Namespace, cluster: MixedCluster) -> int:
    """Search a plan of replica groups on a mixed cluster, rank it beside its baselines (and --against
    a plan file), print (or --json) and --out it; with --lengths, all by their expected steps."""
    _no_profiles(args)
    given = _uniform_only(args)
    if given:
        raise PlanError(f"{given[0]} steers the search of one device type; a mixed cluster's search chooses its "
                        "groups' layouts itself (each type's own group is searched in full): drop it")
    if args.tasks is not None:
        raise PlanError("--tasks plans LoRA adapters on one device type; a mixed cluster's search prices training "
                        "every weight: drop --tasks, or plan the tasks on one device type's cluster")
    model = parse_model(args.model or DEFAULT_MODEL)
    work = workload(args.seq_len, args.global_batch, args.tokens_per_batch, args.lengths, cluster.world_size,
                    mixed=True)
    job = build_job(model, work.seq_len, work.global_batch, cluster=cluster,
                    parts=_parts(args, model, cluster.world_size))
    costs = job.costs
    assert costs is not None
    plans: BaselinePlans = {}
    result, baselines, baseline_seconds = _search_mixed(job, cluster, costs, args.json, plans)
    plan, ev, e = result.plan, result.evaluation, None
    if work.lengths:
        plan, ev, e = score_mixed(result, model, costs, work)
        score_baselines(baselines, plans, model, costs, work)
    if args.against:  # a plan file of this cluster, priced by the same cost model, beside the baselines
        other = load_plan(args.against)
        theirs = check_groups(other, model, cluster, costs)
        baselines["against"] = {"layout": other.layout.split("\n"), "step_time_s": theirs.step_time,
                                "tokens_per_s": theirs.tokens_per_s, "plan": args.against}
        if work.lengths:
            score_baselines(baselines, {"against": [(other, cluster)]}, model, costs, work)
    step, tokens_per_s = (e.step_time, e.tokens_per_s) if e is not None else (ev.step_time, ev.tokens_per_s)
    plan = recorded(plan, args.model)
    if args.out:
        plan.save(args.out)
    found = _recommended(plan, job, work, args.recommend)
    if args.json:
        best: dict = {"layout": plan.layout.split("\n"), "step_time_s": step, "tokens_per_s": tokens_per_s}
        if e is not None:
            best.update(policy=e.policy, fixed_length_step_time_s=ev.step_time,
                        fixed_length_tokens_per_s=ev.tokens_per_s)
        print(json.dumps({"search_seconds": result.search_seconds, "baselines_seconds": baseline_seconds,
                          "configurations": result.configurations, "workload": work.to_dict(),
                          "best": {**best, "plan": plan.to_dict()},
                          "baselines": baselines, "ratios": ratios(tokens_per_s, baselines),
                          "recommendation": _recommended_json(found),
                          "recommendation_seconds": found.seconds}, indent=2))
        return 0
    out = plain_console()
    slow = sum(1 for r in range(cluster.world_size) if cluster.speed(r) != 1.0)
    speeds = f" ({slow} device{'s' * (slow != 1)} off nominal speed)" if slow else ""
    figures = (f"expected step {step:.3f} s, {tokens_per_s:,.0f} tokens/s (step {ev.step_time:.3f} s at --seq-len)"
               if e is not None else f"step {step:.3f} s, {tokens_per_s:,.0f} tokens/s")
    out.print(replica_table(plan, ev, cluster,
                            f"plan on {cluster.label}{speeds}: {figures} ({result.configurations} configurations; "
                            f"search {result.search_seconds:.2f} s, baselines {baseline_seconds:.2f} s)"))
    out.print(baseline_table(tokens_per_s, baselines))
    out.print(work.describe(), highlight=False)
    if moved := work.factoring():
        out.print(moved, highlight=False)
    _print_recommended(out, found)
    if args.explain:
        out.print(stage_table(plan, ev))
    if args.out:
        out.print(f"wrote the plan to {args.out}", highlight=False)
    _print_phases(out, args.started, search=result.search_seconds, baselines=baseline_seconds,
                  recommendation=found.seconds)
    return 0


def _search_mixed(job: Job, cluster: MixedCluster, costs: MixedCosts, quiet: bool,
                  plans: BaselinePlans) -> tuple[MixedResult, dict, float]:
    """The mixed search's plan, its baselines (each device type's uniform search shared with the plans
    of one group per type; ``plans`` receives theirs) and the seconds the baselines took after the search."""
    model, seq, gb = job.model, job.seq_len, job.global_batch
    search = MixedSearch(model, cluster, seq, gb, costs)
    if quiet:
        result = search.run()
        t1 = time.perf_counter()
        baselines = mixed_baselines(model, cluster, seq, gb, costs, alone=search.types.planned_alone, plans=plans)
        return result, baselines, time.perf_counter() - t1
    t0 = time.perf_counter()
    state: dict = {}

    def bar(label: str, done: int, total: int) -> None:
        if "bar" not in state and time.perf_counter() - t0 > PROGRESS_AFTER_S:
            state["bar"] = Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                    console=plain_console(stderr=True), transient=True)
            state["bar"].start()
            state["task"] = state["bar"].add_task(label, total=total)
        if "bar" in state:
            state["bar"].update(state["task"], description=label, completed=done, total=total)

    names = ["uniform", "proportional", "sum_of_parts"]
    try:
        result = search.run(progress=lambda d, t: bar("searching", d, t))
        t1 = time.perf_counter()
        baselines = mixed_baselines(model, cluster, seq, gb, costs, alone=search.types.planned_alone, plans=plans,
                                    progress=lambda name: bar(f"baseline {name}", names.index(name), len(names)))
    finally:
        if "bar" in state:
            state["bar"].stop()
    return result, baselines, time.perf_counter() - t1
