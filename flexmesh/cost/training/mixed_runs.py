"""Published training runs on mixed-GPU clusters, replayed through the mixed cluster's prices.

Two systems published every run's plan beside its measured iteration time, in their repositories' result files:

- AMP (Li et al., NeurIPS'22, 2210.07297; github.com/DachengLi1/AMP ``src/results/het_cluster_results.txt`` and
  ``homogeneous_results.txt``): GPT-2 medium (24 layers, hidden 1024, 16 heads, sequences of 1024, vocabulary 52256,
  tied head), fp16, 32 sequences per step, on DeepSpeed 0.3.13's pipeline engine with Megatron-LM v1.1.5's layers;
  the mixed cluster three p3.8xlarge (4 V100-16GB each, NVLink, 10 Gb/s) and one g4dn.12xlarge (4 T4, PCIe, 50 Gb/s),
  the homogeneous one four g4dn.12xlarge. Each row: pp, dp, tp, micro-batch size, the layer partition over
  DeepSpeed's 30 layer specs (0 the embedding, 1 a transpose, 2-25 the transformer layers, 26-29 the transpose, final
  norm, tied head and cast) and the mean iteration time over iterations 20-39, rounded to 0.01 s. Ranks follow
  DeepSpeed's order (pipeline outermost, tp innermost), the three V100 nodes first, so the last stages run on the T4s.
  AMP's partitions that hold only the embedding or only a transpose in a stage failed to run (no time).
- Sailor (Strati et al., SOSP'25, 2504.17096; github.com/eth-easl/sailor
  ``sailor/Planner/simulations/validation/mit/N*/plan_config_*.json``, field ``real``): OPT-350M as Megatron's GPT
  (24 layers, hidden 1024, 16 heads, sequences of 2048, vocabulary 50272), fp32 (its launch passes no fp16 or bf16
  flag), micro-batches of 2, on Sailor's Megatron-DeepSpeed, over nodes of 8 RTX-3090, TITAN RTX or RTX 2080 Ti (the
  11 GB part its cluster file lists); a stage's data-parallel replicas are whole nodes each running tp inside it.
  Its measured network profile of these nodes (``sailor/providers/multizone_bandwidths_het.json``, the plateau of
  each pair's fitted transfer rate) gives 2.86 GB/s between TITAN RTX and RTX 2080 Ti nodes and 0.115 GB/s (a
  1 Gb/s link) to and from the RTX 3090 node; the links inside a node are the catalogue's (PCIe, bridged pairs).
  One run (N6 D2) repeats another's time, memory and gradient time to the last digit and is left out.

:func:`replay` prices a run as flexmesh prices any mixed plan (flexmesh.cost.training.mixed): one replica group per
data-parallel replica, each a pipeline over its stages' devices, the gradient all-reduce across them.
``python -m bench.published_mixed`` prints every row and the error per system.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

from flexmesh.cost.training.mixed import MixedCosts, evaluate_groups
from flexmesh.cost.training.parts import Parts
from flexmesh.layout.enums import PipelineSchedule
from flexmesh.layout.group import ReplicaGroup, StagePlan
from flexmesh.layout.plan import Plan
from flexmesh.layout.stack import DEEPSPEED_PIPE, Stack
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.cluster import MixedCluster, mixed_cluster_from_mapping
from flexmesh.spec.model import ModelSpec, gpt, with_dtype

# How both stacks ran a layer: Megatron-LM v1's unfused softmax attention, tensor parallelism without sequence
# parallelism, dropout, under DeepSpeed's pipeline engine (flexmesh.layout.stack).
MEGATRON_V1 = Stack(attention="unfused", sequence_parallel=False, dropout=True, framework=DEEPSPEED_PIPE)
# Each system's run settings on it: AMP's DeepSpeed config all-reduces its fp16 gradients in fp32
# (DeepSpeedExamples/Megatron-LM-v1.1.5-3D_parallelism/examples/ds_config.json at 49afb8b: "fp32_allreduce": true);
# Sailor trains in fp32, its gradients 4 bytes anyway.
RUN_STACKS = {"AMP": replace(MEGATRON_V1, fp32_grad_reduce=True), "Sailor": MEGATRON_V1}


@dataclass(frozen=True)
class MixedRun:
    """One published run: its plan as stages of layers, each stage's data-parallel replicas' device types, and the
    measured seconds per iteration."""

    system: str
    name: str
    model: ModelSpec
    seq_len: int
    global_batch: int
    micro_batch: int
    tp: int
    stages: tuple[tuple[int, int], ...]  # [start, end) transformer layers per pipeline stage
    devices: tuple[tuple[str, ...], ...]  # per stage, the device type of each data-parallel replica
    cluster: str  # the network the system's nodes had ("amp" or "sailor")
    seconds: float
    homogeneous: bool = False

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def dp(self) -> int:
        return len(self.devices[0])

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)


# ---- AMP -----------------------------------------------------------------------------------------------------
GPT2_MEDIUM = with_dtype(gpt(24, 1024, 16, 52256), "fp16")
# DeepSpeed's layer specs: 0 the embedding, 1 a transpose, 2..25 the transformer layers, 26.. the head's
_FIRST_LAYER_SPEC = 2
# (name, pp, dp, tp, micro-batch, partition over the 30 layer specs, seconds); failed runs are left out
_AMP_MIXED = [
    ("A1", 4, 4, 1, 1, (0, 7, 14, 20, 30), 1.47), ("A2", 8, 2, 1, 1, (0, 5, 9, 12, 15, 18, 21, 24, 30), 1.28),
    ("A3", 16, 1, 1, 1, (0, 3, 5, 7, 9, 11, 13, 15, 16, 17, 19, 20, 21, 22, 23, 25, 30), 1.52),
    ("A4", 4, 4, 1, 2, (0, 7, 14, 20, 30), 1.53), ("A5", 8, 2, 1, 2, (0, 5, 9, 12, 14, 17, 20, 23, 30), 1.54),
    ("A6", 16, 1, 1, 2, (0, 3, 5, 7, 9, 11, 13, 14, 16, 18, 19, 20, 21, 23, 24, 25, 30), 1.58),
    ("A7", 4, 4, 1, 4, (0, 6, 13, 20, 30), 1.71), ("A8", 2, 8, 1, 1, (0, 14, 30), 2.23),
    ("A9", 4, 2, 2, 1, (0, 8, 14, 20, 30), 2.8), ("A10", 8, 2, 1, 4, (0, 3, 7, 11, 14, 17, 20, 23, 30), 1.71),
    ("A12", 8, 1, 2, 1, (0, 5, 8, 11, 14, 17, 20, 23, 30), 3.81), ("A13", 2, 8, 1, 2, (0, 14, 30), 2.26),
    ("A14", 2, 4, 2, 1, (0, 14, 30), 2.89), ("A15", 4, 2, 2, 2, (0, 8, 14, 20, 30), 2.37),
    ("A16", 2, 8, 1, 4, (0, 14, 30), 2.34), ("A17", 8, 1, 2, 2, (0, 5, 8, 11, 14, 17, 20, 23, 30), 3.36),
    ("A18", 2, 4, 2, 2, (0, 14, 30), 2.5), ("A19", 1, 8, 2, 1, (0, 30), 3.13), ("A20", 1, 8, 2, 2, (0, 30), 3.06),
    ("A21", 1, 8, 2, 4, (0, 30), 3.03), ("A22", 1, 16, 1, 1, (0, 30), 2.9),
    ("A24", 4, 4, 1, 8, (0, 8, 14, 20, 30), 2.07), ("A25", 2, 4, 2, 4, (0, 14, 30), 2.41),
    ("A26", 4, 2, 2, 4, (0, 8, 14, 20, 30), 1.65), ("A29", 8, 1, 2, 4, (0, 5, 8, 11, 14, 17, 20, 23, 30), 1.79),
    ("A31", 1, 4, 4, 1, (0, 30), 3.8), ("A32", 1, 4, 4, 2, (0, 30), 3.56), ("A33", 1, 4, 4, 4, (0, 30), 3.29),
    ("A34", 1, 4, 4, 8, (0, 30), 3.27), ("A36", 2, 2, 4, 2, (0, 14, 30), 3.29),
    ("A37", 4, 1, 4, 2, (0, 8, 14, 20, 30), 3.92), ("A38", 2, 2, 4, 4, (0, 14, 30), 2.66),
    ("A39", 2, 4, 2, 8, (0, 14, 30), 2.45), ("A40", 4, 1, 4, 4, (0, 8, 14, 20, 30), 2.05),
    ("A41", 4, 2, 2, 8, (0, 8, 14, 20, 30), 1.91), ("A42", 2, 2, 4, 8, (0, 14, 30), 2.71),
    ("A43", 8, 1, 2, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 2.12), ("A44", 4, 1, 4, 8, (0, 8, 14, 20, 30), 2.13),
    ("A47", 2, 2, 4, 16, (0, 14, 30), 2.66), ("A48", 4, 2, 2, 16, (0, 8, 14, 20, 30), 2.33),
    ("A49", 4, 1, 4, 16, (0, 8, 14, 20, 30), 2.49), ("A50", 8, 1, 2, 16, (0, 5, 8, 11, 14, 17, 20, 23, 30), 2.69),
    ("A52", 4, 1, 4, 32, (0, 8, 14, 20, 30), 3.13),
]
_AMP_T4 = [
    ("H1", 1, 16, 1, 1, (0, 30), 1.32), ("H3", 2, 8, 1, 1, (0, 15, 30), 1.28),
    ("H4", 4, 4, 1, 1, (0, 9, 15, 21, 30), 1.2), ("H5", 8, 2, 1, 1, (0, 6, 9, 12, 15, 18, 21, 24, 30), 1.23),
    ("H6", 2, 8, 1, 2, (0, 15, 30), 1.38),
    ("H7", 16, 1, 1, 1, (0, 4, 6, 8, 10, 12, 14, 16, 17, 18, 19, 20, 21, 22, 23, 25, 30), 1.55),
    ("H8", 4, 4, 1, 2, (0, 9, 15, 21, 30), 1.41), ("H9", 8, 2, 1, 2, (0, 5, 9, 12, 15, 18, 21, 24, 30), 1.43),
    ("H10", 2, 8, 1, 4, (0, 14, 30), 1.72),
    ("H11", 16, 1, 1, 2, (0, 4, 6, 8, 10, 12, 14, 16, 17, 18, 19, 20, 21, 22, 23, 25, 30), 1.76),
    ("H12", 1, 8, 2, 1, (0, 30), 1.76), ("H13", 1, 8, 2, 2, (0, 30), 1.64), ("H14", 1, 8, 2, 4, (0, 30), 1.55),
    ("H15", 2, 4, 2, 1, (0, 14, 30), 1.68), ("H16", 4, 2, 2, 1, (0, 8, 14, 20, 30), 1.74),
    ("H17", 4, 4, 1, 4, (0, 9, 15, 21, 30), 1.85), ("H18", 8, 1, 2, 1, (0, 5, 8, 11, 14, 17, 20, 23, 30), 1.95),
    ("H19", 2, 4, 2, 2, (0, 14, 30), 1.61), ("H20", 8, 2, 1, 4, (0, 5, 9, 12, 15, 18, 21, 24, 30), 1.88),
    ("H21", 4, 2, 2, 2, (0, 8, 14, 20, 30), 1.66),
    ("H22", 16, 1, 1, 4, (0, 4, 6, 8, 10, 12, 14, 16, 17, 18, 19, 20, 21, 22, 23, 25, 30), 2.19),
    ("H23", 8, 1, 2, 2, (0, 5, 8, 11, 14, 17, 20, 23, 30), 1.85), ("H24", 2, 4, 2, 4, (0, 14, 30), 1.79),
    ("H25", 4, 2, 2, 4, (0, 8, 14, 20, 30), 1.89), ("H26", 1, 4, 4, 1, (0, 30), 2.48),
    ("H27", 1, 4, 4, 2, (0, 30), 2.13), ("H28", 1, 4, 4, 4, (0, 30), 1.98), ("H29", 1, 4, 4, 8, (0, 30), 1.94),
    ("H30", 4, 4, 1, 8, (0, 8, 14, 20, 30), 2.7), ("H31", 8, 1, 2, 4, (0, 5, 8, 11, 14, 17, 20, 23, 30), 2.09),
    ("H32", 2, 2, 4, 1, (0, 14, 30), 2.61), ("H33", 2, 4, 2, 8, (0, 14, 30), 2.13),
    ("H34", 4, 1, 4, 1, (0, 8, 14, 20, 30), 2.67), ("H35", 2, 2, 4, 2, (0, 14, 30), 2.12),
    ("H36", 8, 2, 1, 8, (0, 5, 9, 12, 15, 18, 21, 24, 30), 2.92), ("H37", 4, 1, 4, 2, (0, 8, 14, 20, 30), 2.22),
    ("H38", 2, 2, 4, 4, (0, 14, 30), 2.1),
    ("H39", 16, 1, 1, 8, (0, 4, 6, 8, 10, 12, 14, 16, 17, 18, 19, 20, 21, 22, 23, 25, 30), 3.25),
    ("H40", 4, 2, 2, 8, (0, 8, 14, 20, 30), 2.5), ("H41", 4, 1, 4, 4, (0, 8, 14, 20, 30), 2.24),
    ("H42", 2, 2, 4, 8, (0, 14, 30), 2.4), ("H43", 8, 1, 2, 8, (0, 5, 8, 11, 14, 17, 20, 23, 30), 2.81),
    ("H44", 4, 1, 4, 8, (0, 8, 14, 20, 30), 2.69), ("H45", 2, 2, 4, 16, (0, 14, 30), 3.03),
    ("H47", 4, 2, 2, 16, (0, 8, 14, 20, 30), 3.74), ("H49", 8, 1, 2, 16, (0, 5, 8, 11, 14, 17, 20, 23, 30), 4.29),
    ("H50", 4, 1, 4, 16, (0, 8, 14, 20, 30), 3.7),
]
# AMP's partitions holding the embedding alone and then a stage of a transpose alone (no transformer layer: a relay),
# which failed to run (``r_cost: inf``): no time, but a plan flexmesh must express; the same on 16 T4 (H48)
_AMP_RELAYS = [
    ("A11", 16, 1, 1, 4, (0, 1, 2, 3, 4, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 30), float("nan")),
    ("A35", 16, 1, 1, 8, (0, 1, 2, 3, 4, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 30), float("nan")),
    ("A46", 16, 1, 1, 16, (0, 1, 2, 3, 4, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 30), float("nan")),
]
# AMP's nodes: p3.8xlarge (4 V100-SXM2-16GB on NVLink, 10 Gb/s) and g4dn.12xlarge (4 T4 on PCIe, 50 Gb/s); AMP's
# cluster model (src/het_cluster.py) joins the two kinds at the slower 10 Gb/s
_AMP_NODES = {"V100-16GB": 1.25, "T4": 6.25}
_AMP_NODE_GPUS = 4
_AMP_MIXED_ORDER = ("V100-16GB",) * 12 + ("T4",) * 4  # ranks in the hostfile's order: the V100 nodes first


def _deepspeed_rank(stage: int, replica: int, dp: int, tp: int) -> int:
    """DeepSpeed's rank order (pipeline outermost, tp innermost): the first rank of ``replica`` of ``stage``."""
    return stage * dp * tp + replica * tp


def _amp_stages(partition: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Transformer layers [start, end) per stage of a partition over DeepSpeed's layer specs."""
    def layer(spec: int) -> int:
        return min(max(spec - _FIRST_LAYER_SPEC, 0), GPT2_MEDIUM.num_layers)
    return tuple((layer(a), layer(b)) for a, b in zip(partition, partition[1:]))


def _amp(rows: list, order: tuple[str, ...], homogeneous: bool) -> list[MixedRun]:
    out = []
    for name, pp, dp, tp, mbs, partition, seconds in rows:
        devices = tuple(tuple(order[_deepspeed_rank(p, d, dp, tp)] for d in range(dp)) for p in range(pp))
        out.append(MixedRun("AMP", name, GPT2_MEDIUM, 1024, 32, mbs, tp, _amp_stages(partition), devices, "amp",
                            seconds, homogeneous))
    return out


# ---- Sailor ----------------------------------------------------------------------------------------------------
OPT_350M = with_dtype(gpt(24, 1024, 16, 50272), "fp32")
_R30, _TITAN, _R20 = "RTX-3090", "TITAN-RTX", "RTX-2080Ti"
# Each node's network, GB/s per direction (the module doc's profile)
_SAILOR_NODES = {_R30: 0.115, _TITAN: 2.86, _R20: 2.86}
# (name, tp, global batch, transformer layers per stage, each stage's replicas' devices, seconds)
_SAILOR = [
    ("S1 (N2 D1)", 2, 256, (11, 13), ((_R30,), (_TITAN,)), 119.83914),
    ("S2 (N2 D2)", 2, 256, (24,), ((_TITAN, _R30),), 91.78),
    ("S3 (N3 D1)", 8, 144, (7, 9, 8), ((_R30,), (_R20,), (_TITAN,)), 59.45533),
    ("S4 (N4 D1)", 8, 256, (4, 7, 7, 6), ((_R30,), (_R20,), (_TITAN,), (_R20,)), 83.76622),
    ("S5 (N4 D2)", 8, 256, (11, 13), ((_R30, _R20), (_TITAN, _R20)), 66.06712),
    ("S6 (N4 D4)", 8, 256, (24,), ((_R30, _R20, _TITAN, _R20),), 83.45238),
    ("S8 (N6 D3)", 8, 288, (11, 13), ((_R30, _R20, _R20), (_TITAN, _R20, _TITAN)), 54.2392),
    ("S9 (N6 D6)", 8, 288, (24,), ((_R30, _R20, _R20, _TITAN, _R20, _TITAN),), 70.78508),
]


def _sailor() -> list[MixedRun]:
    out = []
    for name, tp, batch, counts, devices, seconds in _SAILOR:
        ends = [sum(counts[:i + 1]) for i in range(len(counts))]
        stages = tuple((0 if i == 0 else ends[i - 1], e) for i, e in enumerate(ends))
        out.append(MixedRun("Sailor", name, OPT_350M, 2048, batch, 2, tp, stages, devices, "sailor", seconds))
    return out


@cache
def published_runs() -> tuple[MixedRun, ...]:
    """Every published run with a measured time: AMP's mixed and T4 runs, then Sailor's."""
    return tuple(_amp(_AMP_MIXED, _AMP_MIXED_ORDER, False) + _amp(_AMP_T4, ("T4",) * 16, True) + _sailor())


def relay_runs() -> tuple[MixedRun, ...]:
    """AMP's mixed partitions with a stage of no transformer layer (no measured time: they failed to run)."""
    return tuple(_amp(_AMP_RELAYS, _AMP_MIXED_ORDER, False))


def run_cluster(run: MixedRun) -> tuple[MixedCluster, list[list[list[int]]]]:
    """The run's cluster (one device group per type, nodes in first-use order, one node per stage replica for
    Sailor, AMP's four-GPU nodes) and each (stage, replica)'s ranks on it."""
    if run.cluster == "amp":
        # DeepSpeed's rank order, four ranks per node; consecutive nodes of one type form a device group
        ranks = [[[_deepspeed_rank(p, d, run.dp, run.tp) + k for k in range(run.tp)] for d in range(run.dp)]
                 for p in range(run.pp)]
        order = [run.devices[p][d] for p in range(run.pp) for d in range(run.dp) for _ in range(run.tp)]
        nodes = [order[i] for i in range(0, len(order), _AMP_NODE_GPUS)]
        groups: list[dict] = []
        for kind in nodes:
            if groups and groups[-1]["device"]["base"] == kind:
                groups[-1]["nodes"] += 1
            else:
                groups.append({"nodes": 1, "devices_per_node": _AMP_NODE_GPUS,
                               "device": {"base": kind, "node_net_gbps": _AMP_NODES[kind]}})
        links = {"gbps": min(_AMP_NODES[k] for k in nodes), "latency_us": 20.0} if len(groups) > 1 else {}
        return mixed_cluster_from_mapping({"groups": groups, "links": links}, f"AMP {run.name}"), ranks
    # Sailor: every (stage, replica) is a node of tp devices; number the nodes type by type
    types = list(dict.fromkeys(t for stage in run.devices for t in stage))
    count = {t: sum(stage.count(t) for stage in run.devices) for t in types}
    first = {t: sum(count[u] for u in types[:i]) for i, t in enumerate(types)}
    used = dict.fromkeys(types, 0)
    ranks = []
    for stage in run.devices:
        row = []
        for t in stage:
            node = first[t] + used[t]
            used[t] += 1
            row.append(list(range(node * run.tp, (node + 1) * run.tp)))
        ranks.append(row)
    groups = [{"nodes": count[t], "devices_per_node": run.tp,
               "device": {"base": t, "node_net_gbps": _SAILOR_NODES[t]}} for t in types]
    return mixed_cluster_from_mapping({"groups": groups}, f"Sailor {run.name}"), ranks


def run_plan(run: MixedRun) -> tuple[Plan, MixedCluster]:
    """The run as a plan of one pipeline per data-parallel replica (dp 1 each, ``tp`` per stage)."""
    cluster, ranks = run_cluster(run)
    s = LayerStrategy(tp=run.tp)
    stages = tuple(StagePlan(a, b, (s,) * (b - a)) for a, b in run.stages)
    share = run.global_batch // run.dp
    groups = tuple(ReplicaGroup(tuple(tuple(ranks[p][d]) for p in range(run.pp)), stages, run.microbatches, share)
                   for d in range(run.dp))
    plan = Plan(run.model.name, cluster.label, cluster.world_size, run.seq_len, run.global_batch,
                PipelineSchedule.ONE_F_ONE_B, groups)
    return plan, cluster


@cache
def _costs(model: ModelSpec, cluster: MixedCluster, stack: Stack) -> MixedCosts:
    return MixedCosts(model, cluster, parts=Parts(stack=stack))


def replay(run: MixedRun, stack: Stack | None = None) -> float:
    """The predicted seconds per iteration of ``run`` with its layers run as ``stack`` runs them (default: as its
    system ran them, :data:`RUN_STACKS`)."""
    plan, cluster = run_plan(run)
    return evaluate_groups(plan, _costs(run.model, cluster, stack or RUN_STACKS[run.system])).step_time

