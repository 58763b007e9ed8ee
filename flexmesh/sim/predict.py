"""The step simulator as a step scheduler's prediction: simulated step time instead of the estimate.

A :class:`~flexmesh.schedule.scheduler.Scheduler` prices its step schedules itself (the micro-batch
phase only, by the cost model); the runtime reports the simulator's step time instead, which adds
the pipeline's order of events, the gradient sync and the optimizer. The scheduling package sits
below the simulator, so the prediction comes in from here as the Scheduler's ``predict``.

>>> from flexmesh.schedule.registry import make_schedule
>>> from flexmesh.schedule.testing import tiny_context
>>> ctx = tiny_context(num_ranks=4)
>>> s = make_schedule("hdp", [900, 50, 60, 3000], ctx)
>>> step_time_predictor(ctx)(s) > s.predicted_step_time  # the simulated step adds sync and optimizer
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Callable

from flexmesh.errors import ScheduleError
from flexmesh.layout.step import Group, StepSchedule
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.groups import GroupsContext
from flexmesh.schedule.scheduler import Scheduler
from flexmesh.sim.timeline import simulate_step


def step_time_predictor(ctx: ScheduleContext, *, virtual_stages: int = 1) -> Callable[[StepSchedule], float]:
    """``schedule -> simulated step time`` (s) on ``ctx``: a Scheduler's ``predict``."""

    def predict(schedule: StepSchedule) -> float:
        return simulate_step(ctx, schedule, virtual_stages=virtual_stages).step_time

    return predict


def simulated_price(virtual_stages: int = 1) -> Callable[[ScheduleContext, StepSchedule], float]:
    """``(ctx, schedule) -> simulated step time``: a context's ``price``, by which a policy weighing
    candidates of one step (``chunked``) chooses as the simulator will judge."""

    def price(ctx: ScheduleContext, schedule: StepSchedule) -> float:
        return simulate_step(ctx, schedule, virtual_stages=virtual_stages).step_time

    return price


def simulated_scheduler(scheduler: Scheduler) -> Scheduler:
    """``scheduler`` whose step schedules carry the simulated step time (on its own contexts and its
    plan's virtual stages) as ``predicted_step_time``, and whose contexts price candidates by it; the
    contexts are read at each call, so the prediction follows
    :meth:`~flexmesh.schedule.scheduler.Scheduler.set_speed`. A scheduler that prices nothing (fixed
    shares on an unpriced cluster) is returned as it is."""
    groups = scheduler.groups
    if groups is None:
        return scheduler
    out = scheduler.with_predict(None)
    out.groups = replace(groups, contexts=tuple(
        replace(c, price=simulated_price(v)) for c, v in zip(groups.contexts, scheduler.virtual_stages)))

    def predict(schedule: StepSchedule) -> float:
        assert out.groups is not None  # set_speed keeps a priced scheduler priced
        return simulate_groups(out.groups, schedule, virtual_stages=out.virtual_stages)

    out.predict = predict
    return out


def step_time_at_speed(scheduler: Scheduler) -> Callable[[StepSchedule, Sequence[float]], float]:
    """``(schedule, speed per data rank) -> simulated step time`` (s) on ``scheduler``'s current
    contexts: how the runtime prices a schedule at measured speeds (flexmesh.runtime.train.stragglers)."""

    def price(schedule: StepSchedule, speed: Sequence[float]) -> float:
        if scheduler.groups is None:
            raise ScheduleError("this scheduler prices nothing (fixed shares on a cluster without presets)")
        return simulate_groups(scheduler.groups.with_speed(speed), schedule, virtual_stages=scheduler.virtual_stages)

    return price


def simulate_groups(gctx: GroupsContext, schedule: StepSchedule, *,
                    virtual_stages: Sequence[int] | None = None) -> float:
    """The simulated step of a plan of replica groups (flexmesh.schedule.groups), seconds: each group's
    part of ``schedule`` played out on its own context at its data ranks' speeds, the slowest group,
    then the exposed gradient all-reduce across groups (``gctx.cross_sync_s``). With one group, the
    simulator's step on its context.

    >>> from flexmesh.schedule.groups import dispatched_schedule, shares_schedule
    >>> from flexmesh.schedule.testing import tiny_context
    >>> ctx = [tiny_context(num_ranks=n, model="tiny") for n in (2, 1)]
    >>> g = GroupsContext(tuple(ctx), (4, 2), (2, 2)).with_speed((1.0, 1.0, 0.5))
    >>> lens = [900, 50, 60, 3000, 40, 30]
    >>> simulate_groups(g, dispatched_schedule("hdp", lens, g)) < simulate_groups(g, shares_schedule(lens, g))
    True
    """
    return groups_step(gctx, schedule, virtual_stages=virtual_stages)[0]


def groups_step(gctx: GroupsContext, schedule: StepSchedule, *,
                virtual_stages: Sequence[int] | None = None) -> tuple[float, float]:
    """(:func:`simulate_groups`' step time, its tail: the slowest group's gradient sync and optimizer
    after its micro-batches, plus the all-reduce across groups), seconds."""
    if len(gctx.contexts) == 1:
        tl = simulate_step(gctx.contexts[0], schedule, virtual_stages=virtual_stages[0] if virtual_stages else 1)
        return tl.step_time, tl.tail
    worst, tail = 0.0, 0.0
    for g, (ctx, first) in enumerate(zip(gctx.contexts, gctx.offsets)):
        own = tuple(Group(tuple(r - first for r in grp.ranks), grp.microbatches, grp.predicted_time)
                    for grp in schedule.groups if first <= grp.ranks[0] < first + ctx.num_ranks)
        if not any(grp.microbatches for grp in own):
            continue
        sub = replace(schedule, groups=own, deferred=())
        v = virtual_stages[g] if virtual_stages else 1
        tl = simulate_step(ctx, sub, virtual_stages=v)
        if tl.step_time > worst:
            worst, tail = tl.step_time, tl.tail
    return worst + gctx.cross_sync_s, tail + gctx.cross_sync_s
