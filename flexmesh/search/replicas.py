"""Replicas of different layouts for many LoRA tasks, planned as replica groups (LobRA, 2509.01193).

Fine-tuning tasks of very different lengths on one frozen base: a layout that fits the longest
sequence (tensor, context or pipeline parallel over many devices) runs short sequences slowly, and a
one-device layout cannot hold the long ones. The plan is a *mix*: replicas of several layouts
(say six TP1 replicas, one TP2, one TP8), each holding the base model, all training the same
adapters; every step each sequence goes to a replica that fits it, so that the slowest replica
finishes as early as possible.

- Layouts (:func:`replica_types`): tp (dividing a node and the heads) x cp (Ulysses: tp x cp divides
  the heads) x pp, with each recomputation mode; its *capacity* is the longest micro-batch it holds in
  memory (``CostModel.max_tokens``; a pipeline's first stage keeps ``pp`` micro-batches in flight).
  Layouts slower per token than another of as many devices and no larger capacity are dropped.
- A replica's step (:meth:`Pricer.time`): its sequences packed into micro-batches of at most its
  capacity by the one packer (:func:`flexmesh.schedule.packing.best_fit_decreasing`), each priced by
  the cost model (``microbatch_time``; under a pipeline, 1F1B: every micro-batch once plus ``pp - 1``
  times the longest, per stage).
- Dispatch (:func:`dispatch`): the one dispatch (:mod:`flexmesh.schedule.dispatch`), longest sequence
  first, each to the replica that holds it and would finish earliest with it, by the cost model's
  linear estimate (per token, per squared token, per micro-batch: ``microbatch_time`` is linear in those).
- The mix (:func:`plan_mix`): every combination of at most ``kinds`` layouts filling the devices,
  at least one fitting the longest sequence, is ranked by a fluid LP (HiGHS: each length bucket's
  sequences split fractionally over the layouts that fit them, minimising the busiest layout's time
  per replica, and no shorter than the longest sequence alone, all by the linear estimate); the
  ``keep`` best are then dispatched on the sample steps and priced in full, and the fastest mean
  step wins. The LP ranks; it is not a bound on the full pricing (packing adds per-micro-batch costs).
- The plan (:func:`mix_plan`): a :class:`~flexmesh.layout.plan.Plan` of one replica group per layout of
  the mix, its replicas the group's data-parallel pipelines (dp = their count; ZeRO 0: the base is
  frozen and the adapters are small), what every mix of layouts is (flexmesh.layout.plan) and what
  ``flexmesh train --tasks`` runs, dispatching each step's sequences over the groups by their memory
  and predicted times (flexmesh.schedule.groups). Each group takes the share of the global batch the
  dispatch gave its layout on the sample steps, in micro-batches of as many sequences of the plan's
  ``seq_len`` as its replicas hold together: a plan is priced and checked at that length, a micro-batch
  split over a group's replicas (flexmesh.cost.training.mixed), so a mix written as a plan
  (``plan_mix(..., seq_len=...)``) has a layout that holds ``seq_len`` and, of every layout, replicas
  that hold one such sequence together as the check prices it (:class:`GroupMemory`).

Everything is priced by the cost model given (for LoRA, one whose parts hold the tasks:
flexmesh.cost.training.adapters).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from numpy.typing import ArrayLike
from scipy.optimize import linprog

from flexmesh.cost.training.mixed import MixedCosts, evaluate_groups
from flexmesh.cost.training.model import CostModel
from flexmesh.errors import PlanError
from flexmesh.layout.enums import CPKind, PipelineSchedule
from flexmesh.layout.overlap import RUNTIME
from flexmesh.layout.plan import Plan, ReplicaGroup, StagePlan
from flexmesh.layout.shares import split_by_weight
from flexmesh.layout.strategy import LayerStrategy, Recompute
from flexmesh.schedule.dispatch import dispatch as dispatch_items
from flexmesh.schedule.dispatch import members
from flexmesh.schedule.packing import best_fit_decreasing
from flexmesh.spec.cluster import MixedCluster

RECOMPUTE_TAG = {Recompute.NONE: "", Recompute.SELECTIVE: "-sel", Recompute.FULL: "-ac"}


@dataclass(frozen=True)
class ReplicaType:
    """One replica's layout and the longest micro-batch (tokens) it holds."""

    tp: int
    cp: int
    pp: int
    recompute: Recompute
    capacity: int

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.pp

    @property
    def strategy(self) -> LayerStrategy:
        return LayerStrategy(tp=self.tp, cp=self.cp, cp_kind=CPKind.ULYSSES if self.cp > 1 else CPKind.NONE,
                             recompute=self.recompute)

    @property
    def label(self) -> str:
        parts = [f"tp{self.tp}"] + ([f"cp{self.cp}"] if self.cp > 1 else []) + ([f"pp{self.pp}"] if self.pp > 1 else [])
        return "-".join(parts) + RECOMPUTE_TAG[self.recompute]

    def limited(self, capacity: int) -> ReplicaType:
        """This layout taking sequences of at most ``capacity`` tokens (a published mix's length bands)."""
        return ReplicaType(self.tp, self.cp, self.pp, self.recompute, min(self.capacity, capacity))


class Pricer:
    """Step time of a replica type on a list of sequence lengths, by ``cost``."""

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.layers = cost.model.num_layers
        self._linear = lru_cache(maxsize=None)(self._fit)

    def microbatch(self, t: ReplicaType, tokens: float, sq: float) -> float:
        layers = self.layers / t.pp
        return float(self.cost.microbatch_time(t.strategy, tokens, sq, layers=max(1, round(layers)),
                                               embed=True, head=t.pp == 1))

    def _fit(self, t: ReplicaType) -> tuple[float, float, float]:
        """(per micro-batch, per token, per squared token) seconds: microbatch_time is linear in them."""
        n = float(max(2, min(t.capacity, 8192)))
        c0 = self.microbatch(t, n / 2, 0.0)
        c1 = self.microbatch(t, n, 0.0)
        per_token = (c1 - c0) / (n / 2)
        per_sq = (self.microbatch(t, n, n * n) - c1) / (n * n)
        return max(0.0, c1 - per_token * n), per_token, per_sq

    def estimate(self, t: ReplicaType, length: ArrayLike) -> np.ndarray:
        """A sequence's share of a replica's step (packed beside others: no micro-batch of its own); per
        length of an array."""
        _, a, b = self._linear(t)
        # a pipeline stage prices its own layers; its bubble (pp - 1 micro-batches) spread over some pp more
        scale = 1.0 + (t.pp - 1) / (2 * t.pp)
        n = np.asarray(length, dtype=float)
        return (a * n + b * self.cost.attention_sq(0.0, n)) * scale

    def time(self, t: ReplicaType, lengths: Sequence[int]) -> float:
        """Seconds of one step of replica type ``t`` running ``lengths``, packed by the one packer."""
        if not len(lengths):
            return 0.0
        lens = [int(n) for n in lengths]
        sq = [float(self.cost.attention_sq(0.0, float(n))) for n in lens]
        bins = best_fit_decreasing(range(len(lens)), lens, t.capacity)
        times = [self.microbatch(t, sum(lens[i] for i in b), sum(sq[i] for i in b)) for b in bins]
        return sum(times) + (t.pp - 1) * max(times)


def replica_types(cost: CostModel, max_devices: int, pp_options: Sequence[int] = (1, 2, 4),
                  prune: bool = True) -> list[ReplicaType]:
    """Every layout of at most ``max_devices`` devices that holds some micro-batch, less (``prune``) those
    slower than another of as many devices that holds as much."""
    m = cost.model
    per_node = cost.cluster.devices_per_node
    found = []
    for tp in (d for d in (1, 2, 4, 8, 16) if d <= per_node and m.num_heads % d == 0 and m.num_kv_heads % d == 0):
        for cp, pp in itertools.product((1, 2, 4, 8), pp_options):
            if tp * cp * pp > max_devices or m.num_layers % pp or m.num_heads % (tp * cp):  # Ulysses splits heads
                continue
            for rc in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL):
                t = ReplicaType(tp, cp, pp, rc, 0)
                layers = m.num_layers // pp
                first = cost.max_tokens(t.strategy, layers, embed=True, head=pp == 1, in_flight_mbs=pp)
                last = cost.max_tokens(t.strategy, layers, embed=False, head=True) if pp > 1 else first
                cap = min(first, last)
                if cap >= 256:
                    found.append(ReplicaType(tp, cp, pp, rc, cap))
    if not prune:
        return found
    pricer = Pricer(cost)
    late = {t: float(pricer.estimate(t, 2048)) for t in found}  # a replica's seconds on 2K tokens
    return [t for t in found if not any(o.devices == t.devices and o.capacity >= t.capacity and late[o] <= late[t]
                                        and (late[o], o.capacity) != (late[t], t.capacity) for o in found)]


def dispatch(lengths: Sequence[int], replicas: Sequence[ReplicaType], pricer: Pricer) -> list[np.ndarray]:
    """Per replica, the indices of ``lengths`` it runs: the one dispatch (flexmesh.schedule.dispatch),
    longest first, each where it fits and would finish first by the linear estimate."""
    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    caps = [t.capacity for t in replicas]
    if lens.size and int(lens.max()) > max(caps):
        raise PlanError(f"a sequence of {int(lens.max())} tokens fits no replica (the largest holds {max(caps)}); "
                        "add a replica of more devices or lower --seq-len")
    costs = np.stack([pricer.estimate(t, lens) for t in replicas])
    order = np.argsort(-lens, kind="stable")
    return members(dispatch_items(costs, lens, caps, order=order), len(replicas))


def step_time(lengths: Sequence[int], replicas: Sequence[ReplicaType], pricer: Pricer) -> float:
    """The slowest replica's step when ``lengths`` are dispatched over ``replicas``."""
    parts = dispatch(lengths, replicas, pricer)
    return max(pricer.time(t, [lengths[i] for i in idx]) for t, idx in zip(replicas, parts, strict=True))


@dataclass(frozen=True)
class Mix:
    """A set of replicas (type -> count) and its mean step on the sample steps."""

    counts: tuple[tuple[ReplicaType, int], ...]
    step_s: float

    @property
    def replicas(self) -> list[ReplicaType]:
        return [t for t, n in self.counts for _ in range(n)]

    @property
    def devices(self) -> int:
        return sum(t.devices * n for t, n in self.counts)

    @property
    def label(self) -> str:
        return " + ".join(f"{n}x {t.label} (<= {t.capacity:,})" for t, n in self.counts)


def fluid_bound(counts: Sequence[tuple[ReplicaType, int]], buckets: np.ndarray, sizes: np.ndarray,
                pricer: Pricer) -> float:
    """A mix's fluid step: each bucket's sequences (``sizes`` of ``buckets`` lengths, the
    bucket's longest) split fractionally over the types that fit them (LP, HiGHS)."""
    k, nb = len(counts), len(buckets)
    longest = min((float(pricer.estimate(t, int(buckets[-1]))) for t, _ in counts if t.capacity >= buckets[-1]),
                  default=math.inf)
    if math.isinf(longest):
        return math.inf
    # variables: x[b, t] (sequences of bucket b on type t), then T
    cost = np.zeros(nb * k + 1)
    cost[-1] = 1.0
    a_eq = np.zeros((nb, nb * k + 1))
    a_ub = np.zeros((k, nb * k + 1))
    bounds = []
    for b in range(nb):
        for j, (t, n) in enumerate(counts):
            a_eq[b, b * k + j] = 1.0
            a_ub[j, b * k + j] = float(pricer.estimate(t, int(buckets[b]))) / n
            bounds.append((0.0, None if t.capacity >= buckets[b] else 0.0))
    a_ub[:, -1] = -1.0
    bounds.append((longest, None))
    res = linprog(cost, A_ub=a_ub, b_ub=np.zeros(k), A_eq=a_eq, b_eq=sizes, bounds=bounds, method="highs")
    return float(res.fun) if res.status == 0 else math.inf


def mixes(types: Sequence[ReplicaType], devices: int, kinds: int):  # noqa: ANN201
    """Every (type, count) combination of at most ``kinds`` types using exactly ``devices`` devices."""
    for r in range(1, kinds + 1):
        for combo in itertools.combinations(types, r):
            sizes = [t.devices for t in combo]

            def fill(i: int, left: int, chosen: tuple, combo: tuple = combo, sizes: list = sizes):  # noqa: ANN202
                if i == len(combo):
                    if left == 0:
                        yield tuple(zip(combo, chosen, strict=True))
                    return
                for n in range(1, left // sizes[i] + 1):
                    yield from fill(i + 1, left - n * sizes[i], (*chosen, n))

            yield from fill(0, devices, ())


def plan_mix(cost: CostModel, devices: int, steps: Sequence[Sequence[int]], kinds: int = 3, keep: int = 12,
             types: Sequence[ReplicaType] | None = None, seq_len: int | None = None) -> tuple[Mix, list[Mix]]:
    """The mix of replicas over ``devices`` with the fastest mean step on ``steps`` (lengths per step),
    and the runners-up that were dispatched (see the module doc); with ``seq_len``, among the mixes
    a plan holds (:meth:`GroupMemory.holds`)."""
    pricer = Pricer(cost)
    memory = GroupMemory(cost, seq_len) if seq_len is not None else None
    types = list(types) if types is not None else replica_types(cost, devices)
    every = np.concatenate([np.asarray(s) for s in steps])
    longest = int(every.max())
    edges = np.unique(np.quantile(every, np.linspace(0, 1, 13)).astype(int))
    buckets = edges[1:]
    sizes = np.histogram(every, bins=np.concatenate([[0], buckets]))[0] / len(steps)
    bounded = []
    for counts in mixes(types, devices, kinds):
        if max(t.capacity for t, _ in counts) < longest:
            continue
        if memory is not None and not memory.holds(counts):
            continue
        bounded.append((fluid_bound(counts, buckets, sizes, pricer), counts))
    if not bounded:
        raise PlanError(f"no mix of replicas on {devices} devices holds a sequence of {max(longest, seq_len or 0):,} "
                        "tokens; lower --seq-len or give the job more devices")
    bounded.sort(key=lambda x: x[0])
    tried = [Mix(counts, float(np.mean([step_time(s, [t for t, n in counts for _ in range(n)], pricer)
                                        for s in steps])))
             for _, counts in bounded[:keep]]
    tried.sort(key=lambda m: m.step_s)
    return tried[0], tried


def single_layouts(cost: CostModel, devices: int, longest: int, steps: Sequence[Sequence[int]],
                   pricer: Pricer) -> list[tuple[float, ReplicaType]]:
    """Every layout that holds ``longest`` tokens, ``devices`` / its devices replicas of it, by mean step
    on ``steps`` (the same dispatch), fastest first: what one layout for every task gives."""
    every = replica_types(cost, devices, prune=False)
    return sorted(((float(np.mean([step_time(s, [t] * (devices // t.devices), pricer) for s in steps])), t)
                   for t in every if t.capacity >= longest and devices % t.devices == 0), key=lambda x: x[0])


class GroupMemory:
    """Whether the replicas of a layout, written as one replica group of a plan, hold a micro-batch of
    sequences of the plan's ``seq_len`` split over them, as ``flexmesh plan --check`` prices a plan: a
    plan of one group over every rank by :meth:`CostModel.evaluate`, a group beside others by
    :func:`flexmesh.cost.training.mixed.evaluate_groups` (memory does not depend on the other groups)."""

    def __init__(self, cost: CostModel, seq_len: int):
        self.cost, self.seq_len = cost, seq_len
        self.costs = MixedCosts(cost.model, MixedCluster((cost.cluster,)), groups=[cost])
        self._fits: dict[tuple[ReplicaType, int, int, bool], bool] = {}

    def group(self, t: ReplicaType, n: int, first: int, share: int, microbatches: int) -> ReplicaGroup:
        """``n`` replicas of ``t`` on ranks from ``first`` on, taking ``share`` sequences per step."""
        per = n * t.cp * t.tp  # ranks of one pipeline stage: n replicas of tp x cp
        blocks = tuple(tuple(range(first + p * per, first + (p + 1) * per)) for p in range(t.pp))
        layers = self.cost.model.num_layers // t.pp
        s = replace(t.strategy, dp=n)
        stages = tuple(StagePlan(p * layers, (p + 1) * layers, (s,) * layers) for p in range(t.pp))
        return ReplicaGroup(blocks, stages, microbatches, share)

    def plan(self, groups: Sequence[ReplicaGroup], global_batch: int, predicted: dict | None = None) -> Plan:
        cluster, used = self.cost.cluster, sum(len(g.ranks) for g in groups)
        return Plan(self.cost.model.name, cluster.label, cluster.world_size, self.seq_len, global_batch,
                    PipelineSchedule.ONE_F_ONE_B,
                    tuple(groups), unused=tuple(range(used, cluster.world_size)), cost_source=self.cost.source,
                    overlap=RUNTIME, predicted=predicted or {})

    def fits(self, t: ReplicaType, n: int, microbatch: int, alone: bool) -> bool:
        """Whether ``n`` replicas of ``t`` hold ``microbatch`` sequences (a group over every rank: ``alone``)."""
        key = (t, n, microbatch, alone)
        if key not in self._fits:
            plan = self.plan([self.group(t, n, 0, microbatch, 1)], microbatch)
            ev = self.cost.evaluate(plan) if plan.in_rank_order else evaluate_groups(plan, self.costs)
            self._fits[key] = ev.fits
        return self._fits[key]

    def smallest(self, n: int, alone: bool) -> int:
        """The smallest micro-batch of a group of ``n`` replicas: one sequence, or one a replica when the
        group is the whole plan (its micro-batches split over dp: flexmesh.search.check.check_plan)."""
        return n if alone else 1

    def holds(self, counts: Sequence[tuple[ReplicaType, int]]) -> bool:
        """Whether a plan of this mix holds ``seq_len`` sequences (module doc): some layout holds one,
        and every layout's replicas hold their smallest micro-batch of them together."""
        alone = len(counts) == 1
        return max(t.capacity for t, _ in counts) >= self.seq_len and all(
            n * t.capacity >= self.seq_len and self.fits(t, n, self.smallest(n, alone), alone) for t, n in counts)

    def microbatches(self, t: ReplicaType, n: int, share: int, alone: bool) -> int:
        """The fewest micro-batches of ``share`` sequences per step that ``n`` replicas of ``t`` hold."""
        least = self.smallest(n, alone)
        for size in range(share, 0, -1):
            if share % size == 0 and size % least == 0 and size * self.seq_len <= n * t.capacity \
                    and self.fits(t, n, size, alone):
                return share // size
        raise PlanError(f"{n}x {t.label} cannot take a micro-batch of {self.seq_len:,}-token sequences out of "
                        f"{share} per step; change --global-batch or --seq-len")


def mix_plan(mix: Mix, cost: CostModel, steps: Sequence[Sequence[int]], seq_len: int, global_batch: int) -> Plan:
    """``mix`` as a plan of replica groups (module doc): one group per layout, its share of ``global_batch``
    what the dispatch gave its layout on ``steps``, in the fewest micro-batches it holds; groups on
    consecutive ranks, largest replicas first, any devices left over ``unused``. Its ``predicted`` is
    the cost model's at ``seq_len`` (flexmesh.cost.training.mixed), the mix's mean step on ``steps``
    beside it (``predicted.lengths``)."""
    memory = GroupMemory(cost, seq_len)
    if not memory.holds(mix.counts):
        raise PlanError(f"a plan of the mix {mix.label} does not hold {seq_len:,}-token sequences; plan the mix "
                        "for that length (plan_mix(..., seq_len=...))")
    pricer = Pricer(cost)
    kind = [j for j, (_, n) in enumerate(mix.counts) for _ in range(n)]
    taken = [0.0] * len(mix.counts)
    for s in steps:
        for r, idx in enumerate(dispatch(s, mix.replicas, pricer)):
            taken[kind[r]] += len(idx)
    # largest replicas first: each group starts at a multiple of its replicas' (power-of-two) size, so
    # that no replica, nor its TP group, straddles a node
    order = sorted(range(len(mix.counts)), key=lambda j: (-mix.counts[j][0].cp * mix.counts[j][0].tp,
                                                          -mix.counts[j][0].tp))
    shares = split_by_weight(global_batch, [taken[j] for j in order])
    groups: list[ReplicaGroup] = []
    for j, share in zip(order, shares):
        t, n = mix.counts[j]
        m = memory.microbatches(t, n, share, alone=len(order) == 1)
        groups.append(memory.group(t, n, sum(len(g.ranks) for g in groups), share, m))
    plan = memory.plan(groups, global_batch)
    ev = cost.evaluate(plan) if plan.in_rank_order else evaluate_groups(plan, memory.costs)
    step = float(np.mean([step_time(s, mix.replicas, pricer) for s in steps]))
    tokens = float(np.mean([np.sum(s) for s in steps]))
    expected = {"steps": len(steps), "step_time_s": step, "tokens_per_s": tokens / step,
                "policy": "dispatch over the replicas (flexmesh.search.replicas)"}
    return replace(plan, predicted={**ev.to_dict(), "lengths": expected})
