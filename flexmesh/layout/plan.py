"""Plan: the parallel layout of a job, as versioned, human-readable JSON -- one type for every cluster.

A plan is a list of **replica groups**. A group is ``dp`` identical pipelines of ``pp`` stages (each
stage a block of ranks), with a :class:`~flexmesh.layout.strategy.LayerStrategy` per layer (tensor,
context and data parallelism, ZeRO, recomputation) and its own micro-batch count, and it takes a
``share`` of each step's sequences. Each group's micro-batch token budget, ``microbatch_tokens`` (what
one data rank packs into one micro-batch: what the search priced, the scheduler packs to and the
runtime runs), follows from its share, micro-batch count and data ranks and ``seq_len``; the file shows
it and reading checks it. A uniform cluster is the special case of one group over every
rank; on a mixed cluster groups sit on different device types (or a pipeline's stages do), differ in
layout, and the step scheduler dispatches each step's sequences over them. Every group holds every
layer; a layer's gradient is summed over the groups. Ranks no group uses are ``unused``.

Inside a group ranks follow the one rank order (flexmesh.layout.mesh): block ``p`` holds pipeline rank
``p``, its ranks in (dp, cp, tp) order, tp innermost. ``ranks`` in JSON lists each block as rank runs
(``"0-3"``, ``"4,6"``). The search writes a plan, the runtime reads it, a person may edit it and
``flexmesh plan --check`` re-validates it (and ``--out`` upgrades an older file).

A small example (one group, 4 devices, tp 2 x dp 2):

.. code-block:: json

    {"version": 5, "model": "tiny", "cluster": "4xA100-80GB", "world_size": 4, "seq_len": 2048,
     "global_batch": 8, "pipeline_schedule": "1f1b",
     "groups": [{"ranks": ["0-3"], "share": 8, "num_microbatches": 2, "microbatch_tokens": 4096,
                 "stages": [{"layers": [0, 4], "strategies": ["tp2-dp2z0", "tp2-dp2z0", "tp2-dp2z0-ac",
                                                               "tp2-dp2z0-ac"]}]}],
     "predicted": {}}

>>> example = __doc__.split(".. code-block:: json")[1].split(">>>")[0]
>>> p = Plan.from_dict(json.loads(example))
>>> p.pp, p.num_microbatches, p.microbatch_tokens, p.layout
(1, 2, 4096, 'pp1 1f1b m2 | [0,4) 2x tp2-dp2z0 + 2x tp2-dp2z0-ac')

Versions 1 and 2 (one uniform layout), 3 (replicas of one tp degree per stage) and 4 (no
``microbatch_tokens``) are still read (flexmesh.layout.legacy); a plan is written as version 5. A plan
made from a config.json records that file (``model_config``: its absolute path and sha256; optional,
plans of presets have none), from which flexmesh.layout.plan_model finds the model again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

from flexmesh.errors import PlanError
from flexmesh.files import read_json, write_atomic
from flexmesh.layout.enums import PipelineSchedule, choices
from flexmesh.layout.group import ReplicaGroup, StagePlan
from flexmesh.layout.legacy import upgrade
from flexmesh.layout.overlap import RUNTIME, Overlap
from flexmesh.layout.ranks import rank_runs
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.limits import MAX_DEVICES, MAX_SEQ_LEN, MAX_SEQUENCES, within
from flexmesh.spec.model_file import ModelFile
from flexmesh.spec.values import known_keys, mapping, sequence, text, whole

PLAN_VERSION = 5
READABLE_VERSIONS = (1, 2, 3, 4, 5)
PIPELINE_SCHEDULES = choices(PipelineSchedule)
_PLAN_KEYS = ("version", "model", "model_config", "cluster", "world_size", "seq_len", "global_batch",
              "pipeline_schedule", "cost_source", "overlap", "groups", "unused", "predicted")


@dataclass(frozen=True)
class Plan:
    model: str
    cluster: str
    world_size: int
    seq_len: int
    global_batch: int
    pipeline_schedule: PipelineSchedule  # a str is read as its PipelineSchedule
    groups: tuple[ReplicaGroup, ...]
    unused: tuple[int, ...] = ()
    # Predicted figures filled by the cost model (flexmesh.cost.CostModel.evaluate); free-form dict
    # with step_time_s, tokens_per_s, mfu, peak_memory_gib (list per pipeline rank), breakdowns.
    predicted: dict = field(default_factory=dict, compare=False, hash=False)
    # Where the cost model's numbers came from: "preset:<device>" or "profile:<path>".
    cost_source: str = "preset"
    # Which communication runs under compute (flexmesh.layout.overlap); files without it read as
    # what the runtime runs (RUNTIME).
    overlap: Overlap = RUNTIME
    # The version of the file the plan was read from (flexmesh.layout.legacy); it is written as PLAN_VERSION.
    version: int = field(default=PLAN_VERSION, compare=False)
    # The config.json ``model`` was read from (flexmesh.layout.plan_model resolves it); None: a preset.
    model_config: ModelFile | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        text(self.model, "plan model", PlanError)
        text(self.cluster, "plan cluster", PlanError)
        text(self.cost_source, "plan cost_source", PlanError)
        if self.model_config is not None and not isinstance(self.model_config, ModelFile):
            raise PlanError(f"plan model_config must be a ModelFile, got {self.model_config!r}")
        for f, bound in (("world_size", MAX_DEVICES), ("seq_len", MAX_SEQ_LEN), ("global_batch", MAX_SEQUENCES)):
            within(whole(getattr(self, f), f"plan {f}", PlanError, minimum=None), bound, f"plan {f}", PlanError)
        if self.world_size < 1 or self.seq_len < 1 or self.global_batch < 1:
            raise PlanError(f"plan world_size, seq_len and global_batch must all be >= 1, got {self.world_size}, "
                            f"{self.seq_len} and {self.global_batch}")
        if not isinstance(self.predicted, dict):
            raise PlanError(f"plan predicted must be a JSON object (or left out), got {self.predicted!r}")
        if not isinstance(self.pipeline_schedule, str) or self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise PlanError(f"pipeline schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, "
                            f"got {self.pipeline_schedule!r}")
        object.__setattr__(self, "pipeline_schedule", PipelineSchedule(self.pipeline_schedule))
        if not self.groups:
            raise PlanError("a plan needs at least one replica group")
        for g in self.groups:
            if self.pipeline_schedule != PipelineSchedule.INTERLEAVED and g.virtual_stages != 1:
                raise PlanError(f"virtual_stages={g.virtual_stages} needs pipeline schedule 'interleaved'")
        layers = {g.num_layers for g in self.groups}
        if len(layers) != 1:
            raise PlanError(f"replica groups cover different numbers of layers: {sorted(layers)}; each group runs "
                            "the whole model")
        self._check_ranks()
        total = sum(g.share for g in self.groups)
        if total != self.global_batch:
            raise PlanError(f"the replica groups' shares add up to {total}, not the global batch {self.global_batch}")

    def _check_ranks(self) -> None:
        placed = [r for g in self.groups for b in g.blocks for r in b] + list(self.unused)
        if len(placed) == self.world_size and set(placed) == set(range(self.world_size)):
            return  # each rank once: the common case, checked at C speed; the loop below names what is wrong
        seen: dict[int, str] = {}
        for i, g in enumerate(self.groups):
            for s, block in enumerate(g.blocks):
                for r in block:
                    here = f"replica group {i} pipeline rank {s}"
                    if r in seen:
                        twice = "twice in " + here if seen[r] == here else f"in {seen[r]} and in {here}"
                        raise PlanError(f"rank {r} is {twice}; a rank runs one pipeline rank of one group")
                    seen[r] = here
        for r in self.unused:
            whole(r, "unused rank", PlanError, minimum=0)
            if r in seen:
                raise PlanError(f"rank {r} is listed unused but {seen[r]} runs on it")
            seen[r] = "unused"
        if sorted(seen) != list(range(self.world_size)):
            missing = sorted(set(range(self.world_size)) - set(seen))
            extra = sorted(set(seen) - set(range(self.world_size)))
            if len(self.groups) == 1 and not self.unused and not extra and self.world_size % self.groups[0].pp:
                raise PlanError(f"world size {self.world_size} is not divisible by pp {self.groups[0].pp}")
            raise PlanError(f"every rank 0..{self.world_size - 1} of the {self.world_size} devices must be in one "
                            "replica group or in 'unused'"
                            + (f"; not placed: {missing}" if missing else "")
                            + (f"; beyond the world: {extra}" if extra else ""))

    # ---- one group: the uniform plan ---------------------------------------------------------------
    @classmethod
    def uniform(cls, model: str, cluster: str, world_size: int, pp: int, pipeline_schedule: str,
                num_microbatches: int, seq_len: int, global_batch: int, stages: tuple[StagePlan, ...],
                virtual_stages: int = 1, predicted: dict | None = None, cost_source: str = "preset",
                overlap: Overlap = RUNTIME) -> "Plan":
        """One replica group over every rank: pipeline rank ``p`` on ranks ``[p * S, (p + 1) * S)``
        with ``S = world_size / pp``, taking the whole global batch.

        >>> from flexmesh.layout.strategy import LayerStrategy as S
        >>> st = [StagePlan(0, 2, (S.parse("tp2-dp1z0"),) * 2), StagePlan(2, 4, (S.parse("tp2-dp1z0"),) * 2)]
        >>> Plan.uniform("tiny", "4xA100-80GB", 4, 2, "1f1b", 4, 2048, 8, tuple(st)).groups[0].blocks
        ((0, 1), (2, 3))
        """
        whole(world_size, "plan world_size", PlanError, minimum=None)
        whole(pp, "plan pp", PlanError, minimum=None)
        if pp < 1:
            raise PlanError("pp, virtual_stages and num_microbatches must all be >= 1")
        if world_size % pp:
            raise PlanError(f"world size {world_size} is not divisible by pp {pp}")
        per = world_size // pp
        blocks = tuple(tuple(range(p * per, (p + 1) * per)) for p in range(pp))
        group = ReplicaGroup(blocks, tuple(stages), num_microbatches, global_batch, virtual_stages)
        schedule = cast(PipelineSchedule, pipeline_schedule)  # checked, and made one, by __post_init__
        return cls(model, cluster, world_size, seq_len, global_batch, schedule, (group,),
                   predicted={} if predicted is None else predicted, cost_source=cost_source, overlap=overlap)

    @property
    def in_rank_order(self) -> bool:
        """Whether the plan is one replica group over every rank in the rank order (pipeline rank ``p``
        on ranks ``[p * S, (p + 1) * S)``): the layout of a uniform cluster."""
        if len(self.groups) != 1 or self.unused:
            return False
        g = self.groups[0]
        per = self.world_size // g.pp
        return g.blocks == tuple(tuple(range(p * per, (p + 1) * per)) for p in range(g.pp))

    @property
    def group(self) -> ReplicaGroup:
        """The plan's only replica group (PlanError when it has several: ask :attr:`groups`)."""
        if len(self.groups) != 1:
            raise PlanError(f"this plan has {len(self.groups)} replica groups, where one layout over every rank was "
                            "expected; use it where plans of several groups are taken")
        return self.groups[0]

    # The one group's fields, read as the plan's (a uniform plan's vocabulary).
    pp = property(lambda self: self.group.pp)
    stages = property(lambda self: self.group.stages)
    num_microbatches = property(lambda self: self.group.num_microbatches)
    virtual_stages = property(lambda self: self.group.virtual_stages)
    microbatch_size = property(lambda self: self.group.microbatch_size)
    stage_devices = property(lambda self: self.group.stage_devices)

    @property
    def microbatch_tokens(self) -> int:
        """The one group's :meth:`ReplicaGroup.microbatch_tokens` (the module doc's token budget).

        >>> from flexmesh.layout.strategy import LayerStrategy
        >>> st = StagePlan(0, 2, (LayerStrategy.parse("tp1-dp4z2"),) * 2)
        >>> Plan.uniform("tiny", "4xA100-80GB", 4, 1, "1f1b", 2, 2048, 32, (st,)).microbatch_tokens  # 16 x 2048 / 4
        8192
        """
        return self.group.microbatch_tokens(self.seq_len)

    def layer_strategies(self) -> list[LayerStrategy]:
        return self.group.layer_strategies()

    @property
    def num_layers(self) -> int:
        return self.groups[0].num_layers

    def with_global_batch(self, global_batch: int) -> "Plan":
        """This plan taking ``global_batch`` sequences per step, the groups' shares scaled in proportion
        (largest remainders; each keeps at least one sequence), each in the fewest micro-batches that
        hold no more sequences than the plan's (the memory the search checked).

        >>> from flexmesh.layout.strategy import LayerStrategy
        >>> st = (StagePlan(0, 2, (LayerStrategy(),) * 2),)
        >>> groups = (ReplicaGroup(((0,),), st, 2, 4), ReplicaGroup(((1,),), st, 1, 2))
        >>> p = Plan("tiny", "cpu", 2, 64, 6, "1f1b", groups)
        >>> [(g.share, g.num_microbatches) for g in p.with_global_batch(12).groups]
        [(8, 4), (4, 2)]
        """
        if global_batch == self.global_batch:
            return self
        from flexmesh.layout.shares import split_by_weight

        shares = split_by_weight(global_batch, [g.share for g in self.groups])
        groups = tuple(replace(g, share=s, num_microbatches=min(m for m in range(1, s + 1)
                                                                if s % m == 0 and s // m <= g.microbatch_size))
                       for g, s in zip(self.groups, shares))
        return replace(self, global_batch=global_batch, groups=groups)

    @property
    def layout(self) -> str:
        """One line per replica group, e.g. ``pp2 1f1b m8 | [0,16) 16x tp4-dp1z1 | ...``; with several
        groups each line starts with its ranks and share (``g0 ranks 0-7 b24 | ...``)."""
        if len(self.groups) == 1:
            return self.groups[0].layout(self.pipeline_schedule)
        return "\n".join(f"g{i} ranks {rank_runs(g.ranks)} b{g.share} | {g.layout(self.pipeline_schedule)}"
                         for i, g in enumerate(self.groups))

    # ---- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": PLAN_VERSION, "model": self.model,
            **({"model_config": self.model_config.to_dict()} if self.model_config else {}),
            "cluster": self.cluster, "world_size": self.world_size,
            "seq_len": self.seq_len, "global_batch": self.global_batch,
            "pipeline_schedule": str(self.pipeline_schedule), "cost_source": self.cost_source,
            "overlap": self.overlap.to_dict(), "groups": [g.to_dict(self.seq_len) for g in self.groups],
            "unused": list(self.unused), "predicted": self.predicted,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """A plan of any readable version (1-3 through flexmesh.layout.legacy); a group's
        ``microbatch_tokens``, where given, must be the budget its fields give."""
        mapping(d, "a plan", PlanError)
        version = d.get("version")
        if version not in READABLE_VERSIONS:
            raise PlanError(f"plan version {version!r} is not supported (this flexmesh reads versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))})")
        if version < 4:
            d = upgrade(d)
        known_keys(d, _PLAN_KEYS, "plan", PlanError)
        required = ("model", "cluster", "world_size", "seq_len", "global_batch", "pipeline_schedule", "groups")
        missing = [k for k in required if k not in d]
        if missing:
            raise PlanError(f"plan is missing {', '.join(missing)}")
        counts = {k: whole(d[k], f"plan {k}", PlanError) for k in ("world_size", "seq_len", "global_batch")}
        groups = tuple(ReplicaGroup.from_dict(g, f"replica group {i}", counts["seq_len"])
                       for i, g in enumerate(sequence(d["groups"], "plan groups", PlanError)))
        return cls(model=d["model"], cluster=d["cluster"], pipeline_schedule=d["pipeline_schedule"],
                   groups=groups, unused=tuple(whole(x, "unused rank", PlanError, minimum=0)
                                               for x in sequence(d.get("unused", []), "plan unused", PlanError)),
                   predicted=d.get("predicted", {}), cost_source=d.get("cost_source", "preset"),
                   overlap=Overlap.from_dict(d.get("overlap", RUNTIME.to_dict())), **counts, version=version,
                   model_config=None if d.get("model_config") is None
                   else ModelFile.from_dict(d["model_config"], "plan model_config", PlanError))

    def save(self, path: str | Path) -> None:
        """Write atomically: a crash never leaves a half-written plan behind."""
        write_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(read_json(path, PlanError, missing=f"plan file {str(path)!r} does not exist"))


def load_plan(path: str | Path) -> Plan:
    """The plan in ``path``, any readable version."""
    return Plan.load(path)
