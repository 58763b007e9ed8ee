"""Small, fast schedule contexts for tests, doctests and examples (no profile needed).

``tiny_context`` uses llama2-7b with ZeRO-3 on A100-80GB nodes so that memory really binds: a single
rank holds a few thousand tokens, larger groups proportionally more, and long sequences must span
several ranks. Times and memory come from the one cost model like everywhere else.
"""

from __future__ import annotations

from flexmesh.cost import CostModel
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.schedule.context import ScheduleContext
from flexmesh.spec.cluster import parse_cluster
from flexmesh.spec.model import parse_model


def tiny_context(num_ranks: int = 8, model: str = "llama2-7b", device: str = "A100-80GB", pp: int = 1,
                 recompute: bool = False, speed: tuple[float, ...] = (), cp_kind: str = "ulysses") -> ScheduleContext:
    """A context over ``num_ranks`` data ranks (8 per node), ZeRO-3, optional pipeline and speed factors."""
    per = min(8, num_ranks * pp)
    nodes = max(1, num_ranks * pp // per)
    cost = CostModel(parse_model(model), parse_cluster(f"{nodes}x{per}x{device}"))
    return ScheduleContext(cost=cost, base=LayerStrategy(zero=3, recompute=recompute), num_ranks=num_ranks, pp=pp,
                           cp_kind=cp_kind, speed=tuple(speed))
