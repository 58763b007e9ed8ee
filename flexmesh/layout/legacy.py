"""Plan files of older versions, as the JSON dicts they are: read as today's form (:func:`upgrade`, which
flexmesh.layout.plan calls for them), and today's form written back as the oldest version that describes
the plan (:func:`legacy_dict`, which checkpoints hash).

- Versions 1 and 2: one uniform layout (``pp``, ``num_microbatches``, ``virtual_stages`` and
  ``stages`` at the top; version 1 named the pipeline schedule ``schedule``). Read as one replica
  group over every rank, losslessly.
- Version 3: replicas, each one pipeline whose stages name their devices (one tensor-parallel
  group each), a recompute kind per stage, a batch share and a micro-batch count. Read as one replica
  group per replica: block ``p`` the devices of stage ``p``, every layer ``tp<devices>-dp1z0`` with
  the stage's recomputation, priced with TP communication overlapped (:data:`FASTEST`, what version-3
  plans were priced with).
- Version 4: today's form without each group's ``microbatch_tokens`` (derived from the group's fields,
  so read as it is).

:func:`legacy_dict` goes the other way: the dict an older flexmesh wrote for a plan (version 2 for one
uniform group, version 3 for replicas of one tp group per stage, else version 4). Checkpoints hash
that form (flexmesh.runtime.state.checkpoint.plan_hash), so a run written before a newer version
resumes under its old plan file and under the same plan upgraded.

>>> d = {"version": 3, "model": "tiny", "cluster": "2xH100+2xA100-40GB", "world_size": 4, "seq_len": 64,
...      "global_batch": 12, "replicas": [
...          {"batch": 8, "num_microbatches": 4, "stages": [{"layers": [0, 4], "devices": [0, 1]}]},
...          {"batch": 4, "num_microbatches": 2, "stages": [{"layers": [0, 2], "devices": [2], "recompute": "full"},
...                                                         {"layers": [2, 4], "devices": [3]}]}]}
>>> new = upgrade(d)
>>> [g["ranks"] for g in new["groups"]], [g["stages"][0]["strategies"][0] for g in new["groups"]]
([['0-1'], ['2', '3']], ['tp2-dp1z0', 'tp1-dp1z0-ac'])
>>> legacy_dict(new, 3) == dict(d, pipeline_schedule="1f1b", unused=[], predicted={}, cost_source="preset",
...                             replicas=[dict(r, stages=[dict(s, recompute=s.get("recompute", "none"))
...                                                       for s in r["stages"]]) for r in d["replicas"]])
True
"""

from __future__ import annotations

from flexmesh.errors import PlanError
from flexmesh.layout.enums import PipelineSchedule
from flexmesh.layout.overlap import FASTEST, RUNTIME
from flexmesh.layout.ranks import parse_rank_runs, rank_runs
from flexmesh.layout.strategy import RECOMPUTE_KINDS, LayerStrategy, Recompute
from flexmesh.spec.values import known_keys, mapping, sequence, whole

V3_SCHEDULES = (str(PipelineSchedule.ONE_F_ONE_B), str(PipelineSchedule.GPIPE))
_V3_KEYS = ("version", "model", "cluster", "world_size", "seq_len", "global_batch", "pipeline_schedule",
            "replicas", "unused", "predicted", "cost_source")
_V3_REPLICA_KEYS = ("batch", "num_microbatches", "stages")
_V3_STAGE_KEYS = ("layers", "devices", "recompute")


def upgrade(d: dict) -> dict:
    """A version 1, 2 or 3 plan file's dict in today's form (its ``version`` left as read: the plan
    records which version it came from); what the old format itself refused is refused here, the rest
    by the Plan."""
    return _from_v3(d) if d.get("version") == 3 else _from_v2(d)


def _from_v2(d: dict) -> dict:
    version = d.get("version")
    schedule_key = "schedule" if version == 1 else "pipeline_schedule"
    required = ("model", "cluster", "world_size", "pp", schedule_key, "num_microbatches", "seq_len",
                "global_batch", "stages")
    missing = [k for k in required if k not in d]
    if missing:
        raise PlanError(f"plan is missing {', '.join(missing)}")
    counts = {k: whole(d[k], f"plan {k}", PlanError) for k in ("world_size", "pp", "num_microbatches", "seq_len",
                                                              "global_batch")}
    world, pp = counts["world_size"], counts["pp"]
    if pp < 1:
        raise PlanError("pp, virtual_stages and num_microbatches must all be >= 1")
    if world % pp:
        raise PlanError(f"world size {world} is not divisible by pp {pp}")
    per = world // pp
    group = {"ranks": [rank_runs(tuple(range(p * per, (p + 1) * per))) for p in range(pp)],
             "share": counts["global_batch"], "num_microbatches": counts["num_microbatches"],
             "virtual_stages": whole(d.get("virtual_stages", 1), "plan virtual_stages", PlanError),
             "stages": d["stages"]}
    return {"version": version, "model": d["model"], "cluster": d["cluster"], "world_size": world,
            "seq_len": counts["seq_len"], "global_batch": counts["global_batch"],
            "pipeline_schedule": d[schedule_key], "cost_source": d.get("cost_source", "preset"),
            "overlap": d.get("overlap", RUNTIME.to_dict()), "groups": [group], "unused": [],
            "predicted": d.get("predicted", {})}


def _v3_stage(s: object, at: str) -> tuple[int, int, tuple[int, ...], Recompute]:
    mapping(s, at, PlanError)
    assert isinstance(s, dict)
    known_keys(s, _V3_STAGE_KEYS, at, PlanError)
    try:
        start, end = sequence(s["layers"], f"{at} layers", PlanError)
    except (KeyError, ValueError) as e:
        raise PlanError(f"{at}: needs 'layers': [start, end] ({str(e).strip() or type(e).__name__})") from None
    start, end = whole(start, f"{at} start layer", PlanError, minimum=0), whole(end, f"{at} end layer", PlanError,
                                                                              minimum=0)
    if end <= start:
        raise PlanError(f"{at}: stage layers [{start}, {end}) are empty or reversed")
    devices = tuple(whole(x, f"{at} device", PlanError, minimum=0)
                    for x in sequence(s.get("devices"), f"{at} devices", PlanError))
    if not devices:
        raise PlanError(f"{at}: stage [{start}, {end}) has no devices")
    if len(set(devices)) != len(devices):
        raise PlanError(f"{at}: stage [{start}, {end}) names a device twice: {list(devices)}")
    recompute = s.get("recompute", "none")
    if not isinstance(recompute, str) or recompute not in RECOMPUTE_KINDS:
        raise PlanError(f"{at}: stage recompute must be one of {', '.join(RECOMPUTE_KINDS)}, got {recompute!r}")
    return start, end, devices, Recompute(recompute)


def _from_v3(d: dict) -> dict:
    known_keys(d, _V3_KEYS, "plan", PlanError)
    missing = [k for k in ("model", "cluster", "world_size", "seq_len", "global_batch", "replicas") if k not in d]
    if missing:
        raise PlanError(f"plan is missing {', '.join(missing)}")
    schedule = d.get("pipeline_schedule", "1f1b")
    if schedule not in V3_SCHEDULES:
        raise PlanError(f"a version-3 plan's pipeline schedule must be one of {', '.join(V3_SCHEDULES)}, "
                        f"got {schedule!r}")
    groups = []
    replicas = sequence(d["replicas"], "plan replicas", PlanError)
    if not replicas:
        raise PlanError("a plan needs at least one replica group")
    for i, r in enumerate(replicas):
        where = f"replica {i}"
        mapping(r, where, PlanError)
        known_keys(r, _V3_REPLICA_KEYS, where, PlanError)
        if "stages" not in r or "batch" not in r:
            raise PlanError(f"{where}: needs 'batch' and 'stages' (and 'num_microbatches')")
        stages = [_v3_stage(s, f"{where} stage {j}") for j, s in enumerate(sequence(r["stages"], f"{where} stages",
                                                                                  PlanError))]
        if not stages:
            raise PlanError(f"{where}: a replica needs at least one stage")
        if stages[0][0] != 0:
            raise PlanError(f"{where}: a replica's first stage must start at layer 0, not {stages[0][0]}")
        for a, b in zip(stages, stages[1:]):
            if b[0] != a[1]:
                raise PlanError(f"{where}: replica stages [{a[0]}, {a[1]}) and [{b[0]}, {b[1]}) are not contiguous")
        groups.append({
            "ranks": [rank_runs(devices) for _, _, devices, _ in stages],
            "share": whole(r["batch"], f"{where} batch", PlanError),
            "num_microbatches": whole(r.get("num_microbatches", 1), f"{where} num_microbatches", PlanError),
            "virtual_stages": 1,
            "stages": [{"layers": [a, b], "strategies": [str(LayerStrategy(tp=len(devs), dp=1, zero=0,
                                                                           recompute=rc))] * (b - a)}
                       for a, b, devs, rc in stages]})
    return {"version": 3, "model": d["model"], "cluster": d["cluster"],
            "world_size": whole(d["world_size"], "plan world_size", PlanError),
            "seq_len": whole(d["seq_len"], "plan seq_len", PlanError),
            "global_batch": whole(d["global_batch"], "plan global_batch", PlanError), "pipeline_schedule": schedule,
            "cost_source": d.get("cost_source", "preset"), "overlap": FASTEST.to_dict(), "groups": groups,
            "unused": [whole(x, "unused device", PlanError, minimum=0)
                       for x in sequence(d.get("unused", []), "plan unused", PlanError)],
            "predicted": d.get("predicted", {})}


def _blocks(group: dict) -> list[tuple[int, ...]]:
    return [parse_rank_runs(b, "ranks") for b in group["ranks"]]


def _in_rank_order(d: dict) -> bool:
    """Whether today's dict ``d`` is one group over every rank in the rank order (flexmesh.layout.mesh)."""
    if len(d["groups"]) != 1 or d["unused"]:
        return False
    blocks = _blocks(d["groups"][0])
    per = d["world_size"] // len(blocks)
    return blocks == [tuple(range(p * per, (p + 1) * per)) for p in range(len(blocks))]


def _v3_replica_form(d: dict) -> bool:
    """Whether every group is one pipeline of one tp group per stage, dp 1, no cp, one strategy per stage
    (what version 3 could write), under TP overlap as version 3 priced."""
    if d["overlap"] != FASTEST.to_dict() or d["pipeline_schedule"] not in V3_SCHEDULES:
        return False
    for g in d["groups"]:
        if g["virtual_stages"] != 1:
            return False
        for block, st in zip(_blocks(g), g["stages"]):
            strategies = {LayerStrategy.parse(s) for s in st["strategies"]}
            if len(strategies) != 1:
                return False
            first = strategies.pop()
            if first != LayerStrategy(tp=len(block), dp=1, zero=0, recompute=first.recompute):
                return False
    return True


def legacy_dict(d: dict, version: int) -> dict:
    """The dict an older flexmesh wrote for the plan whose dict (:meth:`Plan.to_dict
    <flexmesh.layout.plan.Plan.to_dict>`) is ``d`` and which was read from a file of ``version``:
    version 2 for one group in the rank order (unless read as version 3 and of its form), version 3
    for replicas of one tp group per stage, else version 4 (``d`` without the groups' ``microbatch_tokens``)."""
    if _in_rank_order(d) and not (version == 3 and _v3_replica_form(d)):
        g = d["groups"][0]
        return {
            "version": 2, "model": d["model"], "cluster": d["cluster"], "world_size": d["world_size"],
            "pp": len(g["ranks"]), "pipeline_schedule": d["pipeline_schedule"], "virtual_stages": g["virtual_stages"],
            "num_microbatches": g["num_microbatches"], "seq_len": d["seq_len"], "global_batch": d["global_batch"],
            "cost_source": d["cost_source"], "overlap": d["overlap"], "stages": g["stages"],
            "predicted": d["predicted"],
        }
    if not _v3_replica_form(d):
        return {**d, "version": 4, "groups": [{k: v for k, v in g.items() if k != "microbatch_tokens"}
                                              for g in d["groups"]]}
    return {
        "version": 3, "model": d["model"], "cluster": d["cluster"], "world_size": d["world_size"],
        "seq_len": d["seq_len"], "global_batch": d["global_batch"],
        "pipeline_schedule": d["pipeline_schedule"], "cost_source": d["cost_source"],
        "replicas": [{"batch": g["share"], "num_microbatches": g["num_microbatches"],
                      "stages": [{"layers": s["layers"], "devices": list(b),
                                  "recompute": str(LayerStrategy.parse(s["strategies"][0]).recompute)}
                                 for b, s in zip(_blocks(g), g["stages"])]}
                     for g in d["groups"]],
        "unused": d["unused"], "predicted": d["predicted"],
    }
