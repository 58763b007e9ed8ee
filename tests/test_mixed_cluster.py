"""Mixed clusters: `+` strings and TOML/JSON files with [[groups]] and links, rank numbering, and a
one-line SpecError for every bad input (parse_cluster refuses mixed clusters, saying where they go)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_parsers import FUZZ, _only_user_errors, corrupted

from flexmesh.errors import FlexmeshError, SpecError
from flexmesh.spec.cluster import MixedCluster, parse_cluster, parse_mixed_cluster
from flexmesh.spec.model import parse_model


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text.strip() and "Traceback" not in text
    return text


def test_plus_string_numbers_ranks_group_by_group_node_by_node():
    c = parse_mixed_cluster("1x8xH100+2x8xA100-40GB")
    assert c.world_size == 24 and c.nodes == 3 and len(c.groups) == 2
    assert [c.group_of(r) for r in (0, 7, 8, 23)] == [0, 0, 1, 1]
    assert [c.node_of(r) for r in (0, 7, 8, 15, 16, 23)] == [0, 0, 1, 1, 2, 2]
    assert c.device_of(3).name == "H100-80GB" and c.device_of(9).name == "A100-40GB"
    assert c.local_rank(9) == 1 and list(c.ranks(1)) == list(range(8, 24))
    # Default link: the slower group's inter-node network (A100: 200 GB/s per node, 20 us).
    assert (c.link(0, 1).gbps, c.link(1, 0).latency_us) == (200.0, 20.0)
    assert parse_mixed_cluster(c.label).label == c.label  # the label parses back
    assert not c.uniform and parse_mixed_cluster("2x8xH100").uniform


def test_a_plain_string_is_one_group_and_parse_cluster_keeps_its_type():
    one = parse_mixed_cluster("2x8xA100-40GB")
    assert len(one.groups) == 1 and one.groups[0] == parse_cluster("2x8xA100-40GB")


def test_parse_cluster_refuses_a_mixed_cluster_and_says_where_it_is_accepted():
    with pytest.raises(SpecError) as e:
        parse_cluster("1x8xH100+2x8xA100-40GB")
    assert "flexmesh plan" in _one_line(e) and "2 device groups" in str(e.value)


def _write(tmp_path, d, name="mixed.json"):
    path = tmp_path / name
    path.write_text(json.dumps(d) if isinstance(d, (dict, list)) else d)
    return str(path)


TOML = """
[[groups]]
nodes = 1
devices_per_node = 4
device = "H100"
speed_factors = [1.0, 1.0, 0.5, 1.0]

[[groups]]
nodes = 2
devices_per_node = 4
device = {base = "A100-40GB", node_net_gbps = 100.0}

[links]
gbps = 50.0
latency_us = 40.0
"""


def test_toml_file_with_groups_speed_factors_and_links(tmp_path):
    c = parse_mixed_cluster(_write(tmp_path, TOML, "mixed.toml"))
    assert c.world_size == 12 and c.speed(2) == 0.5 and c.speed(3) == 1.0 and c.speed(11) == 1.0
    assert c.groups[1].device.node_net_gbps == 100.0
    assert (c.link(0, 1).gbps, c.link(0, 1).latency_us) == (50.0, 40.0)
    with pytest.raises(SpecError, match="2 device groups"):
        parse_cluster(_write(tmp_path, TOML, "again.toml"))


def test_json_file_with_one_link_per_pair_and_defaults(tmp_path):
    d = {"groups": [{"nodes": 1, "devices_per_node": 8, "device": "H100"},
                    {"nodes": 1, "devices_per_node": 8, "device": "A100-80GB"},
                    {"nodes": 1, "devices_per_node": 8, "device": "A100-40GB"}],
         "links": {"0-2": {"gbps": 12.5, "latency_us": 80}}}
    c = parse_mixed_cluster(_write(tmp_path, d))
    assert c.link(2, 0).gbps == 12.5 and c.link(0, 1).gbps == 200.0 and c.link(1, 2).latency_us == 20.0
    # One group in the groups form is a plain cluster for parse_cluster.
    single = parse_cluster(_write(tmp_path, {"groups": d["groups"][:1]}, "one.json"))
    assert single.label == "8xH100-80GB"


GOOD_GROUP = {"nodes": 1, "devices_per_node": 2, "device": "H100"}


@pytest.mark.parametrize("text,expect", [
    ("1x8xH100+", "group 1 ''"), ("+8xH100", "group 0 ''"), ("1x8xH100+2x8xFOO", "unknown device"),
    ("8xH100+0x8xH100", "nodes must be a whole number"), ("8xH100++8xH100", "group 1"),
    ("8xH100 + banana", "group 1 'banana'"),
])
def test_bad_plus_strings(text, expect):
    with pytest.raises(SpecError) as e:
        parse_mixed_cluster(text)
    assert expect in _one_line(e)


@pytest.mark.parametrize("d,expect", [
    ({"groups": []}, "groups is empty"),
    ({"groups": "8xH100"}, "groups must be a list"),
    ({"groups": [GOOD_GROUP], "group": 1}, "unknown field(s) group"),
    ({"groups": [GOOD_GROUP, {"nodes": 0, "devices_per_node": 2, "device": "H100"}]}, "group 1: nodes"),
    ({"groups": [GOOD_GROUP, {**GOOD_GROUP, "speed_factors": [1.0]}]}, "group 1: cluster has 2 devices"),
    ({"groups": [GOOD_GROUP, {**GOOD_GROUP, "speed_factors": [1.0, math.nan]}]}, "groups[1].speed_factors[1] is NaN"),
    ({"groups": [GOOD_GROUP, 7]}, "group 1: a cluster file must be a JSON object"),
    ({"groups": [GOOD_GROUP, GOOD_GROUP], "links": {"0-0": {"gbps": 1, "latency_us": 1}}}, "link 0-0"),
    ({"groups": [GOOD_GROUP, GOOD_GROUP], "links": {"0-5": {"gbps": 1, "latency_us": 1}}}, "link 0-5"),
    ({"groups": [GOOD_GROUP, GOOD_GROUP], "links": {"zero-one": {"gbps": 1}}}, "links key 'zero-one'"),
    ({"groups": [GOOD_GROUP, GOOD_GROUP], "links": {"0-1": {"gbps": -1, "latency_us": 1}}}, "gbps"),
    ({"groups": [GOOD_GROUP, GOOD_GROUP], "links": {"0-1": {"gbps": 1}}}, "needs gbps and latency_us"),
    ({"groups": [GOOD_GROUP, GOOD_GROUP], "links": {"gbps": 10, "latency_us": math.inf}}, "latency_us"),
    ({"groups": [GOOD_GROUP, GOOD_GROUP], "links": {"gbps": 10, "latency_us": 1, "0-1": {"bw": 3}}},
     "unknown field(s) bw"),
    ({"groups": [GOOD_GROUP, GOOD_GROUP], "links": [1, 2]}, "links must be a JSON object"),
    ({"groups": [GOOD_GROUP, GOOD_GROUP], "links": {"0-1": {"gbps": 1, "latency_us": 1},
                                                    "1-0": {"gbps": 2, "latency_us": 1}}}, "given twice"),
    ({**GOOD_GROUP, "links": {"gbps": 1}}, "needs groups"),
])
def test_bad_mixed_cluster_files(tmp_path, d, expect):
    with pytest.raises(SpecError) as e:
        parse_mixed_cluster(_write(tmp_path, d))
    assert expect in _one_line(e) and "mixed.json" in str(e.value)


def test_bad_ranks_and_groups_are_spec_errors():
    c = parse_mixed_cluster("2xH100+2xA100-40GB")
    for bad in (-1, 4, 2.0):
        with pytest.raises(SpecError, match="not in"):
            c.group_of(bad)
    with pytest.raises(SpecError, match="at least one device group"):
        MixedCluster(())


@FUZZ
@given(st.data())
def test_fuzz_mixed_cluster_file(tmp_path_factory, data):
    valid = {"groups": [{**parse_cluster("1x4xH100").to_dict(), "speed_factors": [1.0, 0.5, 1.0, 1.0]},
                        {"nodes": 2, "devices_per_node": 4, "device": "A100-40GB"}],
             "links": {"gbps": 25.0, "latency_us": 30.0, "0-1": {"gbps": 12.5}}}
    path = tmp_path_factory.mktemp("mixed") / "cluster.json"
    _only_user_errors(lambda p: parse_mixed_cluster(str(p)), path, data.draw(corrupted(valid)))


@FUZZ
@given(st.one_of(st.text(max_size=40),
                 st.from_regex(r"\A(\d{1,4}x)?\d{1,4}x[A-Za-z0-9\-]{0,10}(\+(\d{1,4}x)?\d{1,4}x[A-Za-z0-9\-]{0,10}){0,3}\Z")))
def test_fuzz_mixed_cluster_string(text):
    for parse in (parse_mixed_cluster, parse_cluster):
        try:
            parse(text)
        except FlexmeshError as e:
            assert "\n" not in str(e).strip()


def test_per_node_nics_and_node_links_bound_the_collectives_that_may_cross_them(tmp_path):
    from flexmesh.cost.device.hardware import GroupShape, Hardware

    one = tmp_path / "one.toml"
    one.write_text('nodes = 4\ndevices_per_node = 8\ndevice = "H100"\nnic_gbps = [400.0, 400.0, 50.0, 400.0]\n')
    slow, fast = parse_cluster(str(one)), parse_cluster("4x8xH100")
    assert slow.device.node_net_gbps == 50.0  # a ring over the nodes runs at its slowest NIC
    across = GroupShape(32, 8)
    assert Hardware(slow).collective_time("all_reduce", 2.0**30, across) > \
        4 * Hardware(fast).collective_time("all_reduce", 2.0**30, across)
    mixed = tmp_path / "mixed.toml"
    mixed.write_text('[[groups]]\nnodes = 2\ndevices_per_node = 4\ndevice = "A100-80GB"\n'
                     '[[groups]]\nnodes = 2\ndevices_per_node = 4\ndevice = "H100"\n'
                     '[node_links."0-1"]\ngbps = 10.0\nlatency_us = 40.0\n'
                     '[node_links."3-1"]\ngbps = 1.0\nlatency_us = 80.0\n')
    c = parse_mixed_cluster(str(mixed))
    assert (c.groups[0].device.node_net_gbps, c.groups[0].device.inter_latency_us) == (10.0, 40.0)  # inside group 0
    assert c.groups[1].device.node_net_gbps == 400.0
    assert (c.link(0, 1).gbps, c.link(0, 1).latency_us) == (1.0, 80.0)  # node 3 (group 1) to node 1 (group 0)


ZONES = ('node_links."1-2" = { gbps = 1.25, latency_us = 2000.0 }\n'  # A100 nodes 0-1 and node 2 apart
         'node_links."0-2" = { gbps = 1.25, latency_us = 2000.0 }\n'
         '[[groups]]\nnodes = 3\ndevices_per_node = 4\ndevice = "A100-80GB"\nnic_gbps = [200.0, 200.0, 100.0]\n'
         '[[groups]]\nnodes = 1\ndevices_per_node = 4\ndevice = "H100"\n')


def test_node_facts_inside_a_group_bound_only_the_collectives_that_cross_them(tmp_path):
    """A slow link between two of a group's nodes, or a slow NIC, prices what crosses it, not what stays
    among the other nodes; a collective across groups is no faster than the network joining each
    group's own nodes among its ranks."""
    from flexmesh.cost.training.mixed import MixedCosts

    f = tmp_path / "zones.toml"
    f.write_text(ZONES)
    c = parse_mixed_cluster(str(f))
    assert c.groups[0].device.node_net_gbps == 1.25  # what a layout over all the group's nodes meets
    costs = MixedCosts(parse_model("llama2-7b"), c)
    net = {k: costs.network(ranks)[0].cluster.device for k, ranks in
           {"island": range(0, 8), "apart": range(4, 12), "across groups": [0, 4, 12], "to node 2": [8, 12]}.items()}
    assert net["island"].node_net_gbps == 200.0 and net["island"].inter_latency_us == 20.0
    assert (net["apart"].node_net_gbps, net["apart"].inter_latency_us) == (1.25, 2000.0)
    assert net["across groups"].node_net_gbps == 200.0  # nodes 0 and 1 of group 0, and the H100 node
    assert net["to node 2"].node_net_gbps == 100.0  # one node of each group: node 2's NIC bounds the group link
    assert costs.network([0, 4, 8, 12])[0].cluster.device.node_net_gbps == 1.25  # crosses the slow pair
    assert costs.on(range(4)) is costs.groups[0]  # one node: no inter-node network to bound
    ring = [costs.network(r)[0].hw.collective_time("all_reduce", 2.0**30, costs.network(r)[1])
            for r in (range(0, 8), range(4, 12))]
    assert ring[1] > 50 * ring[0]


def test_a_node_link_between_two_groups_bounds_only_what_spans_both_its_nodes(tmp_path):
    from flexmesh.cost.training.mixed import MixedCosts

    f = tmp_path / "pair.toml"
    f.write_text('node_links."1-2" = { gbps = 1.25, latency_us = 2000.0 }\n'  # A100 node 1 to H100 node 2
                 '[[groups]]\nnodes = 2\ndevices_per_node = 4\ndevice = "A100-80GB"\n'
                 '[[groups]]\nnodes = 2\ndevices_per_node = 4\ndevice = "H100"\n')
    c = parse_mixed_cluster(str(f))
    assert c.link(0, 1).gbps == 1.25  # what a layout over both whole groups meets
    costs = MixedCosts(parse_model("llama2-7b"), c)
    gbps = {ranks: costs.network(ranks)[0].cluster.device.node_net_gbps for ranks in ((0, 12), (4, 8), (0, 4, 12))}
    assert gbps == {(0, 12): 200.0, (4, 8): 1.25, (0, 4, 12): 200.0}  # nodes 0-3, 1-2, and 0, 1, 3
    assert costs.network((0, 4, 8))[0].cluster.device.inter_latency_us == 2000.0
    # Built in Python without the group links as given: the cluster's own (lowered) ones stand in.
    bare = replace(c, node_network=replace(c.node_network, group_links=()))
    assert MixedCosts(parse_model("llama2-7b"), bare).network((0, 12))[0].cluster.device.node_net_gbps == 1.25


def test_a_replica_group_on_one_island_is_priced_on_its_own_network(tmp_path):
    from flexmesh.cost.training.mixed import MixedCosts, evaluate_groups
    from flexmesh.layout.plan import Plan, ReplicaGroup, StagePlan
    from flexmesh.layout.strategy import LayerStrategy

    f = tmp_path / "zones.toml"
    f.write_text(ZONES)
    cluster, model = parse_mixed_cluster(str(f)), parse_model("llama2-7b")
    costs = MixedCosts(model, cluster)

    def step(ranks: range) -> float:
        dp = LayerStrategy(tp=4, dp=2, zero=1)
        pair = ReplicaGroup((tuple(ranks),), (StagePlan(0, model.num_layers, (dp,) * model.num_layers),), 4, 8)
        one = LayerStrategy(tp=4)
        h100 = ReplicaGroup((tuple(range(12, 16)),), (StagePlan(0, model.num_layers, (one,) * model.num_layers),), 4, 8)
        plan = Plan(model.name, cluster.label, cluster.world_size, 4096, 16, "1f1b", (pair, h100),
                    unused=tuple(r for r in range(12) if r not in ranks))
        return evaluate_groups(plan, costs).replicas[0].step_time

    assert step(range(4, 12)) > 1.5 * step(range(0, 8))  # its data-parallel sync crosses the slow pair


@pytest.mark.slow
def test_the_uniform_baseline_pays_the_slow_link_its_pipeline_crosses(tmp_path):
    """Two groups of the same GPUs joined by 10 Gb/s: the one-layout baseline's pipeline sends between
    the groups go over that link, as the mixed search prices its own pipelines, so the baseline does not
    beat the plan by pricing its sends at NVLink speed (it did, 1.8x, before sends were placed)."""
    from flexmesh.search.baselines import uniform_baseline
    from flexmesh.search.mixed import plan_mixed

    f = tmp_path / "two.toml"
    f.write_text('[[groups]]\nnodes = 1\ndevices_per_node = 8\ndevice = "A100-40GB"\n'
                 '[[groups]]\nnodes = 1\ndevices_per_node = 8\ndevice = "A100-40GB"\n'
                 '[links]\ngbps = 1.25\nlatency_us = 2000.0\n')
    cluster, model = parse_mixed_cluster(str(f)), parse_model("llama2-7b")
    plan = plan_mixed(model, cluster, 4096, 128)
    base = uniform_baseline(model, cluster, 4096, 128)
    assert base is not None and base["tokens_per_s"] <= plan.evaluation.tokens_per_s


@pytest.mark.parametrize("text, expect", [
    ('nodes = 2\ndevices_per_node = 4\ndevice = "H100"\nnic_gbps = [100.0]\n', "1 entries for 2 nodes"),
    ('nodes = 2\ndevices_per_node = 4\ndevice = "H100"\nnic_gbps = [100.0, -1.0]\n', r"nic_gbps\[1\]"),
    ('nodes = 2\ndevices_per_node = 4\ndevice = "H100"\n[node_links."0-2"]\ngbps = 1.0\nlatency_us = 1.0\n',
     "does not join two of the 2 nodes"),
    ('nodes = 2\ndevices_per_node = 4\ndevice = "H100"\n[node_links."1-1"]\ngbps = 1.0\nlatency_us = 1.0\n',
     "does not join two"),
    ('nodes = 2\ndevices_per_node = 4\ndevice = "H100"\n[node_links.a]\ngbps = 1.0\n', "not a pair of nodes"),
    ('nodes = 2\ndevices_per_node = 4\ndevice = "H100"\n[node_links."0-1"]\ngbps = 1.0\nlatency_us = 1.0\n'
     '[node_links."1-0"]\ngbps = 2.0\nlatency_us = 1.0\n', "given twice"),
    ('nodes = 2\ndevices_per_node = 4\ndevice = "H100"\n[node_links."0-1"]\ngbps = 1.0\n', "needs gbps and latency_us"),
])
def test_bad_node_networks_are_one_line_errors(tmp_path, text, expect):
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(SpecError, match=expect):
        parse_mixed_cluster(str(f))
