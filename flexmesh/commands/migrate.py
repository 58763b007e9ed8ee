"""Migration to a new layout when a straggler makes one pay (``flexmesh train --migrate``).

The straggler monitor (flexmesh.runtime.train.stragglers) detects a sustained slowdown; the training loop
(flexmesh.runtime.train.loop.fit) then writes a checkpoint, timing it, and asks :class:`MigrationCheck`
(rank 0) whether a new layout pays for its migration. This module decides, because the decision
needs the planner and the runtime may not import it (docs/architecture.md):

1. The cluster of the plan, with the measured speeds as ``speed_factors`` (each rank at its data
   rank's sustained speed, relative to the fastest).
2. The mixed-cluster planner (flexmesh.search.mixed.plan_mixed) plans the run's model, sequence
   length and global batch on it: replica groups with batch shares by speed, other cuts, or devices
   left unused. The current layout is priced by the same cost model (flexmesh.cost.training.mixed) as it runs
   now, with the batch shares its schedules use (the re-planned speeds when the per-step schedules
   were re-balanced, else the speeds they assumed): a plan of one group in the rank order as its
   data-parallel replicas (``flexmesh.layout.mesh.replica_groups``), a plan of several groups as it is.
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
   name), with every other flag as given (an emulated slow rank stays slow and watched; a new plan
   that could not emulate it is declined). It does not pay: a ``migration_declined`` event and the
   run trains on without a restart (a relaunch on the same plan would only pay the cost).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

from flexmesh.errors import FlexmeshError, PlanError
from flexmesh.files import write_atomic
from flexmesh.inputs import load_json
from flexmesh.layout.mesh import replica_groups
from flexmesh.layout.plan import Plan
from flexmesh.layout.shares import split_by_weight
from flexmesh.runtime.state.rundir import MIGRATED_PLAN, MIGRATION_FILE
from flexmesh.spec.model import ModelSpec

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
# per-step re-plan (flexmesh.runtime.train.stragglers.StragglerConfig.min_gain, 0.02).
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


class MigrationCheck:
    """``fit(..., migration=...)``'s decision hook (module doc). ``due`` runs on every rank (the
    detection events are the same everywhere); ``decide`` on rank 0."""

    def __init__(self, plan: Plan, spec: ModelSpec, monitor, out: str, max_steps: int,
                 emulate_speed: tuple = ()) -> None:
        self.plan, self.spec, self.monitor, self.out, self.max_steps = plan, spec, monitor, Path(out), max_steps
        self.emulate_speed = emulate_speed
        self.started = time.monotonic() - (process_age_s() or 0.0)
        self.startup_s: float | None = None

    def due(self, m) -> bool:
        if self.startup_s is None:  # the first step: the run's start-up is now known
            self.startup_s = max(0.0, time.monotonic() - self.started - m.step_time_s)
        return any(e.get("event") in TRIGGERS for e in m.events)

    def _per_rank(self, per_data: list[float]) -> list[float]:
        """Each global rank at its data rank's figure (an unused device at the fastest's, 1.0)."""
        return [1.0 if d is None else float(per_data[d]) for d in self.monitor.data_of]

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
        except FlexmeshError as e:  # nothing fits, a cluster that prices nothing, a layout without replica groups
            return {"event": "migration_declined", **event, "reason": str(e)}
        gain = 1.0 - then / now if now > 0 else 0.0
        saved = gain * m.step_time_s * remaining
        event.update({"to": new.layout, "predicted_step_s": [round(now, 6), round(then, 6)],
                      "predicted_gain": round(now / then if then > 0 else 1.0, 4),  # a ratio, as in `replanned`
                      "predicted_saving_s": round(saved, 3)})
        if not pays(gain * m.step_time_s, remaining, cost, gain):
            return {"event": "migration_declined", **event,
                    "reason": "too few remaining steps" if gain > MIN_GAIN else "no predicted gain"}
        path = self.out / MIGRATED_PLAN.format(step=m.step)
        new.save(path)
        event["plan"] = path.name
        request = {"step": m.step, "checkpoint": f"step_{m.step:06d}", "plan": str(path.resolve())}
        write_atomic(self.out / MIGRATION_FILE, json.dumps(request, indent=2) + "\n")
        return {"event": "migrated", **event}

    def _plan(self, speeds: list[float], scheduled: list[float]) -> tuple[Plan, float, float]:
        """(the planner's plan at ``speeds``, predicted step time now, predicted step time on it)."""
        from flexmesh.cost.training.mixed import MixedCosts, evaluate_groups
        from flexmesh.search.mixed import plan_mixed
        from flexmesh.spec.cluster import parse_mixed_cluster

        base = parse_mixed_cluster(self.plan.cluster)
        cluster = replace(base, groups=tuple(replace(g, speed_factors=tuple(speeds[base.group_start(i) + j]
                                                                            for j in range(g.world_size)))
                                             for i, g in enumerate(base.groups)))
        costs = MixedCosts(self.spec, cluster)
        current = replica_groups(self.plan) if self.plan.in_rank_order else self.plan
        weights = [g.share * min(scheduled[r] for r in g.ranks) for g in current.groups]
        shares = split_by_weight(current.global_batch, weights)
        current = replace(current, groups=tuple(replace(g, share=b, num_microbatches=math.gcd(b, g.num_microbatches))
                                                for g, b in zip(current.groups, shares)))
        now = evaluate_groups(current, costs).step_time
        result = plan_mixed(self.spec, cluster, self.plan.seq_len, self.plan.global_batch, costs)
        plan, ev = result.plan, result.evaluation
        if self.emulate_speed:  # the relaunch keeps emulating the slow rank: the fastest plan that allows it
            plan, ev = _first_emulable(result.candidates, self.emulate_speed)
        # The plan names the run's model as the run does (a preset or a config file's path, or the
        # config.json it records).
        return replace(plan, model=self.plan.model, model_config=self.plan.model_config), now, ev.step_time


def _first_emulable(candidates, emulate_speed):  # noqa: ANN001, ANN202 - (Plan, evaluation) pairs
    """The fastest of ``candidates`` whose ranks the relaunch can emulate (PlanError naming why none)."""
    from flexmesh.runtime.train.groups import check_emulation

    refusal = None
    for plan, ev in candidates:
        try:
            check_emulation(plan, emulate_speed)
        except FlexmeshError as e:
            refusal = refusal or e
            continue
        return plan, ev
    raise refusal or PlanError("no plan of the search runs the emulated ranks")


def take_request(out: str | Path) -> dict | None:
    """The launcher: the relaunch request a migrating run left in ``out`` (removed), or None."""
    path = Path(out) / MIGRATION_FILE
    if not path.is_file() or path.is_symlink():  # only the file the run wrote, not one planted as a link
        return None
    request = load_json(path, PlanError, invalid="not a migration request this run wrote ({reason}); delete it and "
                        "run the same command again to resume")
    ok = isinstance(request, dict) and all(isinstance(request.get(k), str) for k in ("plan", "checkpoint"))
    step = request["checkpoint"].removeprefix("step_") if ok else ""
    if not ok or not Path(request["plan"]).is_file() or not (step.isdigit() and step.isascii()):
        raise PlanError(f"{path} is not a migration request this run wrote (a JSON object naming an existing plan "
                        "file and a checkpoint step folder); delete it and run the same command again to resume")
    path.unlink()
    return request


def relaunch_argv(argv: list[str], plan: str) -> list[str]:
    """The ranks' command line on the new plan: ``--plan`` replaced, every other flag kept.

    >>> relaunch_argv(["train", "--plan", "a.json", "--emulate-speed", "1=0.5", "--migrate"], "b.json")
    ['train', '--emulate-speed', '1=0.5', '--migrate', '--plan', 'b.json']
    """
    from flexmesh.runtime.launch import without_flags

    return [*without_flags(argv, ["--plan"], []), "--plan", plan]
