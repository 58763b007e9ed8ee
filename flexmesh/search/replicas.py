"""Replicas of different layouts for many LoRA tasks, and every step's dispatch over them (LobRA, 2509.01193).

Fine-tuning tasks of very different lengths on one frozen base: a layout that fits the longest
sequence (tensor, context or pipeline parallel over many devices) runs short sequences slowly, and a
one-device layout cannot hold the long ones. The plan is a *mix*: replicas of several layouts
(say six TP1 replicas, one TP2, one TP8), each holding the base model, all training the same
adapters; every step each sequence goes to a replica that fits it, so that the slowest replica
finishes as early as possible.

- Layouts (:func:`replica_types`): tp (dividing a node and the heads) x cp x pp, with each
  recomputation mode; its *capacity* is the longest micro-batch it holds in memory
  (``CostModel.max_tokens``; a pipeline's first stage keeps ``pp`` micro-batches in flight).
  Layouts slower per token than another of as many devices and no larger capacity are dropped.
- A replica's step (:meth:`Pricer.time`): its sequences packed first-fit decreasing into micro-batches
  of at most its capacity, each priced by the cost model (``microbatch_time``; under a pipeline,
  1F1B: every micro-batch once plus ``pp - 1`` times the longest, per stage).
- Dispatch (:func:`dispatch`): longest sequence first, each to the replica that fits it and would
  finish earliest with it, by the cost model's linear estimate (per token, per squared token, per
  micro-batch: ``microbatch_time`` is linear in those).
- The mix (:func:`plan_mix`): every combination of at most ``kinds`` layouts filling the devices,
  at least one fitting the longest sequence, is ranked by a fluid LP (HiGHS: each length bucket's
  sequences split fractionally over the layouts that fit them, minimising the busiest layout's time
  per replica, and no shorter than the longest sequence alone, all by the linear estimate); the
  ``keep`` best are then dispatched on the sample steps and priced in full, and the fastest mean
  step wins. The LP ranks; it is not a bound on the full pricing (packing adds per-micro-batch costs).

Everything is priced by the cost model given (for LoRA: flexmesh.cost.training.finetune.AdapterCostModel).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.optimize import linprog

from flexmesh.cost.training.model import CostModel
from flexmesh.errors import PlanError
from flexmesh.layout.enums import CPKind
from flexmesh.layout.strategy import LayerStrategy, Recompute

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

    def estimate(self, t: ReplicaType, length: int) -> float:
        """A sequence's share of a replica's step (packed beside others: no micro-batch of its own)."""
        _, a, b = self._linear(t)
        # a pipeline stage prices its own layers; its bubble (pp - 1 micro-batches) spread over some pp more
        scale = 1.0 + (t.pp - 1) / (2 * t.pp)
        return (a * length + b * float(self.cost.attention_sq(0.0, float(length)))) * scale

    def time(self, t: ReplicaType, lengths: Sequence[int]) -> float:
        """Seconds of one step of replica type ``t`` running ``lengths``."""
        if not len(lengths):
            return 0.0
        bins: list[list[int]] = []
        room: list[int] = []
        for n in sorted(lengths, reverse=True):  # first-fit decreasing
            for i, r in enumerate(room):
                if r >= n:
                    bins[i].append(n)
                    room[i] -= n
                    break
            else:
                bins.append([n])
                room.append(t.capacity - n)
        times = [self.microbatch(t, sum(b), sum(float(self.cost.attention_sq(0.0, float(n))) for n in b)) for b in bins]
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
            if tp * cp * pp > max_devices or m.num_layers % pp:
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
    late = {t: pricer.estimate(t, 2048) for t in found}  # a replica's seconds on 2K tokens
    return [t for t in found if not any(o.devices == t.devices and o.capacity >= t.capacity and late[o] <= late[t]
                                        and (late[o], o.capacity) != (late[t], t.capacity) for o in found)]


def dispatch(lengths: Sequence[int], replicas: Sequence[ReplicaType], pricer: Pricer) -> list[list[int]]:
    """Per replica, the indices of ``lengths`` it runs (longest first, each where it would finish first)."""
    load = [0.0] * len(replicas)
    out: list[list[int]] = [[] for _ in replicas]
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = int(lengths[i])
        best, when = -1, math.inf
        for r, t in enumerate(replicas):
            if t.capacity >= n:
                finish = load[r] + pricer.estimate(t, n)
                if finish < when:
                    best, when = r, finish
        if best < 0:
            raise PlanError(f"a sequence of {n} tokens fits no replica (the largest holds "
                            f"{max(t.capacity for t in replicas)}); add a replica of more devices or lower --seq-len")
        out[best].append(i)
        load[best] = when
    return out


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
    longest = min((pricer.estimate(t, int(buckets[-1])) for t, _ in counts if t.capacity >= buckets[-1]),
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
            a_ub[j, b * k + j] = pricer.estimate(t, int(buckets[b])) / n
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
             types: Sequence[ReplicaType] | None = None) -> tuple[Mix, list[Mix]]:
    """The mix of replicas over ``devices`` with the fastest mean step on ``steps`` (lengths per step),
    and the runners-up that were dispatched (see the module doc)."""
    pricer = Pricer(cost)
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
        bounded.append((fluid_bound(counts, buckets, sizes, pricer), counts))
    if not bounded:
        raise PlanError(f"no mix of replicas on {devices} devices holds a sequence of {longest:,} tokens")
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
