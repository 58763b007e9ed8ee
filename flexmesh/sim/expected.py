"""A plan's expected step on a length distribution: the step simulator's mean over sampled steps.

``flexmesh plan --lengths`` ranks plans by it. Each step is scheduled by the plan's own schedule
(:func:`default_policy`: ``fixed`` packing for a plan of one replica group, what ``flexmesh train --plan``
runs by default; the planned ``shares`` for several, which train runs where no dispatch policy is
recommended, so a plan of several groups is ranked by what it guarantees) by the project's
:class:`~flexmesh.schedule.scheduler.Scheduler`, and played out by the step simulator as the
runtime predicts each step (:func:`flexmesh.sim.predict.simulated_scheduler`), on the cluster
``costs`` prices, speed factors included (each data rank at its slowest device's speed). For a plan
of several groups this is ``flexmesh simulate --plan``'s ``shares`` row on the same batches.

>>> from flexmesh.cost.training.mixed import MixedCosts
>>> from flexmesh.layout.plan import Plan, StagePlan
>>> from flexmesh.layout.strategy import LayerStrategy
>>> from flexmesh.spec import parse_model
>>> from flexmesh.spec.cluster import parse_mixed_cluster
>>> st = StagePlan(0, 4, (LayerStrategy.parse("tp1-dp2z1"),) * 4)
>>> plan = Plan.uniform("tiny", "2xA100-80GB", 2, 1, "1f1b", 2, 1024, 4, (st,))
>>> costs = MixedCosts(parse_model("tiny"), parse_mixed_cluster("2xA100-80GB"))
>>> e = expected_step(plan, parse_model("tiny"), costs, [np.array([1024, 300, 20, 700])] * 2)
>>> e.policy, e.steps, e.step_time > 0, e.tokens_per_s == 2 * 2044 / sum(e.step_times)
('fixed', 2, True, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flexmesh.cost.training.mixed import MixedCosts
from flexmesh.layout.enums import Policy
from flexmesh.layout.plan import Plan
from flexmesh.schedule.groups import groups_context
from flexmesh.schedule.scheduler import Scheduler
from flexmesh.sim.predict import simulated_scheduler
from flexmesh.spec.model import ModelSpec


@dataclass(frozen=True)
class Expected:
    """A plan's simulated steps over the sampled batches."""

    policy: str  # the per-step schedule's policy (default_policy)
    step_times: tuple[float, ...]  # simulated, s, one per batch
    tokens: int  # tokens of all the batches

    @property
    def steps(self) -> int:
        return len(self.step_times)

    @property
    def step_time(self) -> float:
        """Mean simulated step, s: the expected step."""
        return float(np.mean(self.step_times))

    @property
    def tokens_per_s(self) -> float:
        """Tokens of all steps over their simulated seconds (as flexmesh.sim.compare counts them)."""
        return self.tokens / float(np.sum(self.step_times))


def default_policy(plan: Plan) -> Policy:
    """A plan's own schedule: ``fixed`` for one group (train's default), the planned ``shares`` for several
    (train's default is the dispatch the simulator recommends, flexmesh.commands.train_job.choose_policy,
    these shares where none is faster)."""
    return Policy.FIXED if len(plan.groups) == 1 else Policy.SHARES


def expected_step(plan: Plan, spec: ModelSpec, costs: MixedCosts, batches: Sequence[np.ndarray],
                  seed: int = 0) -> Expected:
    """``plan``'s simulated step on each of ``batches`` (lengths already capped at ``plan.seq_len``;
    for a plan of several groups, ``plan.global_batch`` sequences each) under its default policy,
    priced by ``costs`` (the cluster as given: its devices, links and speed factors)."""
    policy = default_policy(plan)
    gctx = groups_context(plan, spec, costs)  # the cluster as given; speeds one per data rank
    if len(plan.groups) == 1 and len(costs.groups) == 1:  # train's one-group scheduler, on this cost model
        scheduler = Scheduler(plan, spec, policy, plan.seq_len, seed, cost=costs.groups[0])
        if any(s != 1.0 for s in gctx.speed):
            scheduler.set_speed(gctx.speed)
    else:  # the groups' contexts as the runtime builds them, on this cluster rather than the plan's label
        scheduler = Scheduler(plan, spec, policy, plan.seq_len, seed)
        scheduler.groups = gctx
    predicted = simulated_scheduler(scheduler)
    times = tuple(float(predicted(b).predicted_step_time) for b in batches)
    return Expected(str(policy), times, int(sum(int(np.sum(b)) for b in batches)))
