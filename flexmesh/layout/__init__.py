"""The ground floor, torch-free: what a job's layout is, written down once.

- :mod:`~flexmesh.layout.enums`: pipeline schedule, context-parallel kind, policy, mesh axis;
- :mod:`~flexmesh.layout.strategy`: ``LayerStrategy``, one layer's parallel strategy;
- :mod:`~flexmesh.layout.plan`: ``Plan`` / ``StagePlan``, the versioned plan file (its ranks written as
  runs by :mod:`~flexmesh.layout.ranks`);
- :mod:`~flexmesh.layout.plan_model`: the model a plan runs with, found again from what the plan records;
- :mod:`~flexmesh.layout.mesh`: the rank order (coordinates, global and data ranks) and ``Layout``;
- :mod:`~flexmesh.layout.step`: ``StepSchedule``, one step's split, pack and assignment.
"""

from flexmesh.layout.enums import CPKind, MeshAxis, PipelineSchedule, Policy
from flexmesh.layout.plan import Plan, StagePlan
from flexmesh.layout.step import Group, MicroBatch, Piece, StepSchedule
from flexmesh.layout.strategy import LayerStrategy

__all__ = ["CPKind", "Group", "LayerStrategy", "MeshAxis", "MicroBatch", "Piece", "PipelineSchedule", "Plan",
           "Policy", "StagePlan", "StepSchedule"]
