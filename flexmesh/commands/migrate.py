"""Migration to a new layout when a straggler makes one pay (``flexmesh train --migrate``).

The straggler monitor (flexmesh.runtime.stragglers) detects a sustained slowdown; the training loop
(flexmesh.runtime.loop.fit) then writes a checkpoint, timing it, and asks :class:`MigrationCheck`
(rank 0) whether a new layout pays for its migration. This module decides, because the decision
needs the planner and the runtime may not import it (docs/architecture.md):

1. The cluster of the plan, with the measured speeds as ``speed_factors`` (each rank at its data
   rank's sustained speed, relative to the fastest).
2. The heterogeneous planner (flexmesh.plan.hetero.plan_hetero) plans the run's model, sequence
   length and global batch on it: replicas with batch shares by speed, other cuts, or devices left
   unused. The current layout is priced by the same cost model (flexmesh.plan.hetero_cost) as it
   runs now: the uniform plan as replicas (``HeteroPlan.from_uniform``) with the batch shares its
   schedules use (the re-planned speeds when the per-step schedules were re-balanced, else the
   speeds they assumed).
3. Gain: ``1 - new / current`` of the predicted step times, a fraction (so a cost model off by the
   same factor on both, e.g. a preset for another device, still compares); time saved per step is
   that fraction of the measured step time; over the remaining steps it must exceed the cost:
   the checkpoint save just measured, its load (:data:`LOAD_PER_SAVE`) and the restart (this run's
   own measured start-up: from its process start to the first step, corpus, tokenizer, model and
   process groups included).
4. It pays: the new plan is saved into ``--out`` (``plan-migrated-NNNNNN.json``), the step's metrics
   row gets a ``migrated`` event, ``--out/migration.json`` tells the launcher, and the ranks exit;
   the launcher (flexmesh.commands.train) relaunches torchrun on the new plan, allowing the resume
   from that one checkpoint under another plan (:data:`RESHARD_ENV`; DCP reshards by parameter
   name). It does not pay: a ``migration_declined`` event and the run trains on without a restart
   (a relaunch on the same plan would only pay the cost).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

from flexmesh.errors import FlexmeshError
from flexmesh.files import write_atomic
from flexmesh.layout.hetero import HeteroPlan, Replica
from flexmesh.layout.mesh import rank_coords
from flexmesh.layout.plan import Plan
from flexmesh.spec.model import ModelSpec

MIGRATION_FILE = "migration.json"  # in --out: the launcher's request to relaunch on a new plan
# The checkpoint folder (step_NNNNNN) the relaunched ranks may resume from under the new plan.
RESHARD_ENV = "FLEXMESH_RESHARD_FROM"
# A testing knob, not a feature (tests/test_migration.py): replaces the migration's cost in seconds, so
# a short test run decides deterministically (0: any predicted gain pays, huge: nothing pays).
COST_ENV = "FLEXMESH_TESTING_MIGRATION_COST_S"
# Loading a checkpoint reads back the bytes its save wrote, through the same filesystem and DCP: its
# time is taken as the measured save time (DCP's load and save both move every shard once; the
# sha256 check on load adds one read, not counted: a lower bound, so migrations are not refused on
# a guess).
LOAD_PER_SAVE = 1.0
# The predicted gain must beat the simulator's scatter between two layouts of one batch, as for a
# per-step re-plan (flexmesh.runtime.stragglers.StragglerConfig.min_gain, 0.02).
MIN_GAIN = 0.02
TRIGGERS = ("straggler_detected", "speed_changed")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), or None elsewhere."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def pays(saved_per_step_s: float, remaining_steps: int, cost_s: float, gain: float) -> bool:
    """Whether migrating pays: a predicted gain above :data:`MIN_GAIN` that saves more than it costs.

    >>> pays(0.5, 10, 4.0, 0.3), pays(0.5, 4, 4.0, 0.3), pays(0.5, 100, 4.0, 0.01)
    (True, False, False)
    """
    return gain > MIN_GAIN and saved_per_step_s * remaining_steps > cost_s


def split_by_speed(total: int, speeds: list[float]) -> list[int]:
    """``total`` documents over replicas in proportion to their speeds, at least one each (largest remainder).

    >>> split_by_speed(8, [1.0, 0.25]), split_by_speed(4, [1.0, 1.0]), split_by_speed(3, [1.0, 0.01])
    ([6, 2], [2, 2], [2, 1])
    """
    n = len(speeds)
    spare = total - n
    exact = [spare * s / sum(speeds) for s in speeds]
    out = [1 + int(x) for x in exact]
    order = sorted(range(n), key=lambda i: -(exact[i] - int(exact[i])))
    for i in order[:total - sum(out)]:
        out[i] += 1
    return out


class MigrationCheck:
    """``fit(..., migration=...)``'s decision hook (module doc). ``due`` runs on every rank (the
    detection events are the same everywhere); ``decide`` on rank 0."""

    def __init__(self, plan: Plan, spec: ModelSpec, monitor, out: str, max_steps: int) -> None:
        self.plan, self.spec, self.monitor, self.out, self.max_steps = plan, spec, monitor, Path(out), max_steps
        self.started = time.monotonic() - (process_age_s() or 0.0)
        self.startup_s: float | None = None

    def due(self, m) -> bool:
        if self.startup_s is None:  # the first step: the run's start-up is now known
            self.startup_s = max(0.0, time.monotonic() - self.started - m.step_time_s)
        return any(e.get("event") in TRIGGERS for e in m.events)

    def _per_rank(self, per_data: list[float]) -> list[float]:
        lay = self.monitor.layout
        coords = [rank_coords(r, lay.pp, lay.dp, lay.cp, lay.tp) for r in range(lay.world_size)]
        return [float(per_data[c["dp"] * lay.cp + c["cp"]]) for c in coords]

    def decide(self, m, save_s: float) -> dict:
        speeds = self._per_rank(list(self.monitor.detector.baseline))
        replanned = [e for e in m.events if e.get("event") == "replanned"]
        scheduled = self._per_rank(replanned[-1]["speeds"]) if replanned else [float(x) for x in m.assumed_speed]
        remaining = self.max_steps - m.step
        load_s = LOAD_PER_SAVE * save_s
        restart_s = self.startup_s or 0.0
        cost = save_s + load_s + restart_s
        forced = os.environ.get(COST_ENV)
        event: dict = {"from": self.plan.layout, "speeds": [round(s, 3) for s in speeds],
                       "remaining_steps": remaining, "measured_step_s": round(m.step_time_s, 6),
                       "cost_s": {"save": round(save_s, 3), "load": round(load_s, 3), "restart": round(restart_s, 3),
                                  "total": round(float(forced) if forced else cost, 3)}}
        if forced:
            event["cost_s"]["testing_override"] = True
            cost = float(forced)
        try:
            new, now, then = self._plan(speeds, scheduled)
        except FlexmeshError as e:  # nothing fits, a cluster that prices nothing, a layout without a hetero form
            return {"event": "migration_declined", **event, "reason": str(e)}
        gain = 1.0 - then / now if now > 0 else 0.0
        saved = gain * m.step_time_s * remaining
        event.update({"to": new.layout, "predicted_step_s": [round(now, 6), round(then, 6)],
                      "predicted_gain": round(gain, 4), "predicted_saving_s": round(saved, 3)})
        if not pays(gain * m.step_time_s, remaining, cost, gain):
            return {"event": "migration_declined", **event,
                    "reason": "too few remaining steps" if gain > MIN_GAIN else "no predicted gain"}
        path = self.out / f"plan-migrated-{m.step:06d}.json"
        new.save(path)
        event["plan"] = path.name
        request = {"step": m.step, "checkpoint": f"step_{m.step:06d}", "plan": str(path.resolve())}
        write_atomic(self.out / MIGRATION_FILE, json.dumps(request, indent=2) + "\n")
        return {"event": "migrated", **event}

    def _plan(self, speeds: list[float], scheduled: list[float]) -> tuple[HeteroPlan, float, float]:
        """(the planner's plan at ``speeds``, predicted step time now, predicted step time on it)."""
        from flexmesh.plan.hetero import plan_hetero
        from flexmesh.plan.hetero_cost import MixedCosts, evaluate_hetero
        from flexmesh.spec.cluster import MixedCluster, parse_cluster

        cluster = MixedCluster((replace(parse_cluster(self.plan.cluster), speed_factors=tuple(speeds)),))
        costs = MixedCosts(self.spec, cluster)
        current = HeteroPlan.from_uniform(self.plan)
        shares = split_by_speed(current.global_batch,
                                [min(scheduled[d] for s in r.stages for d in s.devices) for r in current.replicas])
        current = replace(current, replicas=tuple(
            Replica(r.stages, b, math.gcd(b, r.num_microbatches)) for r, b in zip(current.replicas, shares)))
        now = evaluate_hetero(current, costs).step_time
        result = plan_hetero(self.spec, cluster, self.plan.seq_len, self.plan.global_batch, costs)
        # The plan names the run's model as the run does (a preset or a config file's path).
        return replace(result.plan, model=self.plan.model), now, result.evaluation.step_time


def take_request(out: str | Path) -> dict | None:
    """The launcher: the relaunch request a migrating run left in ``out`` (removed), or None."""
    path = Path(out) / MIGRATION_FILE
    if not path.is_file():
        return None
    request = json.loads(path.read_text())
    path.unlink()
    return request


def relaunch_argv(argv: list[str], plan: str) -> list[str]:
    """The ranks' command line on the new plan: ``--plan`` replaced, and the flags a heterogeneous
    plan refuses dropped (per-step policies and their pricing, ``--global-batch``: the plan's batch
    shares fix them; ``--emulate-speed``: not supported on heterogeneous plans yet).

    >>> relaunch_argv(["train", "--plan", "a.json", "--emulate-speed", "1=0.5", "--migrate"], "b.json")
    ['train', '--migrate', '--plan', 'b.json']
    """
    from flexmesh.commands.train_hetero import _NOT_FOR_HETERO
    from flexmesh.runtime.launch import without_flags

    switches = [flag for flag, _, unset in _NOT_FOR_HETERO if unset is False]
    valued = [flag for flag, _, unset in _NOT_FOR_HETERO if unset is not False]
    return [*without_flags(argv, ["--plan", "--emulate-speed", "--global-batch", *valued], switches), "--plan", plan]
