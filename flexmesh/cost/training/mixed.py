"""Pricing a plan of several replica groups on a mixed cluster: one CostModel per device group, the
links between groups.

Every number comes from the cost model (:class:`~flexmesh.cost.CostModel` of the stage's own device
group): a stage's layers, embedding and head (:meth:`CostModel.stage_cost` with the stage's
strategies), the pipeline sends and the gradient all-reduce (:meth:`Hardware.collective_time` of the
network they cross), the pipeline's step (:func:`~flexmesh.cost.pipeline_time`), the in-flight
micro-batches (:func:`~flexmesh.cost.in_flight`) and the exposed part of the gradient sync
(:meth:`CostModel.exposed_sync`). What this module adds is which cost model and which network price
each part:

- a stage runs on its block's device type; its compute (not its communication) slows down by the
  slowest device's speed factor, as in the simulator (flexmesh.sim.timeline);
- a collective between devices is priced on the slowest network it crosses: NVLink inside one node,
  the device group's inter-node network inside one device group, the link between device groups
  (``MixedCluster.link``) across them, as a group of ``size`` ranks with at most ``per_node`` of them
  on one node;
- each layer's gradient is all-reduced over the replica groups holding it (one shard per TP rank;
  the holder with the smallest TP degree carries the largest shard), once per step after the last
  backward, partly hidden under it; the optimizer then updates each stage's parameters;
- a group's step = its pipeline (``share / microbatch`` micro-batches); the plan's step = the slowest
  group's pipeline + the largest tail (exposed gradient sync + optimizer): the all-reduce is a
  barrier across the groups.

It prices groups of one pipeline each (dp 1), as the mixed search builds them, under the plan's
overlap options (:data:`~flexmesh.layout.overlap.FASTEST` for mixed plans: the options the uniform
baselines are priced with, so plans of both kinds compare on one footing).
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from flexmesh.cost.device.hardware import GroupShape
from flexmesh.cost.training.model import CostModel
from flexmesh.cost.training.parts import Parts
from flexmesh.cost.training.pipeline import in_flight, pipeline_time
from flexmesh.cost.training.work import LayerCost
from flexmesh.errors import PlanError
from flexmesh.layout.mesh import group_layout
from flexmesh.layout.overlap import FASTEST, Overlap
from flexmesh.layout.plan import Plan, ReplicaGroup
from flexmesh.layout.strategy import LayerStrategy, Recompute
from flexmesh.spec.cluster import Link, MixedCluster
from flexmesh.spec.model import ModelSpec
from flexmesh.units import GIB

MIXED_OVERLAP: Overlap = FASTEST


class MixedCosts:
    """One CostModel per device group of a mixed cluster, and one per link between groups (the slower
    group's device numbers with the link's bandwidth and latency as its inter-node network).

    >>> from flexmesh.spec.cluster import parse_mixed_cluster
    >>> from flexmesh.spec import parse_model
    >>> mc = MixedCosts(parse_model("tiny"), parse_mixed_cluster("1x8xH100+2x8xA100-40GB"))
    >>> [c.cluster.device.name for c in mc.groups], mc.network([0, 1])[1], mc.network([0, 8])[1]
    (['H100-80GB', 'A100-40GB'], GroupShape(size=2, per_node=2), GroupShape(size=2, per_node=1))
    """

    def __init__(self, model: ModelSpec, cluster: MixedCluster, groups: Sequence[CostModel] | None = None,
                 parts: Parts | None = None):
        self.model = model
        self.cluster = cluster
        # what every group trains and how (LoRA adapters, another stack, experts): the given groups' parts
        self.parts = parts if parts is not None else groups[0].parts if groups else Parts()
        self.groups = list(groups) if groups is not None else [CostModel(model, g, parts=self.parts)
                                                               for g in cluster.groups]
        self._links: dict[tuple[int, int, Link], CostModel] = {}
        self._nodes: dict[tuple[int, Link], CostModel] = {}  # a group on some of its nodes (on)
        self._across: dict[frozenset[int], Link] = {}  # nodes of several groups (across)
        self._stages: dict[tuple, LayerCost] = {}
        # Per rank, looked up for every stage and collective the search prices.
        ranks = range(cluster.world_size)
        self.group_of = [cluster.group_of(r) for r in ranks]
        self.node_of = [cluster.node_of(r) for r in ranks]
        self.group_of_node = [k for k, g in enumerate(cluster.groups) for _ in range(g.nodes)]
        self.speeds = [cluster.speed(r) for r in ranks]

    def stage_cost(self, group: int, strategies: tuple[LayerStrategy, ...], microbatch: int, seq_len: int,
                   embed: bool, head: bool, overlap: Overlap = MIXED_OVERLAP,
                   anchor: LayerStrategy | None = None) -> LayerCost:
        """:meth:`CostModel.stage_cost` of a stage's layers on the device group's device (memoised)."""
        key = (group, strategies, microbatch, seq_len, embed, head, overlap, anchor)
        if key not in self._stages:
            self._stages[key] = self.groups[group].stage_cost(list(strategies), microbatch, seq_len, embed, head,
                                                              overlap, anchor)
        return self._stages[key]

    def of_rank(self, rank: int) -> CostModel:
        return self.groups[self.group_of[rank]]

    def link(self, i: int, j: int, nodes: frozenset[int] | None = None) -> CostModel:
        """The cost model whose inter-node network is the link between groups ``i`` and ``j`` (the slower
        group's device numbers); with ``nodes`` (global indices), the network those nodes of the two
        groups reach each other by (:meth:`across`)."""
        link = self.cluster.link(i, j) if nodes is None else self.across(nodes)
        key = (min(i, j), max(i, j), link)
        if key not in self._links:
            gi, gj = self.cluster.groups[key[0]], self.cluster.groups[key[1]]
            slow = gi if gi.device.node_net_gbps <= gj.device.node_net_gbps else gj
            device = replace(slow.device, node_net_gbps=link.gbps, inter_latency_us=link.latency_us)
            self._links[key] = CostModel(self.model, replace(slow, device=device, speed_factors=()), parts=self.parts)
        return self._links[key]

    def inter(self, group: int, nodes: frozenset[int]) -> Link:
        """The network ``nodes`` of device group ``group`` reach each other and other groups by: the group's,
        or where the cluster file gives per-node facts, that of these nodes (``MixedCluster.node_network``:
        a slow NIC or a slow link between two of a group's nodes bounds only what crosses it)."""
        net = self.cluster.node_network
        if net is not None:
            return net.between(group, nodes)
        dev = self.cluster.groups[group].device
        return Link(dev.node_net_gbps, dev.inter_latency_us)

    def across(self, nodes: frozenset[int]) -> Link:
        """The network ``nodes`` of two or more device groups reach each other by: the slowest link between
        their groups, no faster than each group's nodes among them reach out by (:meth:`inter`: the group's
        network, or their NICs and the links between them) nor than a node link given between two of them.
        Where the cluster file gives per-node facts, the group links are taken as given, before node links
        between the groups lowered them: a slow link between two nodes bounds only what spans both."""
        if nodes in self._across:
            return self._across[nodes]
        by_group: dict[int, set[int]] = {}
        for n in nodes:
            by_group.setdefault(self.group_of_node[n], set()).add(n)
        groups, net = sorted(by_group), self.cluster.node_network
        given = {(a, b): x for a, b, x in (net.group_links if net is not None and net.group_links
                                           else self.cluster.links)}
        bounds = [given[(a, b)] for i, a in enumerate(groups) for b in groups[i + 1:]]
        bounds += [self.inter(g, frozenset(ns)) for g, ns in by_group.items()]
        bounds += net.among(nodes) if net is not None else []
        self._across[nodes] = Link(min(x.gbps for x in bounds), max(x.latency_us for x in bounds))
        return self._across[nodes]

    def on(self, ranks: Iterable[int]) -> CostModel:
        """The cost model of ``ranks`` of one device group: the group's, its inter-node network that of
        the nodes they span (:meth:`inter`)."""
        ranks = list(ranks)
        g = self.group_of[ranks[0]]
        cost = self.groups[g]
        nodes = frozenset(self.node_of[r] for r in ranks)
        if self.cluster.node_network is None or len(nodes) < 2:
            return cost
        link, dev = self.inter(g, nodes), cost.cluster.device
        if (link.gbps, link.latency_us) == (dev.node_net_gbps, dev.inter_latency_us):
            return cost
        if (g, link) not in self._nodes:
            cluster = replace(cost.cluster, device=replace(dev, node_net_gbps=link.gbps,
                                                           inter_latency_us=link.latency_us))
            hw = copy.copy(cost.hw)  # the group's hardware (a preset's or a profile's), another network
            hw.cluster = cluster
            hw.comm = replace(hw.comm, inter_gbps_per_gpu=link.gbps / cluster.devices_per_node,
                              inter_latency_s=link.latency_us * 1e-6)
            self._nodes[(g, link)] = CostModel(self.model, cluster, hw, cost.timing, parts=cost.parts,
                                               step_overlap=cost.step_overlap)
        return self._nodes[(g, link)]

    def network(self, ranks: Iterable[int]) -> tuple[CostModel, GroupShape]:
        """The cost model of the slowest network ``ranks`` cross and their group shape on it: inside one
        group the network of the nodes they span (:meth:`on`); across groups the network those nodes
        reach each other by (:meth:`across`)."""
        ranks = list(ranks)
        groups = sorted({self.group_of[r] for r in ranks})
        per_node = max(Counter(self.node_of[r] for r in ranks).values())
        shape = GroupShape(len(ranks), per_node)
        if len(groups) == 1:
            return self.on(ranks), shape
        pairs = [(a, b) for i, a in enumerate(groups) for b in groups[i + 1:]]
        slowest = min(pairs, key=lambda p: (self.cluster.link(*p).gbps, -self.cluster.link(*p).latency_us))
        return self.link(*slowest, frozenset(self.node_of[r] for r in ranks)), shape

    def speed(self, devices: Iterable[int]) -> float:
        """A TP group computes at its slowest member's speed."""
        return min(self.speeds[d] for d in devices)


@dataclass
class StageEstimate:
    """One stage of one group: per micro-batch time, the step's tail, and memory (bytes)."""

    group: int
    device: str
    layers: tuple[int, int]
    tp: int
    recompute: str
    time: float  # one micro-batch, fwd + bwd + exposed communication + pipeline sends, s
    tail: float  # exposed gradient sync + optimizer after the pipeline drains, s
    memory: dict[str, float]
    budget: float
    exposed_sync: float = 0.0  # the part of ``tail`` that is the gradient all-reduce across groups, s

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.budget


@dataclass
class GroupEstimate:
    batch: int
    num_microbatches: int
    pipeline_time: float  # s
    tail: float  # s
    stages: list[StageEstimate]

    @property
    def step_time(self) -> float:
        return self.pipeline_time + self.tail

    @property
    def peak_memory(self) -> float:
        return max(s.memory["total"] for s in self.stages)


@dataclass
class GroupsEvaluation:
    """The predicted step of a plan of several replica groups (``to_dict``: the plan's ``predicted``)."""

    step_time: float
    tokens_per_s: float
    replicas: list[GroupEstimate]
    extra: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return all(s.fits for r in self.replicas for s in r.stages)

    def over_budget(self) -> list[tuple[int, int, StageEstimate]]:
        """(group, stage, estimate) of every stage whose memory exceeds its device's budget."""
        return [(i, j, s) for i, r in enumerate(self.replicas) for j, s in enumerate(r.stages) if not s.fits]

    def to_dict(self) -> dict:
        """The plan file's ``predicted`` section: seconds and GiB, one entry per replica group."""
        return {
            "step_time_s": self.step_time, "tokens_per_s": self.tokens_per_s, "fits": self.fits,
            "replicas": [{"batch": r.batch, "num_microbatches": r.num_microbatches, "step_time_s": r.step_time,
                          "pipeline_time_s": r.pipeline_time, "tail_s": r.tail,
                          "peak_memory_gib": r.peak_memory / GIB,
                          "stages": [{"device": s.device, "stage_time_s": s.time,
                                      "memory_gib": s.memory["total"] / GIB, "budget_gib": s.budget / GIB}
                                     for s in r.stages]} for r in self.replicas],
            **self.extra,
        }


def p2p_time(costs: MixedCosts, a: tuple[tuple[int, ...], int], b: tuple[tuple[int, ...], int], microbatch: int,
             seq_len: int) -> float:
    """Send + receive of one micro-batch's boundary activations between two stages (each its ranks and tp
    degree), forward and backward, on the network between them (the sequence-parallel shard of the
    smaller TP group), plus the framework's fixed seconds per pipeline chunk of the first stage's devices
    (as :meth:`CostModel.pipeline_p2p`)."""
    (ranks_a, tp_a), (ranks_b, tp_b) = a, b
    cost, shape = costs.network([ranks_a[0], ranks_b[0]])
    work = cost.layer_work(LayerStrategy(tp=min(tp_a, tp_b)), microbatch, seq_len)
    nbytes = work.tokens / min(tp_a, tp_b) * costs.model.hidden * costs.model.dtype_bytes
    return (2 * float(cost.hw.collective_time("send_recv", nbytes, shape))
            + costs.of_rank(ranks_a[0]).timing.stage_fixed_s())


def gradient_sync(costs: MixedCosts, groups: Sequence[ReplicaGroup]) -> list[list[float]]:
    """Seconds of the once-per-step gradient all-reduce across groups of each (group, pipeline rank),
    over the groups holding each of its layers, its embedding (first stages) and its head (last
    stages), as flexmesh.runtime.parallel.cross_group runs it:

    - groups of one pipeline each (no data ranks): each tensor-parallel rank all-reduces its shard with
      the other holders (the holder with the smallest TP degree carries the largest shard);
    - blocks that shard a unit alike (one size; one tp degree, number of data ranks and ZeRO kind):
      the ``j``-th ranks all-reduce their local shards, ``1 / (tp x data ranks)`` of the unit each
      (a full ``1 / tp`` copy each where the groups replicate);
    - otherwise each block gathers the unit whole over its data ranks, then all ranks all-reduce it.

    What the step trains says which gradients sync (LoRA: the adapters' alone).
    """
    m, trained = costs.model, costs.groups[0].trained
    out = [[0.0] * g.pp for g in groups]
    if len(groups) < 2:
        return out
    layouts = [group_layout(g) for g in groups]
    pipelines = all(lay.data_ranks == 1 for lay in layouts) and all(g.virtual_stages == 1 for g in groups)

    def all_reduce(holders: list[tuple[int, int]], params: float) -> float:
        params = trained.synced_params(params)  # LoRA: the adapters' gradients alone
        if not params:
            return 0.0
        if pipelines:
            stages = [(groups[i].blocks[j], groups[i].stage_tp(j)) for i, j in holders]
            cost, shape = costs.network(ranks[0] for ranks, _ in stages)
            nbytes = params / min(tp for _, tp in stages) * cost.reduce_bytes
            return float(cost.hw.collective_time("all_reduce", nbytes, shape))
        blocks = [groups[i].blocks[j % groups[i].pp] for i, j in holders]
        lays = [layouts[i] for i, _ in holders]
        cost, shape = costs.network(b[0] for b in blocks)
        if len({len(b) for b in blocks}) == 1 and len({(x.tp, x.data_ranks, x.replicated) for x in lays}) == 1:
            shard = lays[0].tp * (1 if lays[0].replicated else lays[0].data_ranks)
            return float(cost.hw.collective_time("all_reduce", params / shard * cost.reduce_bytes, shape))
        gather = 0.0
        for block, lay in zip(blocks, lays):
            if lay.data_ranks > 1:
                inner, inner_shape = costs.network(block[::lay.tp])
                gather = max(gather, float(inner.hw.collective_time(
                    "all_gather", params / lay.tp * inner.reduce_bytes, inner_shape)))
        every, every_shape = costs.network(d for b in blocks for d in b)
        return gather + float(every.hw.collective_time("all_reduce", params * every.reduce_bytes, every_shape))

    # Layers with the same holders form one segment (the stage boundaries of every group cut them).
    cuts = sorted({0, groups[0].num_layers} | {s.end for g in groups for s in g.stages})
    for a, b in zip(cuts, cuts[1:]):
        holders = [(i, g.stage_of_layer(a)) for i, g in enumerate(groups)]
        t = all_reduce(holders, m.layer_params) * (b - a)
        for i, j in holders:
            out[i][j % groups[i].pp] += t
    first = [(i, 0) for i in range(len(groups))]
    last = [(i, len(g.stages) - 1) for i, g in enumerate(groups)]
    t_embed = all_reduce(first, m.embedding_params)
    for i, j in first:
        out[i][j] += t_embed
    # A tied head on another stage than the embedding keeps its own copy (as CostModel.ends prices it).
    for i, j in last:
        tied = m.vocab * m.hidden if m.tie_embeddings and groups[i].pp > 1 else 0
        out[i][j % groups[i].pp] += all_reduce(last, m.head_params + tied)
    return out


def one_pipeline(group: ReplicaGroup) -> bool:
    """Whether ``group`` is one pipeline (no data ranks, one chunk per stage): the replicas the mixed
    search builds, priced stage by stage on each stage's device (:func:`evaluate_group`)."""
    return group.data_ranks == 1 and group.virtual_stages == 1 and all(
        s.zero == 0 for s in group.layer_strategies())


def evaluate_group(costs: MixedCosts, group: ReplicaGroup, seq_len: int, sync: Sequence[float],
                   schedule: str = "1f1b", overlap: Overlap = MIXED_OVERLAP) -> GroupEstimate:
    """One group's pipeline time, tail and per-stage memory: a pipeline (:func:`one_pipeline`) stage by
    stage on each stage's device; any other layout (data ranks, ZeRO, context parallelism,
    interleaving) by :meth:`CostModel.evaluate_stages` of its device type, at its slowest device's
    speed, ``sync`` (the cross-group all-reduce per pipeline rank) added to its own gradient sync."""
    if not one_pipeline(group):
        return _evaluate_layout(costs, group, seq_len, sync, schedule, overlap)
    mbs, m, pp = group.microbatch_size, group.num_microbatches, group.pp
    stages, times = [], []
    for j, (ranks, st) in enumerate(zip(group.blocks, group.stages)):
        cost = costs.of_rank(ranks[0])
        speed = costs.speed(ranks)
        s = group.anchor(j)
        c = costs.stage_cost(costs.group_of[ranks[0]], st.strategies, mbs, seq_len, j == 0, j == pp - 1, overlap,
                             None if st.strategies else s)
        p2p = 0.0
        if pp > 1:
            k = j + 1 if j + 1 < pp else j - 1
            p2p = p2p_time(costs, (ranks, s.tp), (group.blocks[k], group.stage_tp(k)), mbs, seq_len)
        t = (c.fwd + c.bwd) / speed + c.comm_fwd + c.comm_bwd + p2p
        work = cost.layer_work(s, mbs, seq_len)
        layer = cost.layer(s, work, overlap)
        exposed = float(cost.exposed_sync(sync[j], c.bwd / speed, st.num_layers))
        tail = exposed + c.optim / speed
        logits = cost.ends(replace(s, recompute=Recompute.NONE), work, False, True, overlap).transient
        mem = {"states": c.states, "activations": c.act * in_flight(schedule, pp, j, m), "transient": layer.transient,
               "logits": logits if j == pp - 1 else 0.0}
        mem["total"] = sum(mem.values())
        stages.append(StageEstimate(costs.group_of[ranks[0]], cost.cluster.device.name,
                                    (st.start, st.end), s.tp, str(s.recompute), t, tail, mem, cost.memory_budget,
                                    exposed))
        times.append(t)
    return GroupEstimate(group.share, m, pipeline_time(schedule, times, m), max(s.tail for s in stages), stages)


def _evaluate_layout(costs: MixedCosts, group: ReplicaGroup, seq_len: int, sync: Sequence[float], schedule: str,
                     overlap: Overlap) -> GroupEstimate:
    types = {costs.group_of[r] for r in group.ranks}
    if len(types) != 1:
        raise PlanError("a replica group with data ranks, ZeRO, context parallelism or interleaving runs on one "
                        f"device type, but this one spans {len(types)}; give each device type a group of its own")
    kind = types.pop()
    cost, speed = costs.on(group.ranks), costs.speed(group.ranks)
    ev = cost.evaluate_stages([st.strategies for st in group.stages], group.pp, schedule, group.num_microbatches,
                              group.virtual_stages, group.microbatch_size, seq_len, overlap, speed=speed,
                              cross_sync=sync)
    alone = cost.evaluate_stages([st.strategies for st in group.stages], group.pp, schedule, group.num_microbatches,
                                 group.virtual_stages, group.microbatch_size, seq_len, overlap, speed=speed)
    cross = max(0.0, ev.grad_sync - alone.grad_sync)  # what the all-reduce across groups adds to the tail
    stages = []
    for p in range(group.pp):
        chunk = group.stages[p]
        s = group.anchor(p)
        stages.append(StageEstimate(kind, cost.cluster.device.name, (chunk.start, chunk.end), s.tp,
                                    str(s.recompute), ev.stage_times[p], ev.grad_sync, ev.memory[p],
                                    cost.memory_budget, cross))
    return GroupEstimate(group.share, group.num_microbatches, ev.step_time - ev.grad_sync, ev.grad_sync, stages)


def evaluate_groups(plan: Plan, costs: MixedCosts) -> GroupsEvaluation:
    """Predict a plan's step: each group's pipeline, then the slowest one plus the largest tail."""
    sync = gradient_sync(costs, plan.groups)
    reps = [evaluate_group(costs, g, plan.seq_len, sync[i], str(plan.pipeline_schedule), plan.overlap)
            for i, g in enumerate(plan.groups)]
    step = max(r.pipeline_time for r in reps) + max(r.tail for r in reps)
    return GroupsEvaluation(step, plan.global_batch * plan.seq_len / step, reps)
