"""A cost model of another training stack's layer (flexmesh.layout.stack): unfused attention, tensor
parallelism without sequence parallelism, dropout."""

from __future__ import annotations

from flexmesh.cost.training.analytic import AnalyticTiming
from flexmesh.cost.training.model import CostModel
from flexmesh.errors import SpecError
from flexmesh.layout.stack import RUNTIME_STACK, Stack


def with_stack(cost: CostModel, stack: Stack) -> CostModel:
    """``cost`` pricing layers as ``stack`` runs them; ``cost`` itself when it already does.

    >>> from flexmesh.spec import parse_cluster, parse_model
    >>> cm = CostModel(parse_model("llama2-7b"), parse_cluster("8xA100-80GB"))
    >>> with_stack(cm, Stack(dropout=True)).timing.stack.label
    'fused attention, sequence parallel, dropout'
    """
    timing = cost.timing
    if getattr(timing, "stack", None) == stack:
        return cost
    if not isinstance(timing, AnalyticTiming):
        raise SpecError(f"a model profile times flexmesh's own runtime ({RUNTIME_STACK.label}, no dropout), "
                        f"not {stack.label}: drop --model-profile to price that stack")
    timing = AnalyticTiming(cost.model, cost.hw, timing.ring_balanced, stack)
    return CostModel(cost.model, cost.cluster, cost.hw, timing).with_step_overlap(cost.step_overlap)
