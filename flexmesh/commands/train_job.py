"""``flexmesh train``'s job: its flags and its plan resolved once into a :class:`~flexmesh.job.Job` (the
sequence cap, the batch, the tasks, the experts' placement, the dtype, and the cost model its step
schedules are priced by), and the step scheduler of a policy priced by it."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from flexmesh.commands.experts_args import check_lsh, experts_of
from flexmesh.commands.train_args import run_dtype
from flexmesh.commands.train_tasks import run_tasks
from flexmesh.cost.training.model import CostModel
from flexmesh.cost.training.parts import Parts
from flexmesh.errors import PlanError, SpecError
from flexmesh.job import Job, build_job, plan_sizes
from flexmesh.layout.plan import Plan
from flexmesh.schedule.scheduler import Scheduler
from flexmesh.spec.cluster import ClusterSpec, parse_cluster
from flexmesh.spec.model import ModelSpec


def train_job(args: argparse.Namespace, plan: Plan, spec: ModelSpec) -> Job:
    """The run the flags describe on ``plan`` and model ``spec``: the sequence cap (--seq-len, else the
    plan's), the batch (--global-batch, else the plan's; with --tasks every task's batch together, and a
    plan of several groups its shares scaled to it), the tasks, the experts' placement, the dtype, and the
    cost model that prices its step schedules (:func:`_pricing`)."""
    tasks = run_tasks(args.tasks, args.corpus or getattr(args, "domains", None), spec)
    per_step = getattr(args, "tokens_per_step", None)
    if per_step is not None and (tasks is not None or len(plan.groups) > 1):
        raise PlanError("--tokens-per-step varies the documents per step, but "
                        + ("each LoRA task takes its own batch" if tasks is not None else
                           "a plan of replica groups gives each group a fixed share of the documents")
                        + "; give --global-batch")
    seq_len, requested = plan_sizes(plan, args.seq_len, args.global_batch)
    if per_step is not None:  # priced as the --seq-len documents that many tokens hold
        requested = max(1, per_step // seq_len)
    global_batch = sum(tasks.batches(requested)) if tasks is not None else requested
    if len(plan.groups) > 1:  # the groups' shares must add up to the batch the run takes
        plan = plan.with_global_batch(global_batch)
    # LoRA: a frozen base and the tasks' adapters; a mixture of experts priced for the placement the run uses
    parts = Parts(tasks=tasks)
    check_lsh(args, spec)
    if spec.is_moe:
        parts = replace(parts, experts=experts_of(spec, plan.world_size, args.expert_placement,
                                                  args.expert_imbalance, args.routing, args.expert_slots,
                                                  args.expert_lsh))
    return build_job(spec, seq_len, global_batch, base=_pricing(args, plan, spec), parts=parts,
                     dtype=run_dtype(args), plan=plan, tokens_per_batch=per_step)


def _pricing(args: argparse.Namespace, plan: Plan, spec: ModelSpec) -> CostModel | None:
    """The cost model the run's step schedules are priced by, in the dtype the run computes in: the
    machine's saved profiles for a plan made for them, --hardware-profile/--model-profile, else the
    plan's cluster preset for a plan of one group on one device type; None: each device group's presets
    (the scheduler's own, flexmesh.schedule.scheduler.plan_costs), or unpriced where they price nothing."""
    from flexmesh.profile.use import cost_model_from_profiles, local_cost_model
    from flexmesh.schedule.scheduler import device_types

    spec = replace(spec, dtype=run_dtype(args))
    local = local_cost_model(spec, plan.cluster, args.hardware_profile, args.model_profile)
    if local is not None:  # the plan was made for this machine's saved profiles
        return local
    if args.hardware_profile or args.model_profile:
        cluster = None if args.hardware_profile else _plan_cluster(plan, args.plan)
        return cost_model_from_profiles(spec, hardware=args.hardware_profile, model=args.model_profile,
                                        world=plan.world_size, cluster=cluster)
    if len(plan.groups) == 1 and device_types(plan) in (None, 1):  # a mixed cluster: priced per device type
        return CostModel(spec, _plan_cluster(plan, args.plan))
    return None


def scheduler(job: Job, policy: str, seed: int, cp: int | None) -> Scheduler:
    """The run's step scheduler for ``policy``, its schedules priced by the step simulator on the job's
    cost model, else each device group's presets with the job's parts (``shares`` on a cluster that prices
    nothing runs unpriced)."""
    from flexmesh.errors import ScheduleError
    from flexmesh.sim.predict import simulated_scheduler

    assert job.plan is not None
    try:
        return simulated_scheduler(Scheduler(job.plan, replace(job.model, dtype=job.dtype), policy, job.seq_len, seed,
                                             cp=cp, cost=job.cost, parts=job.parts))
    except ScheduleError as e:
        raise PlanError(f"--policy {policy}: {e}") from None


RECOMMEND_STEPS = 8  # the run's first batches the simulator compares the policies on


def choose_policy(job: Job, batches: Sequence[np.ndarray], speeds: Sequence[float] = (),
                   seed: int = 0) -> tuple[str, str | None]:
    """The policy a run takes without ``--policy``, and one line saying which and why (None: nothing to say).

    One replica group: ``fixed``, the plan's own schedule. Several: the policy the simulator recommends
    for this plan on ``batches`` (the lengths of the run's first steps), computed as ``simulate --plan``
    computes it (flexmesh.sim.groups.recommend_dispatch: ``shares`` against ``dispatch+P`` for each of
    its ``RECOMMENDED_AMONG``, priced as the run's schedules are), ``speeds`` one factor per device
    (``--slow``'s emulation); ``shares``, the planned shares, where it cannot be computed, saying why."""
    from flexmesh.errors import FlexmeshError
    from flexmesh.schedule.groups import groups_context
    from flexmesh.schedule.scheduler import plan_costs
    from flexmesh.sim.groups import device_speeds, recommend_dispatch

    plan = job.plan
    assert plan is not None
    if len(plan.groups) == 1:
        return "fixed", None
    spec = replace(job.model, dtype=job.dtype)
    try:
        if not batches:
            raise PlanError("the run has no batch to compare them on")
        gctx = device_speeds(groups_context(plan, spec, plan_costs(plan, spec, job.cost, job.parts)), plan, speeds)
        rec = recommend_dispatch(gctx, batches, seed=seed, virtual_stages=[g.virtual_stages for g in plan.groups])
    except FlexmeshError as e:
        return "shares", (f"policy shares (each replica group its planned share): the simulator's recommendation "
                          f"cannot be computed here ({e}); --policy chooses another")
    where = f"on this run's first {len(batches)} batch{'es' * (len(batches) != 1)}"
    if rec.policy == rec.against:
        return rec.policy, f"policy {rec.policy} (each replica group its planned share), as the simulator " \
                           f"recommends {where}: {rec.why}; --policy chooses another"
    return rec.policy, (f"policy {rec.policy} ({rec.schedule}), as the simulator recommends {where}: "
                        f"{rec.speedup:.2f}x the tokens/s of --policy {rec.against}; why, {rec.why}; --policy "
                        "chooses another")


def _plan_cluster(plan: Plan, path: str) -> ClusterSpec:
    """Without a hardware profile the plan's cluster prices the step schedules: it must name a device
    preset or a cluster file; say what to pass when it does not."""
    try:
        return parse_cluster(plan.cluster)
    except SpecError as e:
        raise PlanError(f"plan {path} records cluster {plan.cluster!r}, which prices nothing ({e}); pass "
                        "--hardware-profile FILE (from `flexmesh profile hardware`), or set the plan's cluster to "
                        "a preset such as 4xA100-80GB or a cluster file") from None


def estimated_peak(job: Job) -> float | None:
    """The largest per-rank peak (GiB) the cost model computes for the job's plan on its model, with
    its parts (adapters, experts) and dtype: what ``flexmesh plan --check`` prints, computed again,
    never the figure the plan file records (a hand-written or edited plan is priced as any other).
    Priced on the job's cost model, else on each device group's presets of the plan's cluster; None
    where nothing prices the plan (a cluster with no presets, not checked).

    >>> from flexmesh.job import build_job
    >>> from flexmesh.cost import CostModel
    >>> from flexmesh.layout.plan import Plan, StagePlan
    >>> from flexmesh.layout.strategy import LayerStrategy
    >>> from flexmesh.spec.model import parse_model
    >>> from flexmesh.spec.cluster import parse_cluster
    >>> spec, s = parse_model("llama2-70b"), LayerStrategy.parse("tp1-dp2z0")
    >>> plan = Plan.uniform(model="llama2-70b", cluster="2xA100-80GB", world_size=2, pp=1, pipeline_schedule="1f1b",
    ...                     num_microbatches=1, seq_len=128, global_batch=2, stages=(StagePlan(0, 80, (s,) * 80),),
    ...                     predicted={"peak_memory_gib": [0.5]})  # a recorded figure far too small
    >>> job = build_job(spec, 128, 2, base=CostModel(spec, parse_cluster("2xA100-80GB")), plan=plan)
    >>> estimated_peak(job) > 1000  # weights, gradients and AdamW states of 70 B parameters on each rank
    True
    """
    from flexmesh.errors import FlexmeshError
    from flexmesh.units import GIB

    plan = job.plan
    assert plan is not None
    if job.cost is not None and len(plan.groups) == 1:
        return max(m["total"] for m in job.cost.evaluate(plan).memory) / GIB
    from flexmesh.cost.training.mixed import evaluate_groups
    from flexmesh.schedule.scheduler import plan_costs

    try:
        costs = job.costs or plan_costs(plan, job.model, job.cost, job.parts)
        return max(r.peak_memory for r in evaluate_groups(plan, costs).replicas) / GIB
    except FlexmeshError:  # e.g. a cluster whose devices have no presets
        return None
