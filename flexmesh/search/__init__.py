"""The static search: the fastest parallel layout that fits, its baselines, and the plan checker.

Modules, top to bottom: ``baselines`` (a mixed cluster's baselines, on ``best``), ``best`` (searched plans
ranked beside the uniform baselines; the entry point), ``driver`` (over configurations) and
``uniform_baselines`` (published uniform layouts), ``exact`` / ``fast`` (the two search methods),
``stage`` (what both methods share), ``space`` (the search space, candidate strategies, plan building)
and ``partition`` (layer splits); ``mixed`` (and ``mixed_partition``, ``mixed_types``) plans replica
groups on a mixed cluster, ``replicas`` a LoRA mix of replicas as replica groups; ``check`` validates a
plan file. The Plan format itself lives on the ground floor (flexmesh.layout.plan).
"""

from flexmesh.search.best import SearchResult, best_plans
from flexmesh.search.check import check_plan
from flexmesh.search.space import Candidate, SearchRequest, SearchSpace, candidate_strategies
from flexmesh.search.uniform_baselines import megatron_3d, uniform_plan, zero3_ulysses

__all__ = ["Candidate", "SearchRequest", "SearchResult", "SearchSpace", "best_plans", "candidate_strategies",
           "check_plan", "megatron_3d", "uniform_plan", "zero3_ulysses"]
