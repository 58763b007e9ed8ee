"""A plan's step scheduler: one policy over the plan's data ranks, called once per global batch.

:class:`Scheduler` is what the training loop (flexmesh.runtime.train.adaptive.AdaptiveSource) calls with
each batch's sequence lengths. It builds the :class:`~flexmesh.schedule.context.ScheduleContext`
once from the plan (:func:`schedule_context`) and runs the policy through
:func:`flexmesh.schedule.registry.make_schedule`. The step simulator lives above this package, so a
simulated ``predicted_step_time`` comes in as a ``predict`` callable
(flexmesh.sim.predict.simulated_scheduler attaches one).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from typing import Callable

from numpy.typing import ArrayLike

from flexmesh.cost import CostModel
from flexmesh.cost.training.mixed import MixedCosts
from flexmesh.cost.training.parts import Parts
from flexmesh.errors import ScheduleError
from flexmesh.layout.enums import Policy
from flexmesh.layout.mesh import group_layout
from flexmesh.layout.plan import Plan, ReplicaGroup
from flexmesh.layout.step import StepSchedule
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.groups import GroupsContext, dispatched_schedule, group_context, groups_context, split_shares
from flexmesh.schedule.registry import POLICIES, make_schedule
from flexmesh.spec.cluster import parse_cluster
from flexmesh.spec.model import ModelSpec

Predict = Callable[[StepSchedule], float]


def schedule_context(plan: Plan, spec: ModelSpec, max_len: int, cost: CostModel | None = None,
                     parts: Parts | None = None) -> ScheduleContext:
    """:func:`group_context` of a plan of one replica group; ``cost`` defaults to the plan's cluster
    preset for the job's ``parts``. ``max_len`` (the documents' length) does not bound the micro-batches."""
    cost = cost if cost is not None else CostModel(spec, parse_cluster(plan.cluster), parts=parts)
    return group_context(plan, plan.group, spec, cost)


def plan_costs(plan: Plan, spec: ModelSpec, cost: CostModel | None = None, parts: Parts | None = None) -> MixedCosts:
    """One cost model per device group of the plan's cluster: ``cost`` (a profile, one device type) for
    a cluster of one device type, else the cluster's presets for the job's ``parts`` (LoRA adapters,
    experts; default: full training). With ``cost``, the plan's cluster (where it parses) still says
    which devices run slower (its ``speed_factors``). ScheduleError where the cluster names no presets
    or a profile would price another device type."""
    from flexmesh.errors import SpecError
    from flexmesh.spec.cluster import MixedCluster, parse_mixed_cluster

    if cost is not None:
        try:
            mixed = parse_mixed_cluster(plan.cluster)
        except SpecError:
            mixed = None
        if mixed is not None and len(mixed.groups) > 1:
            raise ScheduleError(f"a profile measures one device type, but the plan's cluster {plan.cluster!r} mixes "
                                f"{len(mixed.groups)}; price it with the cluster's presets (drop the profiles)")
        cluster = cost.cluster
        if mixed is not None and mixed.world_size == cluster.world_size:
            cluster = replace(cluster, speed_factors=mixed.groups[0].speed_factors)
        return MixedCosts(spec, MixedCluster((cluster,)), groups=[cost])
    try:
        mixed = parse_mixed_cluster(plan.cluster)
    except SpecError as e:
        raise ScheduleError(f"the plan's cluster {plan.cluster!r} prices nothing ({e}); set the plan's cluster to "
                            "presets such as 1x8xH100+1x8xA100-40GB or a cluster file, or pass profiles") from None
    if mixed.world_size != plan.world_size:
        raise ScheduleError(f"the plan's cluster {plan.cluster!r} has {mixed.world_size} devices but the plan "
                            f"{plan.world_size}; re-plan or fix the plan's cluster")
    return MixedCosts(spec, mixed, parts=parts)


class Scheduler:
    """``lengths -> StepSchedule`` for the named policy over the plan's data ranks.

    One replica group: the policy over its data ranks. Groups may take any power-of-two size the
    policy picks (``hdp``, ``milp``); the baselines (``fixed``, ``padded``, ``balanced``, ``wlb``) use
    one static size: ``cp``, else the plan's cp when above 1, else the smallest group holding the
    longest sequence. Micro-batches hold at most the plan's ``microbatch_tokens`` per rank (a longer
    sequence keeps its own); ``padded`` pads each sequence to ``max_len``, the documents' length.

    Several replica groups (flexmesh.schedule.groups): ``shares`` gives each group its planned share
    of the batch in order, blind to lengths; any other policy dispatches each step's sequences over
    the groups by predicted time under each group's memory, then runs inside each group as above.
    ``shares`` needs no cost model; every other policy is priced by the plan's cluster for the job's
    ``parts`` (``cost``: a profile of a one-type cluster instead, flexmesh.schedule.scheduler.plan_costs).

    ``predict``, when given, replaces each step schedule's ``predicted_step_time`` (the scheduler's
    own estimate of the micro-batch phase) with its value: the runtime passes the step simulator's
    (flexmesh.sim.predict.simulated_scheduler) and reports it beside the measured time.
    ``policy`` and ``groups`` (the GroupsContext; ``context``: its one context, with one group) are
    attributes.

    >>> from flexmesh.layout.plan import Plan, StagePlan
    >>> from flexmesh.layout.strategy import LayerStrategy
    >>> from flexmesh.spec.model import parse_model
    >>> spec = parse_model("llama2-7b")
    >>> st = StagePlan(0, 32, (LayerStrategy.parse("tp1-dp8z3"),) * 32)
    >>> plan = Plan.uniform("llama2-7b", "8xA100-80GB", 8, 1, "1f1b", 1, 4096, 8, (st,))
    >>> fn = Scheduler(plan, spec, "hdp", 16384)
    >>> [g.cp for g in fn([12000] + [400] * 6 + [2000] * 8).groups]  # 12000 tokens need 2+ ranks
    [8]
    """

    def __init__(self, plan: Plan, spec: ModelSpec, policy: Policy | str, max_len: int, seed: int = 0, *,
                 cost: CostModel | None = None, cp: int | None = None, predict: Predict | None = None,
                 parts: Parts | None = None) -> None:
        if policy not in POLICIES and policy != Policy.SHARES:  # fail here, not at the first step
            raise ScheduleError(f"unknown scheduling policy {policy!r}; choose one of "
                                f"{', '.join([*POLICIES, Policy.SHARES])}")
        self.policy = Policy(policy)
        if self.policy == Policy.SHARES and len(plan.groups) == 1:
            raise ScheduleError("policy shares gives each replica group its planned share of the batch, but this "
                                "plan has one group; choose fixed (or another policy)")
        self.seed = seed
        self.virtual_stages = tuple(g.virtual_stages for g in plan.groups)
        self.predict = predict
        self.shares = (tuple(g.share for g in plan.groups), tuple(g.num_microbatches for g in plan.groups),
                       tuple(g.data_ranks for g in plan.groups))
        self.groups: GroupsContext | None = None  # None: fixed shares on a cluster that prices nothing
        if len(plan.groups) == 1 and (cost is not None or device_types(plan) in (None, 1)):
            ctx = schedule_context(plan, spec, max_len, cost, parts)
            self.groups = GroupsContext((ctx,), (plan.global_batch,), (plan.num_microbatches,))
        elif self.policy != Policy.SHARES or cost is not None or device_types(plan) is not None:
            # several groups, or one group whose pipeline spans device types: priced group by group
            self.groups = groups_context(plan, spec, plan_costs(plan, spec, cost, parts))
        self.options = [self._options(g, max_len, cp) for g in plan.groups]

    def _options(self, group: ReplicaGroup, max_len: int, cp: int | None) -> dict:
        options: dict = {}
        if self.policy.is_baseline:
            layout = group_layout(group)
            static = cp if cp is not None else (layout.cp if layout.cp > 1 else None)
            if static is not None and static > layout.data_ranks:
                raise ScheduleError(f"a static context-parallel group of {static} ranks does not fit a replica group "
                                    f"of {layout.data_ranks} data ranks; give --cp at most {layout.data_ranks}")
            if static is not None:
                options["cp"] = static
        if self.policy == Policy.PADDED:
            options["context"] = max_len
        if self.policy == Policy.WLB:
            # The loader trains the documents a schedule names and never brings deferred ones back
            # (the next batch is scheduled ahead, before this one's deferrals are known), so a held
            # outlier would be dropped: the runtime runs wlb's packing without the delay.
            options["queue"] = 0
        return options

    @property
    def context(self) -> ScheduleContext:
        """The one group's scheduling context (a plan of one replica group)."""
        if self.groups is None or len(self.groups.contexts) != 1:
            raise ScheduleError("this scheduler serves several replica groups (or prices nothing); ask its groups")
        return self.groups.contexts[0]

    def __call__(self, lengths: ArrayLike) -> StepSchedule:
        """The step schedule of one global batch of sequences of these lengths.

        With speed factors it records them as ``extra["speed"]`` (the runtime measures speeds
        against them, flexmesh.runtime.train.stragglers).
        """
        gctx = self.groups  # read once: set_speed may swap it from another thread
        if self.policy == Policy.SHARES or gctx is None:
            schedule = split_shares(lengths, *self.shares)
        elif len(gctx.contexts) == 1:
            schedule = make_schedule(self.policy, lengths, gctx.contexts[0], seed=self.seed, **self.options[0])
        else:
            schedule = dispatched_schedule(self.policy, lengths, gctx, seed=self.seed, options=self.options)
        if gctx is not None and gctx.speed:
            schedule = replace(schedule, extra={**schedule.extra, "speed": list(gctx.speed)})
        if self.predict is None:
            return schedule
        return replace(schedule, predicted_step_time=self.predict(schedule))

    def set_speed(self, speed: Sequence[float]) -> None:
        """Schedule from now on for these speed factors, one per data rank (1.0 = nominal); a
        ``predict`` that reads ``self.groups`` (flexmesh.sim.predict.simulated_scheduler) follows."""
        if self.groups is not None:
            self.groups = self.groups.with_speed(tuple(float(x) for x in speed))

    def with_speed(self, speed: Sequence[float]) -> Scheduler:
        """A copy scheduling for these speed factors (this one unchanged); it predicts with this one's
        ``predict``, which prices by this scheduler's context."""
        other = copy.copy(self)
        Scheduler.set_speed(other, speed)
        return other

    def with_predict(self, predict: Predict | None) -> Scheduler:
        """The same scheduler (sharing its context) with ``predict`` in place of the current one."""
        other = copy.copy(self)
        other.predict = predict
        return other

    def __repr__(self) -> str:
        return (f"Scheduler(policy={str(self.policy)!r}, num_ranks={sum(self.shares[2])}, "
                f"groups={len(self.shares[0])}, options={self.options}, seed={self.seed})")


def device_types(plan: Plan) -> int | None:
    """How many device types the plan's cluster has (None: it names no presets or has another size)."""
    from flexmesh.errors import SpecError
    from flexmesh.spec.cluster import parse_mixed_cluster

    try:
        mixed = parse_mixed_cluster(plan.cluster)
    except SpecError:
        return None
    return len(mixed.groups) if mixed.world_size == plan.world_size else None
