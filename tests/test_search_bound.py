"""The search prices configurations best first and stops at a lower bound: it returns what pricing every
configuration returns, and the bound never exceeds a configuration's own best estimate."""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest

from flexmesh.cost import CostModel
from flexmesh.search import SearchRequest
from flexmesh.search.driver import search
from flexmesh.search.space import FULL_SPACE
from flexmesh.spec import parse_cluster, parse_model

search_module = importlib.import_module("flexmesh.search.driver")

CASES = [  # (model, cluster, seq len, global batch): memory loose, memory tight, a world not a power of two
    ("llama2-7b", "8xA100-80GB", 2048, 64),
    ("llama2-13b", "8xA100-40GB", 8192, 32),
    ("llama3-8b", "12xH100", 8192, 48),
]


def _request(model, cluster, seq, gb):
    spec, c = parse_model(model), parse_cluster(cluster)
    return SearchRequest(spec, c, seq, gb, cost=CostModel(spec, c), top=1)


@pytest.mark.parametrize("case", CASES, ids=[f"{m}-{c}" for m, c, _, _ in CASES])
def test_bounded_search_returns_what_pricing_every_configuration_returns(case, monkeypatch):
    bounded = search(_request(*case))
    monkeypatch.setattr(search_module, "BOUNDED", False)
    everything = search(_request(*case))
    assert bounded.candidates, "nothing fits: the case tests nothing"
    # exact: the bound skips configurations, pricing the rest the same way
    assert [(c.plan.layout, c.evaluation.step_time) for c in bounded.candidates] == \
        [(c.plan.layout, c.evaluation.step_time) for c in everything.candidates]
    assert bounded.configurations < everything.configurations  # the bound skipped some


@pytest.mark.parametrize("case", CASES[:2], ids=[f"{m}-{c}" for m, c, _, _ in CASES[:2]])
def test_lower_bound_never_exceeds_a_configurations_best_estimate(case):
    request = _request(*case).resolved()
    method = search_module.choose_method(request)
    checked = 0
    for config in search_module._configurations(request):
        bound = search_module._lower_bound(request, config)
        _, found, deferred = search_module._search_configuration(request, method, config)
        for _, _, overlap in deferred:  # the options the search prices later where their bound is low
            found += search_module._search_configuration(request, method, config, only=overlap)[1]
        estimates = [f[0] for f in found]
        if estimates:
            assert bound <= min(estimates) * (1 + 1e-12), config
            checked += 1
        else:
            assert bound >= 0.0
    assert checked > 5


def test_searches_sharing_a_cost_model_return_what_fresh_ones_return():
    """What one search keeps for later ones under the same cost model (floors, pruned strategies) is keyed
    by all it depends on: searches for other batches and spaces return what they return alone."""
    model, cluster = parse_model("llama3-8b"), parse_cluster("12xH100")
    shared = CostModel(model, cluster)
    asks = [(48, FULL_SPACE), (24, FULL_SPACE), (36, replace(FULL_SPACE, pp=(1,), tp=(2,))), (48, FULL_SPACE)]
    for gb, space in asks:
        again = search(SearchRequest(model, cluster, 8192, gb, space, cost=shared, top=2))
        fresh = search(SearchRequest(model, cluster, 8192, gb, space, cost=CostModel(model, cluster), top=2))
        assert fresh.candidates
        # exact: a shared cost model prices as a fresh one, the same operations
        assert [(c.plan.layout, c.evaluation.step_time) for c in again.candidates] == \
            [(c.plan.layout, c.evaluation.step_time) for c in fresh.candidates]
    assert len(search_module._shared(shared)) > len(search_module._shared(CostModel(model, cluster)))
