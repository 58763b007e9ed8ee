"""HeteroPlan: a layout whose data-parallel replicas may differ (plan format version 3).

Each replica is one pipeline with its own devices, stage boundaries, tensor-parallel degree per
stage and micro-batch count, and takes its own share of the global batch. Replicas hold full copies
of the layers they run (no ZeRO sharding across replicas); a layer's gradients are averaged over
the replicas that hold it, weighted by tokens (the loss is normalised by the global token count).
Devices no replica uses are listed in ``unused``. A uniform plan whose layers share one tp degree
per stage and have no context parallelism is the special case :meth:`HeteroPlan.from_uniform`.

A small example (2 replicas over 4 devices: tp 2 on one stage, and two stages of tp 1):

.. code-block:: json

    {"version": 3, "model": "tiny", "cluster": "2xH100+2xA100-40GB", "world_size": 4,
     "seq_len": 2048, "global_batch": 12, "pipeline_schedule": "1f1b",
     "replicas": [
       {"batch": 8, "num_microbatches": 4,
        "stages": [{"layers": [0, 4], "devices": [0, 1], "recompute": "none"}]},
       {"batch": 4, "num_microbatches": 2,
        "stages": [{"layers": [0, 2], "devices": [2], "recompute": "full"},
                   {"layers": [2, 4], "devices": [3], "recompute": "none"}]}],
     "unused": [], "predicted": {}}

>>> example = __doc__.split(".. code-block:: json")[1].split(">>>")[0]
>>> p = HeteroPlan.from_dict(json.loads(example))
>>> [r.pp for r in p.replicas], [r.stages[0].tp for r in p.replicas], p.num_layers
([1, 2], [2, 1], 4)
>>> p.holders(3)  # (replica, stage) pairs holding layer 3
[(0, 0), (1, 1)]
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from flexmesh.errors import PlanError
from flexmesh.files import read_json, write_atomic
from flexmesh.layout.enums import PipelineSchedule
from flexmesh.layout.plan import Plan
from flexmesh.layout.strategy import RECOMPUTE_KINDS, Recompute
from flexmesh.spec.values import known_keys, mapping, sequence, text, whole

HETERO_PLAN_VERSION = 3
HETERO_SCHEDULES = (str(PipelineSchedule.ONE_F_ONE_B), str(PipelineSchedule.GPIPE))
_PLAN_KEYS = ("version", "model", "cluster", "world_size", "seq_len", "global_batch", "pipeline_schedule",
              "replicas", "unused", "predicted", "cost_source")
_REPLICA_KEYS = ("batch", "num_microbatches", "stages")
_STAGE_KEYS = ("layers", "devices", "recompute")


@dataclass(frozen=True)
class ReplicaStage:
    """Layers ``[start, end)`` on the tensor-parallel group ``devices`` (global ranks; tp = their count)."""

    start: int
    end: int
    devices: tuple[int, ...]
    recompute: Recompute = Recompute.NONE

    def __post_init__(self) -> None:
        whole(self.start, "stage start layer", PlanError, minimum=0)
        whole(self.end, "stage end layer", PlanError, minimum=0)
        if self.end <= self.start:
            raise PlanError(f"stage layers [{self.start}, {self.end}) are empty or reversed")
        if not self.devices:
            raise PlanError(f"stage [{self.start}, {self.end}) has no devices")
        for d in self.devices:
            whole(d, f"stage [{self.start}, {self.end}) device", PlanError, minimum=0)
        if len(set(self.devices)) != len(self.devices):
            raise PlanError(f"stage [{self.start}, {self.end}) names a device twice: {list(self.devices)}")
        if not isinstance(self.recompute, str) or self.recompute not in RECOMPUTE_KINDS:
            raise PlanError(f"stage recompute must be one of {', '.join(RECOMPUTE_KINDS)}, got {self.recompute!r}")
        object.__setattr__(self, "recompute", Recompute(self.recompute))

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Replica:
    """One pipeline: its stages in order, its share of the global batch and its micro-batch count."""

    stages: tuple[ReplicaStage, ...]
    batch: int
    num_microbatches: int

    def __post_init__(self) -> None:
        whole(self.batch, "replica batch", PlanError)
        whole(self.num_microbatches, "replica num_microbatches", PlanError)
        if not self.stages:
            raise PlanError("a replica needs at least one stage")
        if self.stages[0].start != 0:
            raise PlanError(f"a replica's first stage must start at layer 0, not {self.stages[0].start}")
        for a, b in zip(self.stages, self.stages[1:]):
            if b.start != a.end:
                raise PlanError(f"replica stages [{a.start}, {a.end}) and [{b.start}, {b.end}) are not contiguous")
        if self.batch % self.num_microbatches:
            raise PlanError(f"replica batch {self.batch} is not divisible into {self.num_microbatches} micro-batches")

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for s in self.stages for d in s.devices)

    @property
    def num_layers(self) -> int:
        return self.stages[-1].end

    @property
    def microbatch_size(self) -> int:
        return self.batch // self.num_microbatches

    def stage_of_layer(self, layer: int) -> int:
        for i, s in enumerate(self.stages):
            if s.start <= layer < s.end:
                return i
        raise PlanError(f"layer {layer} is outside this replica's [0, {self.num_layers})")

    @property
    def compact(self) -> str:
        """e.g. ``b96 m12 | [0,20) tp4 | [20,40) tp4-ac``."""
        suffix = {Recompute.NONE: "", Recompute.SELECTIVE: "-sac", Recompute.FULL: "-ac"}
        stages = " | ".join(f"[{s.start},{s.end}) tp{s.tp}{suffix[s.recompute]}" for s in self.stages)
        return f"b{self.batch} m{self.num_microbatches} | {stages}"


@dataclass(frozen=True)
class HeteroPlan:
    model: str
    cluster: str
    world_size: int
    seq_len: int
    global_batch: int
    replicas: tuple[Replica, ...]
    pipeline_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    unused: tuple[int, ...] = ()
    # Predicted figures (free-form), as Plan.predicted: step_time_s, tokens_per_s, per replica ...
    predicted: dict = field(default_factory=dict, compare=False, hash=False)
    cost_source: str = "preset"
    version: int = HETERO_PLAN_VERSION

    def __post_init__(self) -> None:
        text(self.model, "plan model", PlanError)
        text(self.cluster, "plan cluster", PlanError)
        text(self.cost_source, "plan cost_source", PlanError)
        for f in ("world_size", "seq_len", "global_batch"):
            whole(getattr(self, f), f"plan {f}", PlanError)
        if not isinstance(self.predicted, dict):
            raise PlanError(f"plan predicted must be a JSON object (or left out), got {self.predicted!r}")
        if not isinstance(self.pipeline_schedule, str) or self.pipeline_schedule not in HETERO_SCHEDULES:
            raise PlanError(f"a heterogeneous plan's pipeline schedule must be one of {', '.join(HETERO_SCHEDULES)}, "
                            f"got {self.pipeline_schedule!r}")
        object.__setattr__(self, "pipeline_schedule", PipelineSchedule(self.pipeline_schedule))
        if not self.replicas:
            raise PlanError("a heterogeneous plan needs at least one replica")
        layers = {r.num_layers for r in self.replicas}
        if len(layers) != 1:
            raise PlanError(f"replicas cover different numbers of layers: {sorted(layers)}; each runs the whole model")
        seen: dict[int, str] = {}
        for i, r in enumerate(self.replicas):
            for d in r.devices:
                if d in seen:
                    raise PlanError(f"device {d} is in replica {i} and in {seen[d]}; a device runs one stage")
                seen[d] = f"replica {i}"
        for d in self.unused:
            whole(d, "unused device", PlanError, minimum=0)
            if d in seen:
                raise PlanError(f"device {d} is listed unused but {seen[d]} runs on it")
            seen[d] = "unused"
        if sorted(seen) != list(range(self.world_size)):
            missing = sorted(set(range(self.world_size)) - set(seen))
            extra = sorted(set(seen) - set(range(self.world_size)))
            raise PlanError(f"every device 0..{self.world_size - 1} must be in one replica or in 'unused'"
                            + (f"; not placed: {missing}" if missing else "")
                            + (f"; beyond the world: {extra}" if extra else ""))
        total = sum(r.batch for r in self.replicas)
        if total != self.global_batch:
            raise PlanError(f"replica batches sum to {total}, not the global batch {self.global_batch}")

    @property
    def num_layers(self) -> int:
        return self.replicas[0].num_layers

    @property
    def used_devices(self) -> int:
        return self.world_size - len(self.unused)

    def holders(self, layer: int) -> list[tuple[int, int]]:
        """(replica index, stage index) of every stage that runs ``layer``."""
        return [(i, r.stage_of_layer(layer)) for i, r in enumerate(self.replicas)]

    @property
    def layout(self) -> str:
        """One line per replica, e.g. ``r0 b96 m12 | [0,40) tp8``."""
        return "\n".join(f"r{i} {r.compact}" for i, r in enumerate(self.replicas))

    # ---- conversions -----------------------------------------------------------------------------
    @classmethod
    def from_uniform(cls, plan: Plan) -> "HeteroPlan":
        """The uniform ``plan`` as replicas: one per data-parallel rank, each with the plan's stages.

        Needs one tp degree per stage, no context parallelism and no interleaving; ZeRO stages are
        dropped (replicas hold full copies).
        """
        from flexmesh.layout.mesh import layout_from_plan, rank_coords  # the one rank order

        if plan.virtual_stages != 1:
            raise PlanError("an interleaved plan has no heterogeneous form (one chunk per stage only)")
        stages = sorted(plan.stages, key=lambda s: s.start)
        for s in stages:
            if any(x.cp != 1 for x in s.strategies) or len({x.tp for x in s.strategies}) != 1:
                raise PlanError(f"stage [{s.start}, {s.end}) mixes tp degrees or uses context parallelism; "
                                "a heterogeneous plan has one tp degree per stage and no cp")
        tps = {s.strategies[0].tp for s in stages}
        if len(tps) != 1:
            raise PlanError("stages use different tp degrees; the uniform rank order needs one")
        tp = tps.pop()
        dp = plan.stage_devices // tp
        if plan.global_batch % dp:
            raise PlanError(f"global batch {plan.global_batch} does not split evenly over {dp} replicas")
        layout_from_plan(plan)  # validates the rank arithmetic
        by_coords: dict[tuple[int, int], list[int]] = {}
        for rank in range(plan.world_size):
            c = rank_coords(rank, plan.pp, dp, 1, tp)
            by_coords.setdefault((c["dp"], c["pp"]), []).append(rank)
        batch = plan.global_batch // dp
        micro = math.gcd(batch, plan.num_microbatches)  # the plan's count where the share divides into it
        replicas = tuple(
            Replica(tuple(ReplicaStage(s.start, s.end, tuple(by_coords[(d, p)]), Recompute(s.strategies[0].recompute))
                          for p, s in enumerate(stages)), batch, micro)
            for d in range(dp))
        return cls(plan.model, plan.cluster, plan.world_size, plan.seq_len, plan.global_batch, replicas,
                   PipelineSchedule(plan.pipeline_schedule) if plan.pipeline_schedule in HETERO_SCHEDULES
                   else PipelineSchedule.ONE_F_ONE_B, (), dict(plan.predicted), plan.cost_source)

    # ---- JSON ------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": self.version, "model": self.model, "cluster": self.cluster, "world_size": self.world_size,
            "seq_len": self.seq_len, "global_batch": self.global_batch,
            "pipeline_schedule": str(self.pipeline_schedule), "cost_source": self.cost_source,
            "replicas": [{"batch": r.batch, "num_microbatches": r.num_microbatches,
                          "stages": [{"layers": [s.start, s.end], "devices": list(s.devices),
                                      "recompute": str(s.recompute)} for s in r.stages]}
                         for r in self.replicas],
            "unused": list(self.unused), "predicted": self.predicted,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "HeteroPlan":
        mapping(d, "a plan", PlanError)
        if d.get("version") != HETERO_PLAN_VERSION:
            raise PlanError(f"a heterogeneous plan has version {HETERO_PLAN_VERSION}, got {d.get('version')!r}")
        known_keys(d, _PLAN_KEYS, "plan", PlanError)
        missing = [k for k in ("model", "cluster", "world_size", "seq_len", "global_batch", "replicas") if k not in d]
        if missing:
            raise PlanError(f"plan is missing {', '.join(missing)}")
        replicas = []
        for i, r in enumerate(sequence(d["replicas"], "plan replicas", PlanError)):
            where = f"replica {i}"
            mapping(r, where, PlanError)
            known_keys(r, _REPLICA_KEYS, where, PlanError)
            if "stages" not in r or "batch" not in r:
                raise PlanError(f"{where}: needs 'batch' and 'stages' (and 'num_microbatches')")
            stages = []
            for j, s in enumerate(sequence(r["stages"], f"{where} stages", PlanError)):
                at = f"{where} stage {j}"
                mapping(s, at, PlanError)
                known_keys(s, _STAGE_KEYS, at, PlanError)
                try:
                    start, end = sequence(s["layers"], f"{at} layers", PlanError)
                except (KeyError, ValueError) as e:
                    raise PlanError(f"{at}: needs 'layers': [start, end] ({str(e).strip() or type(e).__name__})") \
                        from None
                devices = sequence(s.get("devices"), f"{at} devices", PlanError)
                try:
                    stages.append(ReplicaStage(whole(start, f"{at} start layer", PlanError, minimum=0),
                                               whole(end, f"{at} end layer", PlanError, minimum=0),
                                               tuple(whole(x, f"{at} device", PlanError, minimum=0) for x in devices),
                                               s.get("recompute", "none")))
                except PlanError as e:
                    raise PlanError(f"{at}: {e}") from None
            try:
                replicas.append(Replica(tuple(stages), whole(r["batch"], f"{where} batch", PlanError),
                                        whole(r.get("num_microbatches", 1), f"{where} num_microbatches", PlanError)))
            except PlanError as e:
                raise PlanError(f"{where}: {e}") from None
        return cls(
            model=d["model"], cluster=d["cluster"],
            world_size=whole(d["world_size"], "plan world_size", PlanError),
            seq_len=whole(d["seq_len"], "plan seq_len", PlanError),
            global_batch=whole(d["global_batch"], "plan global_batch", PlanError),
            replicas=tuple(replicas), pipeline_schedule=d.get("pipeline_schedule", "1f1b"),
            unused=tuple(whole(x, "unused device", PlanError, minimum=0)
                         for x in sequence(d.get("unused", []), "plan unused", PlanError)),
            predicted=d.get("predicted", {}), cost_source=d.get("cost_source", "preset"),
        )

    def save(self, path: str | Path) -> None:
        """Write atomically: a crash never leaves a half-written plan behind."""
        write_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")


def plan_from_dict(d: dict) -> Plan | HeteroPlan:
    """A uniform Plan (versions 1-2) or a HeteroPlan (version 3), by the file's version."""
    mapping(d, "a plan", PlanError)
    if d.get("version") == HETERO_PLAN_VERSION:
        return HeteroPlan.from_dict(d)
    return Plan.from_dict(d)


def load_plan(path: str | Path) -> Plan | HeteroPlan:
    return plan_from_dict(read_json(path, PlanError, missing=f"plan file {str(path)!r} does not exist"))

