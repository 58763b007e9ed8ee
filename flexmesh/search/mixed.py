"""The mixed-cluster planner: a bi-level search for a plan of replica groups on a mixed cluster.

Upper level (this module): for each device group a tensor-parallel degree (divisors of its node
size that split the heads), pipeline shapes made of its TP groups (``p`` stages of one type), and
mixed shapes whose stages lie on two groups (``a`` TP groups of one type, then ``b`` of another, in both
orders), three (one or two TP groups of each, in every order) or more (one or two of each, in one order:
:func:`chain_order`), where a group too small or too short of memory for whole pipelines lends stages to
others; and a micro-batch size shared by the replicas. A configuration is a set of shapes with replica
counts; TP groups no shape takes are listed unused. Pipelines are laid out as the uniform rank order lays
them out: TP groups innermost, the replicas of one shape next, stages outermost, so that a stage's
gradient all-reduce stays inside a node where it can.

Lower level (flexmesh.search.mixed_partition), exact: each replica's layer partition (min-max stage
time under every stage device's memory, each stage priced by its own device's CostModel) and the
batch split across replicas (HiGHS MILP). Every configuration is priced in full, gradient all-reduce
over the slowest link included (:func:`flexmesh.cost.training.mixed.evaluate_groups`), unless a lower bound of
its step cannot beat the best full step so far: its optimistic throughput (every replica at its
slowest stage's rate, no bubble) plus the part of each stage's gradient all-reduce that one
micro-batch of the stage cannot hide (:meth:`MixedSearch.sync_bound`), checked before the MILP. The
plans of one replica group per device type, each type planned by the uniform search
(flexmesh.search.mixed_types), are priced first and bound the search; the fastest plan of either kind
that fits is the plan.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from itertools import combinations, permutations, product

from flexmesh.cost import in_flight
from flexmesh.cost.training.mixed import (
    MIXED_OVERLAP,
    GroupsEvaluation,
    MixedCosts,
    evaluate_groups,
    gradient_sync,
    p2p_time,
)
from flexmesh.errors import PlanError
from flexmesh.layout.enums import PipelineSchedule
from flexmesh.layout.plan import Plan, ReplicaGroup, StagePlan
from flexmesh.layout.strategy import Recompute
from flexmesh.search.mixed_partition import (
    Partition,
    ReplicaClass,
    StageLine,
    partition,
    relaxed_split,
    split_batch,
    strategy,
)
from flexmesh.search.mixed_types import TypePlans
from flexmesh.search.space import divisors
from flexmesh.spec.cluster import MixedCluster
from flexmesh.spec.model import ModelSpec

Progress = Callable[[int, int], None]
# Micro-batch sizes tried (sequences), those dividing the global batch: beyond 8 sequences of a
# micro-batch the GEMMs are already large (flexmesh.cost.device.kernels' tiles and waves) and activations grow.
MICROBATCH_SIZES = (1, 2, 3, 4, 6, 8)
# Pipeline shapes kept per (group, TP degree) for the combinations, by estimated throughput: the
# rest are dominated in practice, and the combinations grow as the product of the kept counts.
TOP_SHAPES = 3
# Mixed shapes: at most this many stages (a + b); deeper mixed pipelines only add bubbles.
MAX_MIXED_STAGES = 8
CHAIN_STAGES = 2  # TP groups of each type in a pipeline over three or more types: 1 or 2
MODES = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)

Shape = tuple[tuple[int, int], ...]  # (group, tp) per stage, first stage first


@dataclass(frozen=True)
class TPSlot:
    """One TP group: ``tp`` consecutive devices of one node of one group."""

    group: int
    tp: int
    devices: tuple[int, ...]
    speed: float
    node: int


@dataclass(frozen=True)
class Config:
    """Replica counts per shape, the TP degree of each group's TP groups, and the micro-batch size."""

    shapes: tuple[tuple[Shape, int], ...]
    tps: tuple[int, ...]  # per group (its TP groups' degree; unused groups keep any)
    mu: int


@dataclass
class MixedResult:
    plan: Plan
    evaluation: GroupsEvaluation
    search_seconds: float
    configurations: int  # configurations priced (partitions and batch split)
    # Every distinct plan priced in full that fits, fastest first (the plan first), with its evaluation.
    candidates: list[tuple[Plan, GroupsEvaluation]] = field(default_factory=list)


def chain_order(cluster: MixedCluster, groups: Sequence[int]) -> tuple[int, ...]:
    """The order a pipeline over four or more device groups runs them in: most memory per device first
    (the first stages keep the most micro-batches in flight), then the faster peak.

    >>> from flexmesh.spec.cluster import parse_mixed_cluster
    >>> chain_order(parse_mixed_cluster("2xT4+2xA10+2xRTX-2080Ti+2xV100-32GB"), (0, 1, 2, 3))
    (3, 1, 0, 2)
    """
    def key(g: int) -> tuple[float, float]:
        d = cluster.groups[g].device
        return (-d.usable_memory_bytes, -max(d.peak_tflops.values()))
    return tuple(sorted(groups, key=key))


def tp_degrees(model: ModelSpec, per_node: int) -> list[int]:
    """TP degrees of one node's devices that split the attention heads (and the KV heads or by them)."""
    return [t for t in divisors(per_node) if model.num_heads % t == 0 and
            (model.num_kv_heads % t == 0 or t % model.num_kv_heads == 0)]


class MixedSearch:
    """One search: the model, the mixed cluster, its cost models and the batch."""

    def __init__(self, model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int,
                 costs: MixedCosts | None = None):
        if seq_len < 1 or global_batch < 1:
            raise PlanError(f"--seq-len and --global-batch must be positive, got {seq_len} and {global_batch}")
        self.model, self.cluster, self.seq_len, self.global_batch = model, cluster, seq_len, global_batch
        self.costs = costs or MixedCosts(model, cluster)
        self.L = model.num_layers
        self.mus = [m for m in MICROBATCH_SIZES if global_batch % m == 0]
        self._lines = lru_cache(maxsize=None)(self._line)
        self._parts: dict[tuple, Partition | None] = {}
        self._slots: dict[tuple[int, int], list[TPSlot]] = {}
        self._p2ps: dict[tuple, float] = {}
        self._blocks: dict[tuple, list[Partition] | None] = {}
        # the plans of one replica group per device type (flexmesh.search.mixed_types), and its searches
        self.types = TypePlans(model, cluster, seq_len, global_batch, self.costs)

    # ---- building blocks -----------------------------------------------------------------------
    def slots(self, group: int, tp: int) -> list[TPSlot]:
        """The group's TP groups of degree ``tp``, in device order."""
        if (group, tp) not in self._slots:
            g, start = self.cluster.groups[group], self.cluster.group_start(group)
            out = []
            for q in range(g.world_size // tp):
                devs = tuple(range(start + q * tp, start + (q + 1) * tp))
                out.append(TPSlot(group, tp, devs, self.costs.speed(devs), self.costs.node_of[devs[0]]))
            self._slots[(group, tp)] = out
        return self._slots[(group, tp)]

    def _p2p(self, a: TPSlot, b: TPSlot, mu: int) -> float:
        # What the price depends on: the groups, whether one node holds both, the TP degrees.
        key = (a.group, b.group, a.node == b.node, a.tp, b.tp, mu)
        if key not in self._p2ps:
            self._p2ps[key] = p2p_time(self.costs, (a.devices, a.tp), (b.devices, b.tp), mu, self.seq_len)
        return self._p2ps[key]

    def _line(self, group: int, tp: int, speed: float, first: bool, last: bool, flight: float, mu: int,
              p2p: float) -> StageLine:
        """One stage's time and memory per layer and fixed, per recomputation mode (the stage's CostModel)."""
        cost = self.costs.groups[group]
        tau, e, beta, gamma = [], [], [], []
        for mode in MODES:
            s = strategy(tp, mode)
            work = cost.layer_work(s, mu, self.seq_len)
            layer = cost.layer(s, work, MIXED_OVERLAP)
            ends = cost.ends(s, work, first, False, MIXED_OVERLAP) + cost.ends(s, work, False, last, MIXED_OVERLAP)
            logits = cost.ends(strategy(tp, Recompute.NONE), work, False, True, MIXED_OVERLAP).transient if last else 0
            tau.append((layer.fwd + layer.bwd) / speed + layer.comm_fwd + layer.comm_bwd)
            e.append((ends.fwd + ends.bwd) / speed + ends.comm_fwd + ends.comm_bwd + p2p)
            beta.append(layer.states + layer.act * flight)
            gamma.append(ends.states + ends.act * flight + layer.transient + logits)
        return StageLine(MODES, tuple(tau), tuple(e), tuple(beta), tuple(gamma), cost.memory_budget)

    def lines(self, slots: Sequence[TPSlot], mu: int) -> list[StageLine]:
        pp = len(slots)
        out = []
        for j, s in enumerate(slots):
            p2p = 0.0 if pp == 1 else self._p2p(s, slots[j + 1] if j + 1 < pp else slots[j - 1], mu)
            # 1F1B holds pp - j micro-batches on stage j at most (fewer only when m is smaller).
            out.append(self._lines(s.group, s.tp, s.speed, j == 0, j == pp - 1, in_flight("1f1b", pp, j, 10**9),
                                   mu, round(p2p, 12)))
        return out

    def partition(self, slots: Sequence[TPSlot], mu: int) -> Partition | None:
        lines = self.lines(slots, mu)
        key = (tuple(lines), mu)
        if key not in self._parts:
            self._parts[key] = partition(lines, self.L)
        return self._parts[key]

    # ---- shapes ----------------------------------------------------------------------------------
    def pure_shapes(self, group: int) -> list[tuple[float, Shape]]:
        """(estimated group tokens/s, shape) of this group's best pure shapes per TP degree."""
        g = self.cluster.groups[group]
        out = []
        for tp in tp_degrees(self.model, g.devices_per_node):
            pool = self.slots(group, tp)
            scored = []
            for p in range(1, min(self.L, len(pool)) + 1):
                n = len(pool) // p
                rate = self._rate([pool[j * n] for j in range(p)])
                if rate > 0:
                    scored.append((rate * n, ((group, tp),) * p))
            out += sorted(scored, reverse=True)[:TOP_SHAPES]
        return sorted(out, reverse=True)

    def _rate(self, slots: Sequence[TPSlot]) -> float:
        """Optimistic tokens/s of one replica on these slots: the best micro-batch size at its slowest stage."""
        best = 0.0
        for mu in self.mus:
            part = self.partition(slots, mu)
            if part is not None:
                best = max(best, mu * self.seq_len / part.max_time)
        return best

    # ---- configurations ----------------------------------------------------------------------------
    def configurations(self) -> list[Config]:
        groups = range(len(self.cluster.groups))
        pure = {g: self.pure_shapes(g) for g in groups}
        configs: list[Config] = []
        default_tp = [tp_degrees(self.model, self.cluster.groups[g].devices_per_node)[0] for g in groups]
        choices = [[None, *[s for _, s in pure[g]]] for g in groups]
        for combo in product(*choices):
            used = [s for s in combo if s is not None]
            if not used:
                continue
            tps = tuple(s[0][1] if s is not None else default_tp[g] for g, s in enumerate(combo))
            shapes = tuple((s, len(self.slots(g, s[0][1])) // len(s)) for g, s in enumerate(combo) if s is not None)
            configs += [Config(shapes, tps, mu) for mu in self.mus]
        for g1, g2 in product(groups, groups):
            if g1 == g2:
                continue
            for (_, s1), (_, s2) in product(pure[g1][:2] or [(0, ((g1, default_tp[g1]),))],
                                            pure[g2][:2] or [(0, ((g2, default_tp[g2]),))]):
                if s1[0][1] == s2[0][1]:
                    configs += self._mixed(((g1, s1[0][1]), (g2, s2[0][1])), MAX_MIXED_STAGES - 1, pure)
        # Pipelines over three or more device types, one or two TP groups of each: for types too short of
        # memory to hold the model with one other. Three types in every order; four or more in one
        # (chain_order), as their orders grow factorially. The TP degrees every member has a shape of;
        # where a member has none (it holds no pipeline of its own), the largest degree all of them
        # allow, which gives each stage the most memory.
        chains: list[tuple[int, ...]] = list(permutations(groups, 3))
        for k in range(4, min(len(groups), MAX_MIXED_STAGES) + 1):
            chains += [chain_order(self.cluster, members) for members in combinations(groups, k)]
        for chain in chains:
            own = [{s[0][1] for _, s in pure[g]} for g in chain]
            allowed = set.intersection(*(set(tp_degrees(self.model, self.cluster.groups[g].devices_per_node))
                                         for g in chain))
            for t in sorted(set.intersection(*own) if all(own) else set(sorted(allowed)[-1:])):
                configs += self._mixed(tuple((g, t) for g in chain), CHAIN_STAGES, pure)
        return configs

    def _mixed(self, members: tuple[tuple[int, int], ...], most_each: int, pure: dict) -> list[Config]:
        """Shapes of ``a`` TP groups of the first (group, TP degree), then ``b`` of the second, ... (at
        most ``most_each`` of each, :data:`MAX_MIXED_STAGES` in all), as many as fit (or one), the rest
        of every member group in its best pure shape of the same TP degree. One TP degree for all: the
        runtime links stage to stage by TP index, so one pipeline keeps one degree."""
        pools = [len(self.slots(g, t)) for g, t in members]
        out = []
        for counts in product(*(range(1, min(q, most_each) + 1) for q in pools)):
            if sum(counts) > min(MAX_MIXED_STAGES, self.L):
                continue
            shape: Shape = tuple(m for m, c in zip(members, counts) for _ in range(c))
            most = min(q // c for q, c in zip(pools, counts))
            for n in sorted({most, 1}):
                shapes = [(shape, n)]
                for (g, t), q, c in zip(members, pools, counts):
                    left = q - n * c
                    best = [s for _, s in pure[g] if s[0][1] == t and len(s) <= left]
                    if best:
                        shapes.append((best[0], left // len(best[0])))
                tps = [tp_degrees(self.model, cl.devices_per_node)[0] for cl in self.cluster.groups]
                for g, t in members:
                    tps[g] = t
                out += [Config(tuple(shapes), tuple(tps), mu) for mu in self.mus]
        return out

    def blocks(self, config: Config) -> list[tuple[Shape, int, tuple[int, ...]]]:
        """(shape, replicas, first pool index per group) of each shape of the configuration."""
        taken = [0] * len(self.cluster.groups)
        out = []
        for shape, n in config.shapes:
            out.append((shape, n, tuple(taken)))
            for g, _ in shape:
                taken[g] += n
        return out

    def block_replicas(self, shape: Shape, n: int, offsets: tuple[int, ...],
                       tps: tuple[int, ...]) -> list[list[TPSlot]]:
        """Each replica's slots: the ``j``-th stage on group g of replica ``i`` on the block's TP group
        ``j * n + i`` of g (the replicas' stage ``j`` on consecutive TP groups)."""
        seen: dict[int, int] = {}
        stage_slots = []
        for g, _ in shape:
            j = seen.get(g, 0)
            seen[g] = j + 1
            pool = self.slots(g, tps[g])
            stage_slots.append(pool[offsets[g] + j * n: offsets[g] + (j + 1) * n])
        return [[stage_slots[j][i] for j in range(len(shape))] for i in range(n)]

    def block_partitions(self, shape: Shape, n: int, offsets: tuple[int, ...], tps: tuple[int, ...],
                         mu: int) -> list[Partition] | None:
        key = (shape, n, offsets, tps, mu)
        if key not in self._blocks:
            parts: list[Partition] | None = []
            for slots in self.block_replicas(shape, n, offsets, tps):
                part = self.partition(slots, mu)
                if part is None or parts is None:
                    parts = None
                    break
                parts.append(part)
            self._blocks[key] = parts
        return self._blocks[key]

    # ---- the lower level ----------------------------------------------------------------------------
    def estimate(self, config: Config, best: float) -> tuple[float, list[list[TPSlot]], list[Partition],
                                                             list[int]] | None:
        """(slowest pipeline s, replicas, their partitions, micro-batches each), or None when nothing
        fits or a lower bound of the full step, the relaxed batch split plus :meth:`sync_bound`, cannot
        beat ``best`` seconds (the best full step so far)."""
        replicas: list[list[TPSlot]] = []
        parts: list[Partition] = []
        for shape, n, offsets in self.blocks(config):
            block = self.block_partitions(shape, n, offsets, config.tps, config.mu)
            if block is None:
                return None
            replicas += self.block_replicas(shape, n, offsets, config.tps)
            parts += block
        classes: dict[tuple, list[int]] = {}
        for i, p in enumerate(parts):
            classes.setdefault(p.times, []).append(i)
        keys = list(classes)
        cls = [ReplicaClass(len(classes[k]), sum(k) - max(k), max(k)) for k in keys]
        bound = relaxed_split(cls, self.global_batch // config.mu)
        if bound >= best:
            return None  # even a fractional split cannot beat the best so far
        if bound + self.sync_bound(self.groups(config, replicas, parts, [1] * len(replicas)), parts) >= best:
            return None  # nor with the gradient all-reduce that cannot hide
        res = split_batch(cls, self.global_batch // config.mu)
        if res is None:
            return None
        t, counts = res
        micro = [0] * len(replicas)
        for k, ms in zip(keys, counts):
            for i, m in zip(classes[k], ms):
                micro[i] = m
        return t, replicas, parts, micro

    def groups(self, config: Config, replicas: list[list[TPSlot]], parts: list[Partition],
               micro: list[int]) -> list[ReplicaGroup]:
        """One replica group per pipeline, with ``micro`` micro-batches each."""
        groups = []
        for slots, part, m in zip(replicas, parts, micro):
            stages, start = [], 0
            for s, n, mode in zip(slots, part.sizes, part.recompute):
                stages.append(StagePlan(start, start + n, (strategy(s.tp, mode),) * n))
                start += n
            groups.append(ReplicaGroup(tuple(s.devices for s in slots), tuple(stages), m, config.mu * m))
        return groups

    def build(self, config: Config, replicas: list[list[TPSlot]], parts: list[Partition], micro: list[int],
              predicted: dict | None = None) -> Plan:
        """The plan: one replica group per pipeline, block ``j`` the TP group of its stage ``j``."""
        groups = self.groups(config, replicas, parts, micro)
        used = {d for g in groups for d in g.ranks}
        sources = "+".join(dict.fromkeys(c.source for c in self.costs.groups))
        return Plan(self.model.name, self.cluster.label, self.cluster.world_size, self.seq_len, self.global_batch,
                    PipelineSchedule.ONE_F_ONE_B, tuple(groups),
                    unused=tuple(d for d in range(self.cluster.world_size) if d not in used),
                    predicted=predicted or {}, cost_source=sources, overlap=MIXED_OVERLAP)

    def sync_bound(self, groups: list[ReplicaGroup], parts: list[Partition]) -> float:
        """A lower bound of the step's tail beyond the slowest pipeline: each stage's gradient all-reduce
        across groups (:func:`~flexmesh.cost.training.mixed.gradient_sync`, which does not depend on the
        micro-batch counts) less one micro-batch of that stage, more than the last backward it hides
        under (:meth:`CostModel.exposed_sync`)."""
        sync = gradient_sync(self.costs, groups)
        return max((max(0.0, s - t) for row, p in zip(sync, parts) for s, t in zip(row, p.times)), default=0.0)

    def run(self, progress: Progress | None = None) -> MixedResult:
        """Every configuration is priced in full (pipelines, gradient all-reduce across groups, optimizer)
        unless a lower bound of its step (:meth:`estimate`) is no better than the best full price so
        far: the answer is the best of all configurations under the cost model, not of those whose
        pipelines alone look fastest."""
        t0 = time.perf_counter()
        configs = self.configurations()
        typed = [(ev.step_time, plan, ev) for plan in self.types.plans()
                 for ev in [evaluate_groups(plan, self.costs)] if ev.fits]
        best = min((t for t, _, _ in typed), default=math.inf)  # each type alone bounds the search
        results = []
        for i, config in enumerate(configs):
            if progress and i % 16 == 0:
                progress(i, len(configs))
            est = self.estimate(config, best)
            if est is None:
                continue
            plan = self.build(config, *est[1:])
            ev = evaluate_groups(plan, self.costs)
            if ev.fits:
                results.append((ev.step_time, plan, ev))
                best = min(best, ev.step_time)
        if progress:
            progress(len(configs), len(configs))
        results += typed
        if not results:
            raise PlanError(f"no plan of {self.model.name} fits on {self.cluster.label} at seq len "
                            f"{self.seq_len}, global batch {self.global_batch}: no pipeline of the groups' TP "
                            "groups holds the model in memory; add devices or shorten the sequences")
        ranked = sorted(results, key=lambda x: x[0])  # stable: the first of equals is the plan
        _, plan, ev = ranked[0]
        seconds = time.perf_counter() - t0
        ev.extra["search_seconds"] = seconds
        plan = replace(plan, predicted=ev.to_dict())
        candidates, seen = [], set()
        for _, other, oev in ranked:
            if other.layout not in seen:
                seen.add(other.layout)
                candidates.append((plan if oev is ev else replace(other, predicted=oev.to_dict()), oev))
        return MixedResult(plan, ev, seconds, len(configs), candidates)


def plan_mixed(model: ModelSpec, cluster: MixedCluster, seq_len: int, global_batch: int,
               costs: MixedCosts | None = None, progress: Progress | None = None) -> MixedResult:
    """The fastest plan the bi-level search finds on a mixed cluster (PlanError when nothing fits)."""
    return MixedSearch(model, cluster, seq_len, global_batch, costs).run(progress)
