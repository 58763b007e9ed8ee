"""Pricing a HeteroPlan on a mixed cluster: one CostModel per device group, the links between groups.

Every number comes from the cost model (:class:`~flexmesh.cost.CostModel` of the stage's own device
group): a stage's layers, embedding and head (:meth:`CostModel.stage_cost` with strategy
``tp<stage tp>``, no data parallelism inside the replica), the pipeline sends and the gradient
all-reduce (:meth:`Hardware.collective_time` of the network they cross), the pipeline's step
(:func:`~flexmesh.cost.pipeline_time`), the in-flight micro-batches (:func:`~flexmesh.cost.in_flight`)
and the exposed part of the gradient sync (:meth:`CostModel.exposed_sync`). What this module adds is
which cost model and which network price each part:

- a stage runs on its TP group's device type; its compute (not its communication) slows down by
  the slowest device's speed factor, as in the simulator (flexmesh.sim.timeline);
- a collective between devices is priced on the slowest network it crosses: NVLink inside one node,
  the group's inter-node network inside one group, the link between groups (``MixedCluster.link``)
  across groups, as a group of ``size`` ranks with at most ``per_node`` of them on one node;
- each layer's gradient is all-reduced over the replicas holding it (one shard per TP rank; the
  holder with the smallest TP degree carries the largest shard), once per step after the last
  backward, partly hidden under it; the optimizer then updates each stage's parameters;
- replica step = its pipeline (``batch / microbatch`` micro-batches); plan step = the slowest
  replica's pipeline + the largest tail (exposed gradient sync + optimizer): the all-reduce is a
  barrier across the replicas.

The TP communication is priced overlapped with the GEMMs (:data:`flexmesh.plan.space.FASTEST`, the
options the uniform baselines are priced with), so plans of both kinds compare on one footing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from flexmesh.cost import CostModel, LayerCost, in_flight, pipeline_time
from flexmesh.cost.hardware import GroupShape
from flexmesh.layout.hetero import HeteroPlan, Replica, ReplicaStage
from flexmesh.layout.overlap import Overlap
from flexmesh.layout.strategy import LayerStrategy, Recompute
from flexmesh.plan.space import FASTEST
from flexmesh.spec.cluster import MixedCluster
from flexmesh.spec.model import ModelSpec
from flexmesh.units import GIB

HETERO_OVERLAP: Overlap = FASTEST


class MixedCosts:
    """One CostModel per device group of a mixed cluster, and one per link between groups (the slower
    group's device numbers with the link's bandwidth and latency as its inter-node network).

    >>> from flexmesh.spec.cluster import parse_mixed_cluster
    >>> from flexmesh.spec import parse_model
    >>> mc = MixedCosts(parse_model("tiny"), parse_mixed_cluster("1x8xH100+2x8xA100-40GB"))
    >>> [c.cluster.device.name for c in mc.groups], mc.network([0, 1])[1], mc.network([0, 8])[1]
    (['H100-80GB', 'A100-40GB'], GroupShape(size=2, per_node=2), GroupShape(size=2, per_node=1))
    """

    def __init__(self, model: ModelSpec, cluster: MixedCluster, groups: Sequence[CostModel] | None = None):
        self.model = model
        self.cluster = cluster
        self.groups = list(groups) if groups is not None else [CostModel(model, g) for g in cluster.groups]
        self._links: dict[tuple[int, int], CostModel] = {}
        self._stages: dict[tuple, LayerCost] = {}
        # Per rank, looked up for every stage and collective the search prices.
        ranks = range(cluster.world_size)
        self.group_of = [cluster.group_of(r) for r in ranks]
        self.node_of = [cluster.node_of(r) for r in ranks]
        self.speeds = [cluster.speed(r) for r in ranks]

    def stage_cost(self, group: int, s: LayerStrategy, layers: int, microbatch: int, seq_len: int, embed: bool,
                   head: bool) -> LayerCost:
        """:meth:`CostModel.stage_cost` of ``layers`` layers under ``s`` on the group's device (memoised)."""
        key = (group, s, layers, microbatch, seq_len, embed, head)
        if key not in self._stages:
            self._stages[key] = self.groups[group].stage_cost([s] * layers, microbatch, seq_len, embed, head,
                                                              HETERO_OVERLAP)
        return self._stages[key]

    def of_rank(self, rank: int) -> CostModel:
        return self.groups[self.group_of[rank]]

    def link(self, i: int, j: int) -> CostModel:
        """The cost model whose inter-node network is the link between groups ``i`` and ``j``."""
        key = (min(i, j), max(i, j))
        if key not in self._links:
            link = self.cluster.link(i, j)
            gi, gj = self.cluster.groups[key[0]], self.cluster.groups[key[1]]
            slow = gi if gi.device.node_net_gbps <= gj.device.node_net_gbps else gj
            device = replace(slow.device, node_net_gbps=link.gbps, inter_latency_us=link.latency_us)
            self._links[key] = CostModel(self.model, replace(slow, device=device, speed_factors=()))
        return self._links[key]

    def network(self, ranks: Iterable[int]) -> tuple[CostModel, GroupShape]:
        """The cost model of the slowest network ``ranks`` cross and their group shape on it."""
        ranks = list(ranks)
        groups = sorted({self.group_of[r] for r in ranks})
        per_node = max(Counter(self.node_of[r] for r in ranks).values())
        shape = GroupShape(len(ranks), per_node)
        if len(groups) == 1:
            return self.groups[groups[0]], shape
        pairs = [(a, b) for i, a in enumerate(groups) for b in groups[i + 1:]]
        slowest = min(pairs, key=lambda p: (self.cluster.link(*p).gbps, -self.cluster.link(*p).latency_us))
        return self.link(*slowest), shape

    def speed(self, devices: Iterable[int]) -> float:
        """A TP group computes at its slowest member's speed."""
        return min(self.speeds[d] for d in devices)


def stage_strategy(stage: ReplicaStage) -> LayerStrategy:
    return LayerStrategy(tp=stage.tp, dp=1, zero=0, recompute=stage.recompute)


@dataclass
class StageEstimate:
    """One stage of one replica: per micro-batch time, the step's tail, and memory (bytes)."""

    group: int
    device: str
    layers: tuple[int, int]
    tp: int
    recompute: str
    time: float  # one micro-batch, fwd + bwd + exposed communication + pipeline sends, s
    tail: float  # exposed gradient sync + optimizer after the pipeline drains, s
    memory: dict[str, float]
    budget: float

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.budget


@dataclass
class ReplicaEstimate:
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
class HeteroEvaluation:
    step_time: float
    tokens_per_s: float
    replicas: list[ReplicaEstimate]
    extra: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return all(s.fits for r in self.replicas for s in r.stages)

    def over_budget(self) -> list[tuple[int, int, StageEstimate]]:
        """(replica, stage, estimate) of every stage whose memory exceeds its device's budget."""
        return [(i, j, s) for i, r in enumerate(self.replicas) for j, s in enumerate(r.stages) if not s.fits]

    def to_dict(self) -> dict:
        """The plan file's ``predicted`` section: seconds and GiB, per replica."""
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


def p2p_time(costs: MixedCosts, a: ReplicaStage, b: ReplicaStage, microbatch: int, seq_len: int) -> float:
    """Send + receive of one micro-batch's boundary activations between two stages, forward and
    backward, on the network between them (the sequence-parallel shard of the smaller TP group)."""
    cost, shape = costs.network([a.devices[0], b.devices[0]])
    work = cost.layer_work(LayerStrategy(tp=min(a.tp, b.tp)), microbatch, seq_len)
    nbytes = work.tokens / min(a.tp, b.tp) * costs.model.hidden * costs.model.dtype_bytes
    return 2 * float(cost.hw.collective_time("send_recv", nbytes, shape))


def gradient_sync(costs: MixedCosts, replicas: Sequence[Replica]) -> list[list[float]]:
    """Seconds of the once-per-step gradient all-reduce of each (replica, stage), over the replicas
    holding each of its layers, its embedding (first stages) and its head (last stages)."""
    m = costs.model
    out = [[0.0] * r.pp for r in replicas]
    if len(replicas) < 2:
        return out

    def all_reduce(holders: list[tuple[int, int]], params: float) -> float:
        stages = [replicas[i].stages[j] for i, j in holders]
        cost, shape = costs.network(s.devices[0] for s in stages)
        nbytes = params / min(s.tp for s in stages) * cost.grad_bytes
        return float(cost.hw.collective_time("all_reduce", nbytes, shape))

    # Layers with the same holders form one segment (the stage boundaries of every replica cut them).
    cuts = sorted({0, replicas[0].num_layers} | {s.end for r in replicas for s in r.stages})
    for a, b in zip(cuts, cuts[1:]):
        holders = [(i, r.stage_of_layer(a)) for i, r in enumerate(replicas)]
        t = all_reduce(holders, m.layer_params) * (b - a)
        for i, j in holders:
            out[i][j] += t
    first = [(i, 0) for i in range(len(replicas))]
    last = [(i, r.pp - 1) for i, r in enumerate(replicas)]
    t_embed = all_reduce(first, m.embedding_params)
    for i, j in first:
        out[i][j] += t_embed
    # A tied head on another stage than the embedding keeps its own copy (as CostModel.ends prices it).
    for i, j in last:
        tied = m.vocab * m.hidden if m.tie_embeddings and replicas[i].pp > 1 else 0
        out[i][j] += all_reduce(last, m.head_params + tied)
    return out


def evaluate_replica(costs: MixedCosts, replica: Replica, seq_len: int, sync: Sequence[float],
                     schedule: str = "1f1b") -> ReplicaEstimate:
    """One replica's pipeline time, tail and per-stage memory, each stage priced by its own device."""
    mbs, m, pp = replica.microbatch_size, replica.num_microbatches, replica.pp
    stages, times = [], []
    for j, st in enumerate(replica.stages):
        cost = costs.of_rank(st.devices[0])
        speed = costs.speed(st.devices)
        s = stage_strategy(st)
        c = costs.stage_cost(costs.group_of[st.devices[0]], s, st.num_layers, mbs, seq_len, j == 0, j == pp - 1)
        p2p = 0.0
        if pp > 1:
            other = replica.stages[j + 1] if j + 1 < pp else replica.stages[j - 1]
            p2p = p2p_time(costs, st, other, mbs, seq_len)
        t = (c.fwd + c.bwd) / speed + c.comm_fwd + c.comm_bwd + p2p
        work = cost.layer_work(s, mbs, seq_len)
        layer = cost.layer(s, work, HETERO_OVERLAP)
        tail = float(cost.exposed_sync(sync[j], c.bwd / speed, st.num_layers)) + c.optim / speed
        logits = cost.ends(replace(s, recompute=Recompute.NONE), work, False, True, HETERO_OVERLAP).transient
        mem = {"states": c.states, "activations": c.act * in_flight(schedule, pp, j, m), "transient": layer.transient,
               "logits": logits if j == pp - 1 else 0.0}
        mem["total"] = sum(mem.values())
        stages.append(StageEstimate(costs.group_of[st.devices[0]], cost.cluster.device.name,
                                    (st.start, st.end), st.tp, str(st.recompute), t, tail, mem, cost.memory_budget))
        times.append(t)
    return ReplicaEstimate(replica.batch, m, pipeline_time(schedule, times, m), max(s.tail for s in stages), stages)


def evaluate_hetero(plan: HeteroPlan, costs: MixedCosts) -> HeteroEvaluation:
    """Predict a HeteroPlan's step: each replica's pipeline, then the slowest one plus the largest tail."""
    sync = gradient_sync(costs, plan.replicas)
    reps = [evaluate_replica(costs, r, plan.seq_len, sync[i], str(plan.pipeline_schedule))
            for i, r in enumerate(plan.replicas)]
    step = max(r.pipeline_time for r in reps) + max(r.tail for r in reps)
    return HeteroEvaluation(step, plan.global_batch * plan.seq_len / step, reps)
