"""Plan: the parallel layout of a job, as versioned, human-readable JSON.

The search writes it, the runtime reads it, a person may edit it and ``flexmesh plan --check``
re-validates it. Ranks map to coordinates with ``tp`` innermost, then ``cp``, then ``dp``, then
``pp`` (see :func:`flexmesh.layout.mesh.rank_coords`).

A small example (one stage, 4 devices, tp 2 x dp 2):

.. code-block:: json

    {"version": 2, "model": "tiny", "cluster": "4xA100-80GB", "world_size": 4,
     "pp": 1, "pipeline_schedule": "1f1b", "virtual_stages": 1, "num_microbatches": 2,
     "seq_len": 2048, "global_batch": 8,
     "stages": [{"layers": [0, 4], "strategies": ["tp2-dp2z0", "tp2-dp2z0", "tp2-dp2z0-ac", "tp2-dp2z0-ac"]}],
     "predicted": {...}}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from flexmesh.errors import PlanError
from flexmesh.files import read_json, write_atomic
from flexmesh.layout.enums import PipelineSchedule, choices
from flexmesh.layout.overlap import RUNTIME, Overlap
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.values import mapping, sequence, text, whole

# Version 2 renamed the pipeline schedule's key from "schedule" to "pipeline_schedule"; version 1
# files are still read.
PLAN_VERSION = 2
READABLE_VERSIONS = (1, 2)
PIPELINE_SCHEDULES = choices(PipelineSchedule)


@dataclass(frozen=True)
class StagePlan:
    """A pipeline stage (or, with interleaving, one model chunk) holding layers [start, end)."""

    start: int
    end: int
    strategies: tuple[LayerStrategy, ...]

    def __post_init__(self) -> None:
        whole(self.start, "stage start layer", PlanError, minimum=0)
        whole(self.end, "stage end layer", PlanError, minimum=0)
        if self.end < self.start:
            raise PlanError(f"stage layers [{self.start}, {self.end}) are empty or reversed")
        if len(self.strategies) != self.end - self.start:
            raise PlanError(
                f"stage [{self.start}, {self.end}) has {self.end - self.start} layers but "
                f"{len(self.strategies)} strategies"
            )

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    @property
    def devices(self) -> int:
        return self.strategies[0].devices if self.strategies else 0

    @property
    def compact(self) -> str:
        """Run-length form, e.g. ``8x tp2-dp4z1 + 2x tp2-dp4z1-ac``."""
        runs: list[list] = []
        for s in self.strategies:
            if runs and runs[-1][1] == s:
                runs[-1][0] += 1
            else:
                runs.append([1, s])
        return " + ".join(f"{n}x {s}" for n, s in runs)


@dataclass(frozen=True)
class Plan:
    model: str
    cluster: str
    world_size: int
    pp: int
    pipeline_schedule: PipelineSchedule
    num_microbatches: int
    seq_len: int
    global_batch: int
    stages: tuple[StagePlan, ...]
    virtual_stages: int = 1
    # Predicted figures filled by the cost model (flexmesh.cost.CostModel.evaluate); free-form dict
    # with step_time_s, tokens_per_s, mfu, peak_memory_gib (list per pipeline rank), breakdowns.
    predicted: dict = field(default_factory=dict, compare=False, hash=False)
    # Where the cost model's numbers came from: "preset:<device>" or "profile:<path>".
    cost_source: str = "preset"
    version: int = PLAN_VERSION
    # Which communication runs under compute (flexmesh.layout.overlap); files without it read as
    # what the runtime runs (RUNTIME).
    overlap: Overlap = RUNTIME

    def __post_init__(self) -> None:
        text(self.model, "plan model", PlanError)
        text(self.cluster, "plan cluster", PlanError)
        text(self.cost_source, "plan cost_source", PlanError)
        for f in ("world_size", "pp", "virtual_stages", "num_microbatches", "seq_len", "global_batch"):
            whole(getattr(self, f), f"plan {f}", PlanError, minimum=None)
        if self.world_size < 1 or self.seq_len < 1 or self.global_batch < 1:
            raise PlanError(f"plan world_size, seq_len and global_batch must all be >= 1, got {self.world_size}, "
                            f"{self.seq_len} and {self.global_batch}")
        if not isinstance(self.predicted, dict):
            raise PlanError(f"plan predicted must be a JSON object (or left out), got {self.predicted!r}")
        if not isinstance(self.pipeline_schedule, str) or self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise PlanError(f"pipeline schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, "
                            f"got {self.pipeline_schedule!r}")
        object.__setattr__(self, "pipeline_schedule", PipelineSchedule(self.pipeline_schedule))
        if self.pp < 1 or self.virtual_stages < 1 or self.num_microbatches < 1:
            raise PlanError("pp, virtual_stages and num_microbatches must all be >= 1")
        if self.pipeline_schedule != PipelineSchedule.INTERLEAVED and self.virtual_stages != 1:
            raise PlanError(f"virtual_stages={self.virtual_stages} needs pipeline schedule 'interleaved'")
        if len(self.stages) != self.pp * self.virtual_stages:
            raise PlanError(
                f"plan has {len(self.stages)} stages but pp x virtual_stages = {self.pp} x {self.virtual_stages}"
            )
        if self.world_size % self.pp:
            raise PlanError(f"world size {self.world_size} is not divisible by pp {self.pp}")
        if self.global_batch % self.num_microbatches:
            raise PlanError(
                f"global batch {self.global_batch} is not divisible into {self.num_microbatches} micro-batches"
            )

    @property
    def stage_devices(self) -> int:
        return self.world_size // self.pp

    @property
    def num_layers(self) -> int:
        return sum(s.num_layers for s in self.stages)

    @property
    def microbatch_size(self) -> int:
        """Sequences per micro-batch across the whole stage (split further over each layer's dp)."""
        return self.global_batch // self.num_microbatches

    @property
    def microbatch_tokens(self) -> int:
        """Tokens one data rank packs into one micro-batch: the plan's micro-batch of
        :attr:`microbatch_size` sequences of ``seq_len`` tokens, split over the dp x cp data ranks of
        its layers. The one number the search prices and checks against memory
        (``CostModel.layer_work``), the scheduler packs to and the runtime runs.

        >>> from flexmesh.layout.strategy import LayerStrategy
        >>> st = StagePlan(0, 2, (LayerStrategy.parse("tp1-dp4z2"),) * 2)
        >>> Plan("tiny", "4xA100-80GB", 4, 1, "1f1b", 2, 2048, 32, (st,)).microbatch_tokens  # 16 x 2048 / 4
        8192
        """
        first = self.stages[0].strategies[0] if self.stages and self.stages[0].strategies else None
        ranks = first.dp * first.cp if first is not None else 1
        return max(1, -(-self.microbatch_size * self.seq_len // ranks))

    def chunks_of_rank(self, pp_rank: int) -> list[int]:
        """Indices into ``stages`` held by pipeline rank ``pp_rank`` (Megatron's interleaved order)."""
        return list(range(pp_rank, len(self.stages), self.pp))

    def layer_strategies(self) -> list[LayerStrategy]:
        out: list[LayerStrategy] = []
        for st in sorted(self.stages, key=lambda s: s.start):
            out.extend(st.strategies)
        return out

    @property
    def layout(self) -> str:
        """One line describing the plan, e.g. ``pp2 1f1b m8 | [0,16) 16x tp4-dp1z1 | ...``."""
        sched = str(self.pipeline_schedule) + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
        stages = " | ".join(f"[{s.start},{s.end}) {s.compact}" for s in self.stages)
        return f"pp{self.pp} {sched} m{self.num_microbatches} | {stages}"

    # ---- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "model": self.model,
            "cluster": self.cluster,
            "world_size": self.world_size,
            "pp": self.pp,
            "pipeline_schedule": str(self.pipeline_schedule),
            "virtual_stages": self.virtual_stages,
            "num_microbatches": self.num_microbatches,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "cost_source": self.cost_source,
            "overlap": self.overlap.to_dict(),
            "stages": [
                {"layers": [s.start, s.end], "strategies": [str(x) for x in s.strategies]} for s in self.stages
            ],
            "predicted": self.predicted,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        mapping(d, "a plan", PlanError)
        version = d.get("version")
        if version not in READABLE_VERSIONS:
            raise PlanError(f"plan version {version!r} is not supported (this flexmesh reads versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))})")
        schedule_key = "schedule" if version == 1 else "pipeline_schedule"
        required = ("model", "cluster", "world_size", "pp", schedule_key, "num_microbatches", "seq_len",
                    "global_batch", "stages")
        missing = [k for k in required if k not in d]
        if missing:
            raise PlanError(f"plan is missing {', '.join(missing)}")
        stages = []
        for i, s in enumerate(sequence(d["stages"], "plan stages", PlanError)):
            try:
                start, end = s["layers"]
                strategies = tuple(LayerStrategy.parse(x) for x in sequence(s["strategies"], "strategies", PlanError))
            except (KeyError, ValueError, TypeError, AttributeError, PlanError) as e:
                raise PlanError(f"stage {i}: needs 'layers': [start, end] and 'strategies': [...] "
                                f"({str(e).strip() or type(e).__name__})") from None
            stages.append(StagePlan(whole(start, f"stage {i} start layer", PlanError, minimum=0),
                                    whole(end, f"stage {i} end layer", PlanError, minimum=0), strategies))
        counts = {k: whole(d[k], f"plan {k}", PlanError) for k in ("world_size", "pp", "num_microbatches", "seq_len",
                                                                      "global_batch")}
        return cls(
            model=d["model"], cluster=d["cluster"], pipeline_schedule=d[schedule_key],
            virtual_stages=whole(d.get("virtual_stages", 1), "plan virtual_stages", PlanError),
            stages=tuple(stages), predicted=d.get("predicted", {}), cost_source=d.get("cost_source", "preset"),
            overlap=Overlap.from_dict(d.get("overlap", RUNTIME.to_dict())),
            **counts,
        )

    def save(self, path: str | Path) -> None:
        """Write atomically: a crash never leaves a half-written plan behind."""
        write_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(read_json(path, PlanError, missing=f"plan file {str(path)!r} does not exist"))
