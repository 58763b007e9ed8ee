"""The static search: the fastest parallel layout that fits, its baselines, and the plan checker.

The Plan format itself lives on the ground floor (flexmesh.layout.plan).
"""

from flexmesh.plan.baselines import megatron_3d, uniform_plan, zero3_ulysses
from flexmesh.plan.check import check_plan
from flexmesh.plan.search import Candidate, SearchResult, SearchSpace, candidate_strategies

__all__ = ["Candidate", "SearchResult", "SearchSpace", "candidate_strategies", "check_plan", "megatron_3d",
           "uniform_plan", "zero3_ulysses"]
