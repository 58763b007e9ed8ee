"""A plan's step scheduler: one policy over the plan's data ranks, called once per global batch.

:class:`Scheduler` is what the training loop (flexmesh.runtime.adaptive.AdaptiveSource) calls with
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
from flexmesh.errors import ScheduleError
from flexmesh.layout.enums import CPKind, Policy
from flexmesh.layout.mesh import context_kind, layout_from_plan, runs_in_lockstep
from flexmesh.layout.plan import Plan
from flexmesh.layout.step import StepSchedule, carries_pieces
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.registry import POLICIES, make_schedule
from flexmesh.spec.cluster import parse_cluster
from flexmesh.spec.model import ModelSpec

Predict = Callable[[StepSchedule], float]


def schedule_context(plan: Plan, spec: ModelSpec, max_len: int, cost: CostModel | None = None) -> ScheduleContext:
    """The per-step scheduler's view of ``plan``: its data ranks, pipeline and first layer's strategy.

    The group size (cp) and data-parallel degree are left to the policy; micro-batches hold at most
    the plan's :attr:`~flexmesh.layout.plan.Plan.microbatch_tokens` per rank (what the search sized
    and checked against memory), whatever the documents' length ``max_len`` (a longer document
    keeps its own micro-batch). ``cost`` defaults to the plan's cluster preset; either prices the
    plan's overlap options (:meth:`CostModel.with_step_overlap`). Policies cut sequences over
    micro-batches only where the runtime keeps them exact (``cut_documents``).
    """
    layout = layout_from_plan(plan)
    strategy = replace(plan.layer_strategies()[0], cp=1, cp_kind=CPKind.NONE, dp=1)
    cost = cost if cost is not None else CostModel(spec, parse_cluster(plan.cluster))
    return ScheduleContext(cost=cost.with_step_overlap(plan.overlap),
                           base=strategy, num_ranks=layout.data_ranks, pp=plan.pp,
                           pipeline_schedule=plan.pipeline_schedule, cp_kind=context_kind(spec, layout),
                           microbatch_tokens=plan.microbatch_tokens,
                           lockstep=runs_in_lockstep(layout.pp, layout.zero),
                           cut_documents=carries_pieces(plan.pp, dynamic_rope=spec.rope_scaling is not None
                                                        and spec.rope_scaling.rope_type == "dynamic"))


class Scheduler:
    """``lengths -> StepSchedule`` for the named policy over the plan's data ranks.

    Groups may take any power-of-two size the policy picks (``hdp``, ``milp``); the baselines
    (``fixed``, ``padded``, ``balanced``, ``wlb``) use one static size: ``cp``, else the plan's cp when
    above 1, else the smallest group holding the longest sequence. Micro-batches hold at most the
    plan's ``microbatch_tokens`` per rank (a longer sequence keeps its own); ``padded`` pads each
    sequence to ``max_len``, the documents' length. ``cost`` is the CostModel the policy consults
    (for instance one built from profiles); default: the plan's cluster preset.
    ``predict``, when given, replaces each step schedule's ``predicted_step_time`` (the scheduler's
    own estimate of the micro-batch phase) with its value: the runtime passes the step simulator's
    (flexmesh.sim.predict.simulated_scheduler) and reports it beside the measured time.
    ``policy`` and ``context`` (the ScheduleContext) are attributes.

    >>> from flexmesh.layout.plan import Plan, StagePlan
    >>> from flexmesh.layout.strategy import LayerStrategy
    >>> from flexmesh.spec.model import parse_model
    >>> spec = parse_model("llama2-7b")
    >>> st = StagePlan(0, 32, (LayerStrategy.parse("tp1-dp8z3"),) * 32)
    >>> plan = Plan("llama2-7b", "8xA100-80GB", 8, 1, "1f1b", 1, 4096, 8, (st,))
    >>> fn = Scheduler(plan, spec, "hdp", 16384)
    >>> [g.cp for g in fn([12000] + [400] * 6 + [2000] * 8).groups]  # 12000 tokens need 2+ ranks
    [4, 1, 1, 1, 1]
    """

    def __init__(self, plan: Plan, spec: ModelSpec, policy: Policy | str, max_len: int, seed: int = 0, *,
                 cost: CostModel | None = None, cp: int | None = None, predict: Predict | None = None) -> None:
        if policy not in POLICIES:  # fail here, not at the first step
            raise ScheduleError(f"unknown scheduling policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.policy = Policy(policy)
        self.context = schedule_context(plan, spec, max_len, cost)
        self.seed = seed
        self.virtual_stages = plan.virtual_stages
        self.predict = predict
        options: dict = {}
        if self.policy.is_baseline:
            layout = layout_from_plan(plan)
            static = cp if cp is not None else (layout.cp if layout.cp > 1 else None)
            if static is not None:
                options["cp"] = static
        if self.policy == Policy.PADDED:
            options["context"] = max_len
        if self.policy == Policy.WLB:
            # The loader trains the documents a schedule names and never brings deferred ones back
            # (the next batch is scheduled ahead, before this one's deferrals are known), so a held
            # outlier would be dropped: the runtime runs wlb's packing without the delay.
            options["queue"] = 0
        self.options = options

    def __call__(self, lengths: ArrayLike) -> StepSchedule:
        """The step schedule of one global batch of sequences of these lengths.

        With speed factors it records them as ``extra["speed"]`` (the runtime measures speeds
        against them, flexmesh.runtime.stragglers).
        """
        ctx = self.context  # read once: set_speed may swap it from another thread
        schedule = make_schedule(self.policy, lengths, ctx, seed=self.seed, **self.options)
        if ctx.speed:
            schedule = replace(schedule, extra={**schedule.extra, "speed": list(ctx.speed)})
        if self.predict is None:
            return schedule
        return replace(schedule, predicted_step_time=self.predict(schedule))

    def set_speed(self, speed: Sequence[float]) -> None:
        """Schedule from now on for these speed factors, one per data rank (1.0 = nominal); a
        ``predict`` that reads ``self.context`` (flexmesh.sim.predict.simulated_scheduler) follows."""
        speed = tuple(float(x) for x in speed)
        self.context = replace(self.context, speed=() if all(x == 1.0 for x in speed) else speed, _cache={})

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
        return (f"Scheduler(policy={str(self.policy)!r}, num_ranks={self.context.num_ranks}, "
                f"options={self.options}, seed={self.seed})")
