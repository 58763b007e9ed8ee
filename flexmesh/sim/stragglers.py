"""Simulated stragglers: a plan's steps when some devices run slow, scheduled blind or knowing it.

Three figures for the same global batches and the same true speeds (one factor per device):

- **static**: the step schedules are made as if every device ran at nominal speed (the scheduler was
  not told), then simulated with the true speeds: every data rank gets its usual share and the step
  waits for the slowest.
- **re-planned**: the scheduler is told each data rank's true speed (:attr:`ScheduleContext.speed`),
  so the per-step policy gives slower data ranks (data-parallel replicas, pipelines) smaller batch
  shares; simulated with the same true speeds.
- **capacity bound**: what the remaining speed could do if perfectly used, per step the scheduler's
  lower bound with the true speeds (:func:`flexmesh.schedule.lower_bound.lower_bound`: the batch's
  least rank-seconds of work over the sum of the data ranks' speeds, compute stretched and
  communication not, or the longest sequence on the fastest ranks if larger) plus the step's
  gradient sync and optimizer (the re-planned step's simulated tail, which no schedule avoids).

What a layout can rebalance. A data rank is ``tp`` devices computing the same micro-batch in
lockstep, on each of ``pp`` pipeline stages; per-step schedules move sequences between data ranks,
never work between the devices of one rank. So a slow device slows its whole tensor-parallel group,
and in a pipeline its stage slows the whole replica: a data rank's speed is the slowest of its
``tp * pp`` devices (:func:`flexmesh.sim.timeline.lane_speeds`, then the minimum over stages), and
the capacity bound is taken over those speeds. The speed this leaves unused (the fast peers of a
slow device) is reported as the **device bound**: the same lower bound with every data rank at the
mean speed of its devices, reachable only by a new layout (moving the slow device out of its group),
which the per-step scheduler cannot do.

>>> from flexmesh.cost import CostModel
>>> from flexmesh.spec import parse_cluster, parse_model
>>> cost = CostModel(parse_model("llama2-7b"), parse_cluster("1x8xA100-80GB"))
>>> batches = [np.full(64, 2048)]
>>> r = straggler_run(cost, batches, {3: 0.25}, tp=2)
>>> r.data_rank_speeds
(1.0, 0.25, 1.0, 1.0)
>>> r.replanned_tokens_per_s > r.static_tokens_per_s and r.replanned_tokens_per_s <= r.capacity_tokens_per_s
True
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from flexmesh.cost import CostModel
from flexmesh.errors import ScheduleError
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.lower_bound import lower_bound
from flexmesh.schedule.registry import make_schedule
from flexmesh.sim.timeline import lane_speeds, simulate_step


def device_speeds(world: int, slow: Mapping[int, float]) -> tuple[float, ...]:
    """One speed factor per device: ``slow[device]`` where given, nominal (1.0) elsewhere.

    >>> device_speeds(4, {1: 0.5})
    (1.0, 0.5, 1.0, 1.0)
    """
    bad = [d for d in slow if not 0 <= d < world]
    if bad:
        raise ScheduleError(f"devices {bad} do not exist: the cluster has devices 0..{world - 1}")
    if any(v <= 0 for v in slow.values()):
        raise ScheduleError("speed factors must be positive (1.0 = nominal speed)")
    return tuple(float(slow.get(d, 1.0)) for d in range(world))


@dataclass(frozen=True)
class StragglerRun:
    """One plan over the same batches under one set of true speeds: static, re-planned and the bounds.

    Throughputs are tokens over simulated seconds, all steps together.
    """

    device_speeds: tuple[float, ...]
    data_rank_speeds: tuple[float, ...]  # the slowest of each data rank's tp * pp devices
    tokens: int  # over all steps (every policy used here trains every token of every batch)
    static_seconds: float
    replanned_seconds: float
    capacity_seconds: float
    device_bound_seconds: float
    nominal_seconds: float  # the same schedules at nominal speed: what the cluster did before

    @property
    def static_tokens_per_s(self) -> float:
        """Schedules made for nominal speeds, run at the true speeds."""
        return self.tokens / self.static_seconds

    @property
    def replanned_tokens_per_s(self) -> float:
        """Schedules made knowing the true speeds."""
        return self.tokens / self.replanned_seconds

    @property
    def capacity_tokens_per_s(self) -> float:
        """The capacity bound: the data ranks' remaining speed perfectly used (see module doc)."""
        return self.tokens / self.capacity_seconds

    @property
    def device_bound_tokens_per_s(self) -> float:
        """Every device's remaining speed perfectly used, which only a new layout could approach."""
        return self.tokens / self.device_bound_seconds

    @property
    def nominal_tokens_per_s(self) -> float:
        """Every device at nominal speed (the re-planned policy's schedules)."""
        return self.tokens / self.nominal_seconds

    def to_dict(self) -> dict:
        """The figures and their ratios, JSON-serialisable."""
        return {"device_speeds": list(self.device_speeds), "data_rank_speeds": list(self.data_rank_speeds),
                "tokens": self.tokens, "static_tokens_per_s": self.static_tokens_per_s,
                "replanned_tokens_per_s": self.replanned_tokens_per_s,
                "capacity_tokens_per_s": self.capacity_tokens_per_s,
                "device_bound_tokens_per_s": self.device_bound_tokens_per_s,
                "nominal_tokens_per_s": self.nominal_tokens_per_s,
                "replanned_over_capacity": self.replanned_tokens_per_s / self.capacity_tokens_per_s,
                "replanned_over_static": self.replanned_tokens_per_s / self.static_tokens_per_s}


def straggler_context(cost: CostModel, *, tp: int = 1, pp: int = 1, zero: int = 3, recompute: bool = True,
                      pipeline_schedule: str = "1f1b", cp_kind: str = "ulysses", speed: Sequence[float] = (),
                      lockstep: bool | None = None, microbatch_tokens: int | None = None) -> ScheduleContext:
    """The scheduler's view of a plan (``tp``, ``pp``, ZeRO over all data ranks) on ``cost``'s cluster,
    with one speed factor per data rank (empty: nominal).

    ``lockstep`` and ``microbatch_tokens`` as in :class:`ScheduleContext`: ``lockstep=False`` with
    ``pp > 1`` and ``zero < 3`` is a plan whose pipelines run their own micro-batch counts
    (a replica group of :class:`flexmesh.layout.plan.Plan`), which a slow pipeline needs to take a smaller share.
    """
    world = cost.cluster.world_size
    if world % (tp * pp):
        raise ScheduleError(f"world size {world} is not divisible by tp {tp} x pp {pp}")
    return ScheduleContext(cost=cost, base=LayerStrategy(tp=tp, zero=zero, recompute=recompute),
                           num_ranks=world // (tp * pp), pp=pp, pipeline_schedule=pipeline_schedule,
                           cp_kind=cp_kind, speed=tuple(float(s) for s in speed), lockstep=lockstep,
                           microbatch_tokens=microbatch_tokens)


def straggler_run(cost: CostModel, batches: Sequence[np.ndarray], slow: Mapping[int, float], *, policy: str = "hdp",
                  tp: int = 1, pp: int = 1, zero: int = 3, recompute: bool = True, pipeline_schedule: str = "1f1b",
                  cp_kind: str = "ulysses", options: Mapping | None = None,
                  nominal: ScheduleContext | None = None) -> StragglerRun:
    """Static, re-planned and bounds for one plan and one set of slow devices (``{device: speed}``).

    ``policy`` must train every sequence of a batch in its step (no deferral: ``hdp``, ``balanced``,
    ``milp``, ``fixed``, ``chunked``). ``nominal``, the plan's nominal context, may be passed to share
    its caches between runs.
    """
    opts = dict(options or {})
    base = nominal or straggler_context(cost, tp=tp, pp=pp, zero=zero, recompute=recompute,
                                        pipeline_schedule=pipeline_schedule, cp_kind=cp_kind)
    if base.speed:
        raise ScheduleError("the nominal context must have no speed factors")
    dev = device_speeds(cost.cluster.world_size, slow)
    lanes = lane_speeds(replace(cost.cluster, speed_factors=dev), base.base.tp, base.pp)  # (pp, data ranks)
    rank_speed = lanes.min(axis=0)
    told = replace(base, speed=tuple(float(s) for s in rank_speed), _cache={})
    per_device = np.asarray(dev).reshape(base.pp, base.num_ranks, base.base.tp).mean(axis=(0, 2))
    free = replace(base, speed=tuple(float(s) for s in per_device), _cache={})
    tokens = 0
    secs = dict.fromkeys(("static", "replanned", "capacity", "device", "nominal"), 0.0)
    for k, lengths in enumerate(batches):
        lens = np.asarray(lengths, dtype=np.int64)
        blind = make_schedule(policy, lens, base, seed=k, **opts)
        aware = make_schedule(policy, lens, told, seed=k, **opts)
        if blind.deferred or aware.deferred:
            raise ScheduleError(f"policy {policy!r} deferred sequences; use one that trains the whole batch")
        tokens += int(lens.sum())
        secs["static"] += simulate_step(base, blind, speed=lanes).step_time
        tl = simulate_step(told, aware, speed=lanes)
        secs["replanned"] += tl.step_time
        secs["capacity"] += lower_bound(lens, told) + tl.tail
        secs["device"] += lower_bound(lens, free) + tl.tail
        secs["nominal"] += simulate_step(base, blind).step_time
    return StragglerRun(device_speeds=dev, data_rank_speeds=tuple(float(s) for s in rank_speed), tokens=tokens,
                        static_seconds=secs["static"], replanned_seconds=secs["replanned"],
                        capacity_seconds=secs["capacity"], device_bound_seconds=secs["device"],
                        nominal_seconds=secs["nominal"])
