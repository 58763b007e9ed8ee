"""The mixed search returns the best plan of its whole space under its own cost model: the same step as
pricing every configuration in full, on small clusters of three device types, over fast and over slow
networks (where ranking by the pipelines alone picks plans the gradient all-reduce makes slow)."""

from __future__ import annotations

import math
from functools import cache

import pytest

from flexmesh.cost.training.mixed import evaluate_groups
from flexmesh.search.mixed import MixedSearch
from flexmesh.search.mixed_partition import ReplicaClass, split_batch
from flexmesh.spec import parse_model
from flexmesh.spec.cluster import parse_mixed_cluster

SLOW = """
[[groups]]
nodes = 1
devices_per_node = 2
device = { base = "RTX-3090", node_net_gbps = 1.25 }

[[groups]]
nodes = 1
devices_per_node = 2
device = { base = "A100-PCIe-40GB", node_net_gbps = 1.25 }

[[groups]]
nodes = 1
devices_per_node = 2
device = { base = "V100-32GB", node_net_gbps = 1.25 }

[links.0-1]
gbps = 1.25
latency_us = 50.0
[links.0-2]
gbps = 1.25
latency_us = 50.0
[links.1-2]
gbps = 1.25
latency_us = 50.0
"""


def priced(search: MixedSearch, config, split) -> tuple | None:  # noqa: ANN001
    """:meth:`MixedSearch.estimate` without its lower bounds: (slowest pipeline s, replicas, their
    partitions, micro-batches each) of every configuration that fits, by ``split`` (split_batch)."""
    replicas, parts = [], []
    for shape, n, offsets in search.blocks(config):
        block = search.block_partitions(shape, n, offsets, config.tps, config.mu)
        if block is None:
            return None
        replicas += search.block_replicas(shape, n, offsets, config.tps)
        parts += block
    classes: dict[tuple, list[int]] = {}
    for i, p in enumerate(parts):
        classes.setdefault(p.times, []).append(i)
    res = split(tuple(ReplicaClass(len(v), sum(k) - max(k), max(k)) for k, v in classes.items()),
                search.global_batch // config.mu)
    if res is None:
        return None
    micro = [0] * len(replicas)
    for members, counts in zip(classes.values(), res[1]):
        for i, m in zip(members, counts):
            micro[i] = m
    return res[0], replicas, parts, micro


def exhaustive(search: MixedSearch) -> tuple[float, float]:
    """(best full step over every configuration and the per-type plans, full step of the configuration
    whose pipelines alone look fastest)."""
    split = cache(split_batch)  # half the configurations split the same replica classes
    best, by_pipeline = math.inf, (math.inf, math.inf)
    for config in search.configurations():
        est = priced(search, config, split)
        if est is None:
            continue
        ev = evaluate_groups(search.build(config, *est[1:]), search.costs)
        step = ev.step_time if ev.fits else math.inf
        best = min(best, step)
        by_pipeline = min(by_pipeline, (est[0], step))
    for plan in search.types.plans():
        ev = evaluate_groups(plan, search.costs)
        if ev.fits:
            best = min(best, ev.step_time)
    return best, by_pipeline[1]


@pytest.mark.slow
# One node of each type over slow links; over fast ones, several nodes of two types beside a node of four
# (8 GPUs, 2,000 configurations priced in full). One node of each type over fast links added nothing to these
# two, and two nodes of each type (16 GPUs) only more configurations (4,000: a minute).
@pytest.mark.parametrize("cluster, batch", [("slow", 32), ("2x1xRTX-3090+1x4xA100-PCIe-40GB+2x2xV100-32GB", 32)])
def test_the_mixed_search_equals_exhaustive_pricing(cluster, batch, tmp_path):
    if cluster == "slow":
        (tmp_path / "slow.toml").write_text(SLOW)
        cluster = str(tmp_path / "slow.toml")
    model = parse_model("gpt:8:512:8@fp16")  # V100s train in fp16
    found = MixedSearch(model, parse_mixed_cluster(cluster), 1024, batch).run()
    best, by_pipeline = exhaustive(MixedSearch(model, parse_mixed_cluster(cluster), 1024, batch))
    assert found.evaluation.step_time == pytest.approx(best, rel=1e-12)
    if "slow" in cluster:  # 10 Gb/s between the types: the fastest pipelines sync slowest
        assert by_pipeline > 1.2 * best
