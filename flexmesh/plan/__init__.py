"""Parallel layouts: per-layer strategies, the Plan file, and the search that finds the best plan."""

from flexmesh.plan.plan import Plan, StagePlan, rank_coords
from flexmesh.plan.strategy import LayerStrategy

# The search, baselines and checker import the cost model, which itself imports LayerStrategy from
# this package; loading them lazily (PEP 562) keeps `import flexmesh.cost` free of an import cycle.
_LAZY = {
    "Candidate": "search", "SearchResult": "search", "SearchSpace": "search", "candidate_strategies": "search",
    "megatron_3d": "baselines", "uniform_plan": "baselines", "zero3_ulysses": "baselines",
    "check_plan": "check",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"flexmesh.plan.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'flexmesh.plan' has no attribute {name!r}")


__all__ = ["LayerStrategy", "Plan", "StagePlan", "rank_coords", *_LAZY]
