"""The one cost model: time and memory of layers, stages, micro-batches and steps."""

from flexmesh.cost.hardware import GroupShape, Hardware, group_shape
from flexmesh.cost.model import (
    CostModel,
    Evaluation,
    LayerCost,
    MicrobatchPhases,
    Work,
    activation_elems_per_token,
    in_flight,
    pipeline_time,
)

__all__ = [
    "CostModel", "Evaluation", "GroupShape", "Hardware", "LayerCost", "MicrobatchPhases", "Work", "activation_elems_per_token",
    "group_shape", "in_flight", "pipeline_time",
]
