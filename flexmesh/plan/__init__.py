"""Parallel layouts: per-layer strategies, the Plan file, and the search that finds the best plan."""

from flexmesh.plan.plan import Plan, StagePlan, rank_coords
from flexmesh.plan.strategy import LayerStrategy

__all__ = ["LayerStrategy", "Plan", "StagePlan", "rank_coords"]
