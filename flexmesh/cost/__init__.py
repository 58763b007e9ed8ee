"""The one cost model: time and memory of layers, stages, micro-batches and steps."""

from flexmesh.cost.device.hardware import GroupShape, Hardware, group_shape
from flexmesh.cost.training.analytic import AnalyticTiming, activation_elems_per_token
from flexmesh.cost.training.evaluation import Evaluation
from flexmesh.cost.training.model import CostModel
from flexmesh.cost.training.parts import Parts
from flexmesh.cost.training.pipeline import in_flight, pipeline_time, pipeline_times
from flexmesh.cost.training.timing import LayerTimes, LayerTiming
from flexmesh.cost.training.work import LayerCost, MicrobatchPhases, Work

__all__ = [
    "AnalyticTiming", "CostModel", "Evaluation", "GroupShape", "Hardware", "LayerCost", "LayerTimes", "LayerTiming",
    "MicrobatchPhases", "Parts", "Work", "activation_elems_per_token", "group_shape", "in_flight", "pipeline_time",
    "pipeline_times",
]
