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
from typing import Callable

from flexmesh.layout.step import StepSchedule
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.scheduler import Scheduler
from flexmesh.sim.timeline import simulate_step


def step_time_predictor(ctx: ScheduleContext, *, virtual_stages: int = 1) -> Callable[[StepSchedule], float]:
    """``schedule -> simulated step time`` (s) on ``ctx``: a Scheduler's ``predict``."""

    def predict(schedule: StepSchedule) -> float:
        return simulate_step(ctx, schedule, virtual_stages=virtual_stages).step_time

    return predict


def simulated_scheduler(scheduler: Scheduler) -> Scheduler:
    """``scheduler`` whose step schedules carry the simulated step time (on its own context and its
    plan's virtual stages) as ``predicted_step_time``; the context is read at each call, so the
    prediction follows :meth:`~flexmesh.schedule.scheduler.Scheduler.set_speed`."""
    out = scheduler.with_predict(None)

    def predict(schedule: StepSchedule) -> float:
        return simulate_step(out.context, schedule, virtual_stages=out.virtual_stages).step_time

    out.predict = predict
    return out


def step_time_at_speed(scheduler: Scheduler) -> Callable[[StepSchedule, Sequence[float]], float]:
    """``(schedule, speed per data rank) -> simulated step time`` (s) on ``scheduler``'s current
    context: how the runtime prices a schedule at measured speeds (flexmesh.runtime.stragglers)."""

    def price(schedule: StepSchedule, speed: Sequence[float]) -> float:
        return simulate_step(scheduler.context, schedule, virtual_stages=scheduler.virtual_stages,
                             speed=list(speed)).step_time

    return price
