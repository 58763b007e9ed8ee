"""A serving plan of two GPU types and four replica groups exported to Kubernetes (flexmesh.serve.kubernetes):
every object valid by Kubernetes' own schemas (kubernetes-validate, offline, strict), each group's pods running the
export's engine command, the router's configuration naming every replica's pod in the plan's order, and ``serve run
--router-config`` fronting what such a file lists."""

import json

import pytest

from flexmesh.errors import SpecError
from flexmesh.serve.export import launches
from flexmesh.serve.kubernetes import ENGINE_PORT, check_manifests, manifests, to_yaml
from flexmesh.serve.layout.plan import ServingPlan

kubernetes_validate = pytest.importorskip("kubernetes_validate")  # the dev extra


def plan(spans_nodes: bool = False) -> ServingPlan:
    group = {"model": 0, "role": "aggregated", "entry": [0.25]}
    return ServingPlan.from_dict({
        "version": 1, "kind": "flexmesh serving plan", "models": ["llama3.1-8b"],
        "cluster": "3x4xH100+1x4xL4" if spans_nodes else "1x8xH100+1x4xL4",
        "slo": {"ttft_s": 1.0, "tpot_s": 0.1, "attainment": 0.9},
        "buckets": {"prompt_edges": [], "output_edges": [], "buckets": [{"share": 1.0, "prompt_mean": 400,
                    "output_mean": 200, "prompt_high": 900, "output_high": 420, "longest": 1700}]},
        "groups": [{**group, "group": 0, "device": "H100-80GB", "replicas": 1 if spans_nodes else 2,
                    "tp": 8 if spans_nodes else 2, "engine": {"max_seqs": 256, "max_batched_tokens": 2048}},
                   {**group, "group": 0, "device": "H100-80GB", "replicas": 4, "tp": 1,
                    "engine": {"max_seqs": 128, "max_batched_tokens": 1024}},
                   {**group, "group": 1, "device": "L4", "replicas": 1, "tp": 2,
                    "engine": {"max_seqs": 64, "max_batched_tokens": 1024, "prefix_caching": False}},
                   {**group, "group": 1, "device": "L4", "replicas": 2, "tp": 1,
                    "engine": {"max_seqs": 32, "max_batched_tokens": 512}}],
        "routing": "weights", "prices": {}, "predicted": {}})


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_four_replica_groups_of_two_gpu_types_validate_against_kubernetes_schemas(engine):
    docs = manifests(plan(), engine, "/models/llama")
    assert check_manifests(docs).startswith("checked against Kubernetes")
    sets = [d for d in docs if d["kind"] == "StatefulSet"]
    assert [s["spec"]["replicas"] for s in sets] == [2, 4, 1, 2]
    pods = [s["spec"]["template"]["spec"] for s in sets]
    assert [p["nodeSelector"]["flexmesh.io/device"] for p in pods] == ["H100-80GB", "H100-80GB", "L4", "L4"]
    assert [p["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] for p in pods] == [2, 1, 2, 1]
    for s in sets:  # a StatefulSet's selector picks its own pods, its Service is headless over them
        assert s["spec"]["selector"]["matchLabels"] == s["spec"]["template"]["metadata"]["labels"]
        svc = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == s["spec"]["serviceName"])
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == s["spec"]["selector"]["matchLabels"]
    # each group runs the export's command for its replicas, on the one port every pod listens on
    scripts = launches(engine, plan(), "/models/llama", host="0.0.0.0")
    firsts = [scripts[0], scripts[2], scripts[6], scripts[7]]
    for p, x in zip(pods, firsts):
        c = p["containers"][0]
        want = list(x.argv)
        want[want.index("--port") + 1] = str(ENGINE_PORT)
        assert c["command"] + c["args"] == want
    config = json.loads(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["router.json"])
    assert [e["url"] for e in config["engines"]] == (
        [f"http://flexmesh-g0-{k}.flexmesh-g0:8000" for k in range(2)]
        + [f"http://flexmesh-g1-{k}.flexmesh-g1:8000" for k in range(4)]
        + ["http://flexmesh-g2-0.flexmesh-g2:8000"] + [f"http://flexmesh-g3-{k}.flexmesh-g3:8000" for k in range(2)])
    assert config["table"]["entry"] == [[0.125] * 2 + [0.0625] * 4 + [0.25] + [0.125] * 2] and \
        config["protocol"] == "openai"


def test_an_object_kubernetes_would_refuse_is_refused():
    docs = json.loads(json.dumps(manifests(plan(), "vllm", "/m")))
    docs[0]["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    assert check_manifests(docs).startswith("REFUSED by Kubernetes 1.30.0's schemas: StatefulSet flexmesh-g0")
    docs = json.loads(json.dumps(manifests(plan(), "vllm", "/m")))
    docs[0]["spec"]["replicas"] = "two"
    assert check_manifests(docs).startswith("REFUSED")


def test_a_replica_wider_than_a_node_is_one_line():
    with pytest.raises(SpecError, match="replica 0 spans nodes .*one pod per replica"):
        manifests(plan(spans_nodes=True), "vllm", "/m")


def test_the_cli_writes_yaml_that_reads_back_and_the_router_fronts_its_config(tmp_path):
    import yaml

    from flexmesh.cli import build_parser, main

    (tmp_path / "plan.json").write_text(json.dumps(plan().to_dict()))
    assert main(["serve", "export", "--plan", str(tmp_path / "plan.json"), "--target", "kubernetes",
                 "--engine", "vllm", "--model-path", "/models/llama", "--out", str(tmp_path / "k8s")]) == 0
    text = (tmp_path / "k8s" / "kubernetes-vllm.yaml").read_text()
    assert text.startswith("# vllm engines") and "checked against Kubernetes" in text
    assert list(yaml.safe_load_all(text)) == manifests(plan(), "vllm", "/models/llama")
    config = next(d for d in yaml.safe_load_all(text) if d["kind"] == "ConfigMap")["data"]["router.json"]
    (tmp_path / "router.json").write_text(config)

    from flexmesh.commands.serve_run import resolve_fleet

    args = build_parser().parse_args(["serve", "run", "--router-config", str(tmp_path / "router.json")])
    urls, route, opts, _ = resolve_fleet(args)
    assert urls[0] == "http://flexmesh-g0-0.flexmesh-g0:8000" and len(urls) == 9 and route == "plan"
    assert opts["protocol"] == "openai" and opts["max_running"] == [256] * 2 + [128] * 4 + [64] + [32] * 2
    assert to_yaml([{"a": 1}], "x\ny") == "# x\n# y\na: 1\n"


@pytest.mark.parametrize("flags,says", [
    (["--target", "kubernetes", "--image", "UPPER CASE:bad tag"], "is not a container image reference"),
    (["--target", "kubernetes", "--router-image", "flexmesh:"], "--router-image 'flexmesh:' is not a container"),
    (["--base-port", "70000"], "from 70000 to 70001, past 65535; give a --base-port of at most 65534"),
    (["--vllm-python", "/no/such/python"], "is not a Python here"),
    (["--model-path", ""], "--model-path is empty"),
])
def test_export_refuses_what_would_write_a_launch_that_cannot_start(tmp_path, flags, says):
    from helpers import flexmesh_here

    from flexmesh.serve.export import EXAMPLE_PLAN

    (tmp_path / "plan.json").write_text(EXAMPLE_PLAN)
    r = flexmesh_here("serve", "export", "--plan", str(tmp_path / "plan.json"), *flags, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "o" / "router.json").exists()
