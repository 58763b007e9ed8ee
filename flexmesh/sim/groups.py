"""Scheduling policies compared on a plan of several replica groups, simulated step by step.

What ``flexmesh simulate --plan`` runs for such a plan (and bench/mixed_dispatch.py). Every global
batch is scheduled three ways (flexmesh.schedule.groups), each priced by the same simulator
(:func:`flexmesh.sim.predict.simulate_groups`: each group on its own device's cost model, the slowest
group, then the exposed gradient all-reduce across groups):

- ``shares``: the plan's fixed shares, group ``g`` the next ``share_g`` sequences in ``m_g``
  micro-batches of equal sequence counts (what the runtime runs with ``--policy shares``);
- ``shares+P``: the same fixed shares, each packed inside its group by the per-step policy ``P``:
  fixed shares at their best, the strongest baseline;
- ``dispatch+P``: each step's sequences dispatched over the groups by predicted time under each
  group's memory, then packed inside each group by ``P`` (Hydraulis's two stages; what the runtime
  runs with ``--policy P``).

Ratio to the lower bound: the simulated step over :func:`flexmesh.schedule.groups.groups_lower_bound`
(the micro-batch phase no schedule beats) plus the step's tail (the slowest group's gradient sync and
optimizer, and the all-reduce across groups), as for one group (flexmesh.sim.compare). A sequence no
group's memory holds fails the step (ScheduleError, naming it).

>>> from flexmesh.schedule.groups import GroupsContext
>>> from flexmesh.schedule.testing import tiny_context
>>> two, one = tiny_context(num_ranks=2, model="tiny"), tiny_context(num_ranks=1, model="tiny")
>>> g = GroupsContext((two, one), (4, 2), (2, 2))
>>> runs = compare_groups(g.with_speed((1.0, 1.0, 0.5)), [np.array([9000, 500, 600, 3000, 400, 300])], ("balanced",))
>>> [r.name for r in runs], runs[-1].tokens_per_s > runs[0].tokens_per_s
(['shares', 'shares+balanced', 'dispatch+balanced'], True)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from flexmesh.layout.mesh import rank_place
from flexmesh.layout.plan import Plan
from flexmesh.schedule.groups import GroupsContext, dispatched_schedule, groups_lower_bound, packed_shares_schedule
from flexmesh.schedule.groups import shares_schedule as fixed_shares
from flexmesh.sim.compare import Recommendation
from flexmesh.sim.predict import groups_step


@dataclass
class GroupsRun:
    """One way of scheduling over the steps: simulated step times, their lower bounds, scheduler time."""

    name: str
    step_times: list[float]
    bounds: list[float]
    tokens: float  # real tokens of all steps
    scheduler_s: float

    @property
    def kind(self) -> str:
        return "adaptive" if self.name.startswith("dispatch") else "baseline"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / sum(self.step_times)

    @property
    def ratio_to_bound(self) -> float:
        """Mean over steps of the simulated step over its lower bound."""
        return float(np.mean(np.array(self.step_times) / np.array(self.bounds)))

    def to_dict(self) -> dict:
        return {"schedule": self.name, "kind": self.kind, "tokens_per_s": self.tokens_per_s,
                "mean_step_time_s": float(np.mean(self.step_times)), "ratio_to_lower_bound": self.ratio_to_bound,
                "scheduler_ms_per_step": 1e3 * self.scheduler_s / len(self.step_times),
                "step_times_s": list(self.step_times)}


def compare_groups(gctx: GroupsContext, batches: Sequence[np.ndarray], policies: Sequence[str], *, seed: int = 0,
                   virtual_stages: Sequence[int] | None = None,
                   on_step: Callable[[], None] | None = None) -> list[GroupsRun]:
    """``shares``, then ``shares+P`` and ``dispatch+P`` for every policy ``P`` (module doc), over ``batches``
    (``1 + 2 * len(policies)`` runs of ``len(batches)`` steps; ``on_step`` is called after each)."""
    names = ["shares", *(f"shares+{p}" for p in policies), *(f"dispatch+{p}" for p in policies)]
    phases = [groups_lower_bound(b, gctx) for b in batches]
    tokens = float(sum(int(np.sum(b)) for b in batches))
    runs = []
    for name in names:
        kind, _, policy = name.partition("+")
        times, bounds, seconds = [], [], 0.0
        for lens, phase in zip(batches, phases):
            t0 = time.perf_counter()
            if not policy:
                s = fixed_shares(lens, gctx)
            elif kind == "shares":
                s = packed_shares_schedule(policy, lens, gctx, seed=seed)
            else:
                s = dispatched_schedule(policy, lens, gctx, seed=seed)
            seconds += time.perf_counter() - t0
            s.validate(gctx.num_ranks)
            step, tail = groups_step(gctx, s, virtual_stages=virtual_stages)
            times.append(step)
            bounds.append(phase + tail)
            if on_step is not None:
                on_step()
        runs.append(GroupsRun(name, times, bounds, tokens, seconds))
    return runs


# What a plan of several groups is recommended among, and train chooses among without --policy: the
# runtime's length-aware policies whose schedulers take milliseconds a step (milp's solver may take longer
# than a step, which train's --adaptive covers)
RECOMMENDED_AMONG = ("balanced", "hdp")


def recommend_dispatch(gctx: GroupsContext, batches: Sequence[np.ndarray], *, seed: int = 0,
                       virtual_stages: Sequence[int] | None = None) -> Recommendation:
    """The recommendation for a plan of several groups on ``batches``: ``shares`` against ``dispatch+P`` for
    each of :data:`RECOMMENDED_AMONG` (:func:`compare_groups`, :func:`groups_recommendation`)."""
    return groups_recommendation(compare_groups(gctx, batches, RECOMMENDED_AMONG, seed=seed,
                                                virtual_stages=virtual_stages))


def best_baseline(runs: Sequence[GroupsRun]) -> GroupsRun:
    """The fastest fixed-share schedule: every speedup's reference."""
    return max((r for r in runs if r.kind == "baseline"), key=lambda r: r.tokens_per_s)


def groups_recommendation(runs: Sequence[GroupsRun], against: str = "shares", margin: float = 0.02) -> Recommendation:
    """The ``--policy`` to train a plan of several groups with (``dispatch+P`` is ``--policy P``), against
    the planned shares (``shares``), and why (each run's step over its lower bound): what ``train`` runs
    on such a plan without ``--policy`` (flexmesh.commands.train_job.default_policy)."""
    best = max(runs, key=lambda r: r.tokens_per_s)
    base = next(r for r in runs if r.name == against)
    gain = best.tokens_per_s / base.tokens_per_s

    def policy(r: GroupsRun) -> str:
        kind, _, inner = r.name.partition("+")
        return inner if kind == "dispatch" else against

    def flag(r: GroupsRun) -> str:
        kind, _, inner = r.name.partition("+")
        return f"--policy {policy(r)}" + (
            f" (packed by {inner} inside each group, which the runtime does not offer)" if kind != "dispatch" and inner
            else "")

    if best is base or gain <= 1 + margin:
        why = f"no schedule here is {margin:.0%} faster than the planned shares"
        return Recommendation(against, base.name, against, 1.0, why, f"recommended: {flag(base)}: {why}")
    why = (f"{against}'s step is {base.ratio_to_bound:.2f}x its lower bound (work uneven over the groups), "
           f"{best.name}'s {best.ratio_to_bound:.2f}x")
    return Recommendation(policy(best), best.name, against, gain, why,
                          f"recommended: {flag(best)} ({best.name}), {gain:.2f}x the tokens/s of --policy {against} "
                          f"(the planned shares); why, {why}")


def device_speeds(gctx: GroupsContext, plan: Plan, factors: Sequence[float]) -> GroupsContext:
    """``gctx`` with one speed factor per device of ``plan`` (``--slow``'s, flexmesh.spec.speeds.speeds_of) in
    place of the cluster's own: each data rank at its slowest device's; ``gctx`` itself for none."""
    if not factors:
        return gctx
    speed = [1.0] * gctx.num_ranks
    for rank, factor in enumerate(factors):
        place = rank_place(plan, rank)
        if place is not None:
            speed[place.data_rank] = min(speed[place.data_rank], factor)
    return gctx.with_speed(speed)
