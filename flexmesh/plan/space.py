"""What the search may choose from, and the pieces the search and the uniform baselines share.

- :class:`SearchSpace`: which choices are allowed; :class:`SearchRequest`: one question to answer
  (model, cluster, sequence length, global batch, space, cost model, how many plans, which method).
- :func:`candidate_strategies`: every strategy one layer may take on a pipeline stage;
  :func:`outer_configurations`: every (pp, pipeline schedule, v, m) the search examines.
- :func:`evaluate_chunks` / :func:`to_plan`: price per-chunk strategies with the cost model and
  turn them into a :class:`~flexmesh.layout.plan.Plan`; :class:`Candidate` holds both.

Nothing here searches; flexmesh.plan.search and flexmesh.plan.baselines both stand on this module
and neither imports the other.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import product

from flexmesh.cost import CostModel, Evaluation
from flexmesh.errors import PlanError
from flexmesh.layout.enums import CPKind, PipelineSchedule
from flexmesh.layout.plan import PIPELINE_SCHEDULES, Plan, StagePlan
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import ModelSpec

Chunk = tuple[LayerStrategy, ...]  # the strategies of one pipeline chunk's layers, in layer order
Mesh = tuple  # (tp, cp, cp_kind, dp): what transitions and pipeline sends depend on
SEARCH_MODES = ("auto", "exact", "fast")


@dataclass(frozen=True)
class SearchSpace:
    """Which choices the search may make. The defaults are the full space."""

    pipeline_schedules: tuple[str, ...] = PIPELINE_SCHEDULES
    cp_kinds: tuple[str, ...] = ("ulysses", "ring")
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[bool, ...] = (False, True)
    max_tp: int | None = None
    max_cp: int | None = None
    pp: tuple[int, ...] | None = None  # None: every power of two <= min(world, layers) dividing world
    microbatches: tuple[int, ...] | None = None  # None: every divisor of the global batch
    same_mesh: bool = False  # every layer of every stage on one (tp, cp, dp) mesh, as the runtime runs


FULL_SPACE = SearchSpace()


@dataclass(frozen=True)
class SearchRequest:
    """One search: what to plan for, within which space, priced by which cost model.

    ``cost`` None means the preset cost model of (model, cluster), built once by :meth:`resolved`.
    ``top`` is how many plans to return; ``mode`` picks the method: "exact" (layer DP + every layer
    split), "fast" (closed form per rank + balanced splits) or "auto" (exact on small problems).

    >>> from flexmesh.spec import MODEL_PRESETS, parse_cluster
    >>> r = SearchRequest(MODEL_PRESETS["tiny"], parse_cluster("2xA100-80GB"), 1024, 8).resolved()
    >>> (r.world_size, r.mode, r.cost is not None)
    (2, 'auto', True)
    """

    model: ModelSpec
    cluster: ClusterSpec
    seq_len: int
    global_batch: int
    space: SearchSpace = FULL_SPACE
    cost: CostModel | None = None
    top: int = 5
    mode: str = "auto"

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    def resolved(self) -> SearchRequest:
        """This request with its cost model built, so the search and the baselines share one."""
        return self if self.cost is not None else replace(self, cost=CostModel(self.model, self.cluster))

    def cost_model(self) -> CostModel:
        """The request's cost model (call :meth:`resolved` first to build it only once)."""
        return self.cost if self.cost is not None else CostModel(self.model, self.cluster)

    def check(self) -> None:
        """Raise PlanError on inputs no search can answer (before any work is spent on them)."""
        if self.seq_len < 1 or self.global_batch < 1:
            raise PlanError(f"--seq-len and --global-batch must be positive, got {self.seq_len} and "
                            f"{self.global_batch}")
        if self.mode not in SEARCH_MODES:
            raise PlanError(f"search mode must be exact, fast or auto, got {self.mode!r}")


@dataclass(frozen=True)
class Candidate:
    """A plan with its evaluation by the cost model."""

    plan: Plan
    evaluation: Evaluation
    origin: str = "search"  # "search", or the baseline that won ("megatron-3d", "zero3-ulysses")
    estimate: float = math.nan  # the search's own step-time figure (equals evaluation.step_time)


# ---- small integer helpers -----------------------------------------------------------------------
def pow2_upto(n: int) -> list[int]:
    """Powers of two up to ``n``.

    >>> pow2_upto(12)
    [1, 2, 4, 8]
    """
    return [1 << i for i in range(n.bit_length()) if (1 << i) <= n]


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending.

    >>> divisors(12)
    [1, 2, 3, 4, 6, 12]
    """
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_of(s: LayerStrategy) -> Mesh:
    """The device mesh a strategy runs on; strategies on one mesh differ only in ZeRO and recompute."""
    return (s.tp, s.cp, s.cp_kind, s.dp)


# ---- candidate strategies and outer configurations ---------------------------------------------------
def candidate_strategies(model: ModelSpec, cluster: ClusterSpec, devices: int, space: SearchSpace = FULL_SPACE,
                         microbatch_seqs: int | None = None) -> list[LayerStrategy]:
    """Every strategy one layer may take on a stage of ``devices`` devices.

    tp: powers of two within a node dividing the heads (and the KV heads, or divided by them);
    cp: powers of two, Ulysses only when the heads split over tp x cp; dp fills the rest and must
    divide the micro-batch; ZeRO above 0 only when states are replicated (dp x cp > 1).

    >>> from flexmesh.spec import MODEL_PRESETS, parse_cluster
    >>> ss = candidate_strategies(MODEL_PRESETS["tiny"], parse_cluster("2xA100-80GB"), 2)
    >>> [str(s) for s in ss if not s.recompute and s.zero in (0, 3)]
    ['tp1-dp2z0', 'tp1-dp2z3', 'tp1-u2-dp1z0', 'tp1-u2-dp1z3', 'tp1-r2-dp1z0', 'tp1-r2-dp1z3', 'tp2-dp1z0']
    """
    return [s for s in _candidates(model, cluster, devices, space)
            if microbatch_seqs is None or microbatch_seqs % s.dp == 0]


@lru_cache(maxsize=256)
def _candidates(model: ModelSpec, cluster: ClusterSpec, devices: int, space: SearchSpace) -> tuple[LayerStrategy, ...]:
    # Cached: the search asks for the same stage size under every schedule and micro-batch count.
    out = []
    max_tp = min(cluster.devices_per_node, devices, space.max_tp or devices)
    for tp in pow2_upto(max_tp):
        if model.num_heads % tp or not (model.num_kv_heads % tp == 0 or tp % model.num_kv_heads == 0):
            continue
        for cp in pow2_upto(min(devices // tp, space.max_cp or devices)):
            if devices % (tp * cp):
                continue
            dp = devices // (tp * cp)
            kinds = [CPKind.NONE] if cp == 1 else [
                CPKind(k) for k in space.cp_kinds if k != "ulysses" or model.num_heads % (tp * cp) == 0]
            for kind in kinds:
                zeros = [z for z in space.zero_stages if z == 0 or dp * cp > 1] or [0]
                for z, ac in product(zeros, space.recompute):
                    out.append(LayerStrategy(tp=tp, cp=cp, cp_kind=kind, dp=dp, zero=z, recompute=ac))
    return tuple(out)


def outer_configurations(model: ModelSpec, world: int, global_batch: int,
                         space: SearchSpace) -> Iterator[tuple[int, str, int, int]]:
    """(pp, pipeline schedule, v, m) tuples the search examines.

    pp = 1 runs only as 1F1B (gradient accumulation; GPipe holds more and interleaving needs pp > 1);
    interleaving uses two chunks per rank and, as Megatron requires, m divisible by pp.

    >>> from flexmesh.spec import MODEL_PRESETS
    >>> list(outer_configurations(MODEL_PRESETS["tiny"], 2, 2, SearchSpace(pipeline_schedules=("1f1b", "interleaved"))))
    [(1, '1f1b', 1, 1), (1, '1f1b', 1, 2), (2, '1f1b', 1, 1), (2, '1f1b', 1, 2), (2, 'interleaved', 2, 2)]
    """
    pps = space.pp or [p for p in pow2_upto(min(world, model.num_layers)) if world % p == 0]
    for pp in pps:
        if world % pp or pp > model.num_layers:
            continue
        for schedule in space.pipeline_schedules:
            if pp == 1 and schedule != "1f1b":
                continue
            v = 2 if schedule == "interleaved" else 1
            if model.num_layers < pp * v:
                continue
            for m in space.microbatches or divisors(global_batch):
                if global_batch % m or (schedule == "interleaved" and m % pp):
                    continue
                yield pp, schedule, v, m


# ---- pricing and writing a layout -----------------------------------------------------------------
def evaluate_chunks(cost: CostModel, chunks: Sequence[Chunk], pp: int, schedule: str, v: int, m: int, seq_len: int,
                    global_batch: int) -> Evaluation:
    """The cost model's figures for ``pp * v`` chunks under ``schedule`` with ``m`` micro-batches."""
    return cost.evaluate_stages(chunks, pp, schedule, m, v, global_batch // m, seq_len)


def to_plan(model: ModelSpec, cluster: ClusterSpec, cost: CostModel, chunks: Sequence[Chunk], pp: int, schedule: str,
            v: int, m: int, seq_len: int, global_batch: int, ev: Evaluation) -> Plan:
    """The Plan of consecutive chunks (chunk ``i`` on pipeline rank ``i % pp``) with its predicted figures."""
    stages, start = [], 0
    for st in chunks:
        stages.append(StagePlan(start, start + len(st), tuple(st)))
        start += len(st)
    return Plan(model=model.name, cluster=cluster.label, world_size=cluster.world_size, pp=pp,
                pipeline_schedule=PipelineSchedule(schedule), num_microbatches=m, seq_len=seq_len,
                global_batch=global_batch, stages=tuple(stages), virtual_stages=v, predicted=ev.to_dict(),
                cost_source=cost.source)
