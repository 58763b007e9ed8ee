"""A serving plan as Kubernetes manifests (``flexmesh serve export --target kubernetes``): how vLLM and SGLang users
deploy beyond one machine. Torch-free.

Why Kubernetes and these objects: vLLM's and SGLang's own deployment guides run each engine as a pod of their
published image with its GPUs asked for as ``nvidia.com/gpu`` (NVIDIA's device plugin), and put a gateway in front;
flexmesh's router is that gateway. The router routes to each replica by itself (its queue, its routing table's
weight), so every replica needs an address of its own, which a Deployment behind one Service does not give:

- per replica group of the plan (its replicas of one device type and one command: tp, pp, role and knobs), a
  **StatefulSet** of the group's
  replicas and a headless **Service** over them, so that replica ``k`` of group ``g`` is
  ``flexmesh-g<g>-<k>.flexmesh-g<g>`` (the DNS name a StatefulSet's pod gets). Its container runs the engine's
  command as ``flexmesh serve export`` writes it (:func:`flexmesh.serve.export.launches`: the plan's knobs by the
  engine's names) on :data:`ENGINE_PORT`, asks for ``tp x pp`` GPUs, is ready once ``/health`` answers, and runs
  on nodes labelled ``flexmesh.io/device=<the plan's device type>`` (``kubectl label node NODE
  flexmesh.io/device=H100-80GB``: GPU product names differ by driver and form factor, so the label is the user's);
- the **router**: a ConfigMap holding ``router.json`` (:func:`flexmesh.serve.export.router_config`, the engines'
  URLs those DNS names, in the plan's replica order, which its routing table weighs), a Deployment running
  ``flexmesh serve run --router-config /etc/flexmesh/router.json --host 0.0.0.0`` from an image with flexmesh
  installed, and a Service in front of it on :data:`ROUTER_PORT`.

A replica wider than one node (tp x pp above the node's GPUs) is refused in one line: it needs a multi-node engine
(vLLM on Ray, or a LeaderWorkerSet), which this export does not write.

:func:`check_manifests` validates every object against Kubernetes' own OpenAPI schemas, offline, with the
``kubernetes-validate`` package (its bundled schemas, strict: no field Kubernetes does not know), where it is
importable; else it says the manifests were not checked.

>>> import json
>>> from flexmesh.serve.export import EXAMPLE_PLAN
>>> from flexmesh.serve.layout.plan import ServingPlan
>>> docs = manifests(ServingPlan.from_dict(json.loads(EXAMPLE_PLAN)), "vllm", "/models/llama")
>>> [(d["kind"], d["metadata"]["name"]) for d in docs][:3]
[('StatefulSet', 'flexmesh-g0'), ('Service', 'flexmesh-g0'), ('StatefulSet', 'flexmesh-g1')]
>>> docs[0]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
{'nvidia.com/gpu': 2}
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import replace
from typing import Any

from flexmesh.errors import SpecError

ENGINE_PORT = 8000
ROUTER_PORT = 8000
IMAGES = {"vllm": "vllm/vllm-openai:latest", "sglang": "lmsysorg/sglang:latest"}  # the engines' published images
ROUTER_IMAGE = "flexmesh:latest"  # an image with `pip install flexmesh[serve]` (docs/serving-engines.md)
DEVICE_LABEL = "flexmesh.io/device"
CHECK_VERSION = "1.30.0"  # the Kubernetes release whose schemas the manifests are checked against


def _labels(group: int | None) -> dict[str, str]:
    out = {"app.kubernetes.io/part-of": "flexmesh"}
    out["app.kubernetes.io/name"] = "flexmesh-router" if group is None else f"flexmesh-g{group}"
    return out


def _router_meta() -> dict[str, Any]:
    return {"name": "flexmesh-router", "labels": _labels(None)}  # a new dict each: YAML writes no aliases


# A container image reference as container runtimes parse it (the distribution project's reference grammar, its
# common form): [registry[:port]/]path[:tag][@sha256:digest], the path's components lowercase. Kubernetes' schemas
# take any string here; the kubelet fails the pod on a reference it cannot pull.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REFERENCE = re.compile(rf"(?:[a-zA-Z0-9-]+(?:\.[a-zA-Z0-9-]+)*(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*"
                             r"(?::[\w][\w.-]{0,127})?(?:@sha256:[a-f0-9]{64})?")


def check_image(ref: str, flag: str) -> str:
    """``ref`` when it is a container image reference (:data:`IMAGE_REFERENCE`); else a one-line SpecError.

    >>> check_image("vllm/vllm-openai:v0.8.5", "--image")
    'vllm/vllm-openai:v0.8.5'
    >>> check_image("UPPER CASE:bad tag", "--image")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    flexmesh.errors.SpecError: --image 'UPPER CASE:bad tag' is not a container image reference ...
    """
    if not IMAGE_REFERENCE.fullmatch(ref):
        raise SpecError(f"{flag} {ref!r} is not a container image reference ([registry/]path[:tag], the path "
                        "lowercase); e.g. vllm/vllm-openai:latest")
    return ref


def manifests(plan, engine: str, model_path: str, image: str | None = None, router_image: str = ROUTER_IMAGE,
              queue: str = "fcfs") -> list[dict[str, Any]]:
    """The Kubernetes objects of ``plan`` served by ``engine`` (see the module doc), in apply order."""
    from flexmesh.serve.export import launches, router_config

    if engine not in IMAGES:
        raise SpecError(f"flexmesh writes Kubernetes manifests for {' and '.join(IMAGES)}, not {engine!r}")
    check_image(image or IMAGES[engine], "--image")
    check_image(router_image, "--router-image")
    # every pod its own address: one port for all (base_port + replica, as the scripts say, would split the groups)
    runs = [replace(x, argv=tuple(str(ENGINE_PORT) if i and x.argv[i - 1] == "--port" else a
                                  for i, a in enumerate(x.argv)), port=ENGINE_PORT)
            for x in launches(engine, plan, model_path, base_port=ENGINE_PORT, host="0.0.0.0")]
    placed = plan.placement().replicas
    for x in runs:
        if x.note:
            raise SpecError(f"replica {x.replica} {x.note}; this export writes one pod per replica: give the plan "
                            "replicas that fit one node")
    by_group: dict[tuple, list] = defaultdict(list)  # replicas of one command on one device type: one group
    for x, r in zip(runs, placed):
        by_group[(r.device.name, x.argv)].append((x, r))
    docs: list[dict[str, Any]] = []
    urls: dict[int, str] = {}
    for g, members in enumerate(by_group.values()):
        name = f"flexmesh-g{g}"
        x, r = members[0]
        argv = list(x.argv)
        head = 2 if engine == "vllm" else 3  # `vllm serve` / `python -m sglang.launch_server`
        gpus = r.spec.tp * r.spec.pp
        container = {
            "name": "engine", "image": image or IMAGES[engine], "command": argv[:head], "args": argv[head:],
            "ports": [{"name": "http", "containerPort": ENGINE_PORT}],
            "resources": {"limits": {"nvidia.com/gpu": gpus}},
            "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5,
                               "failureThreshold": 3},
            "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                             "failureThreshold": 90}}  # loading and compiling a large model: up to 15 minutes
        docs.append({"apiVersion": "apps/v1", "kind": "StatefulSet",
                     "metadata": {"name": name, "labels": _labels(g),
                                  "annotations": {"flexmesh.io/replica-group": f"{r.device.name}, tp {r.spec.tp}, "
                                                  f"pp {r.spec.pp}, {r.spec.role}"}},
                     "spec": {"serviceName": name, "replicas": len(members), "podManagementPolicy": "Parallel",
                              "selector": {"matchLabels": _labels(g)},
                              "template": {"metadata": {"labels": _labels(g)},
                                           "spec": {"nodeSelector": {DEVICE_LABEL: r.device.name},
                                                    "containers": [container]}}}})
        docs.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": _labels(g)},
                     "spec": {"clusterIP": "None", "selector": _labels(g),
                              "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http"}]}})
        for k, (x, _) in enumerate(members):
            urls[x.replica] = f"http://{name}-{k}.{name}:{ENGINE_PORT}"
    config = router_config(plan, runs, queue)
    for e in config["engines"]:
        e["url"] = urls[e["replica"]]
    config["protocol"] = "openai"
    docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": _router_meta(),
                 "data": {"router.json": json.dumps(config, indent=1) + "\n"}})
    router = {"name": "router", "image": router_image,
              "command": ["flexmesh", "serve", "run", "--router-config", "/etc/flexmesh/router.json", "--host",
                          "0.0.0.0", "--port", str(ROUTER_PORT)],
              "ports": [{"name": "http", "containerPort": ROUTER_PORT}],
              "readinessProbe": {"httpGet": {"path": "/v1/models", "port": "http"}, "periodSeconds": 5},
              "volumeMounts": [{"name": "config", "mountPath": "/etc/flexmesh", "readOnly": True}]}
    docs.append({"apiVersion": "apps/v1", "kind": "Deployment",
                 "metadata": _router_meta(),
                 "spec": {"replicas": 1, "selector": {"matchLabels": _labels(None)},
                          "template": {"metadata": {"labels": _labels(None)},
                                       "spec": {"containers": [router],
                                                "volumes": [{"name": "config",
                                                             "configMap": {"name": "flexmesh-router"}}]}}}})
    docs.append({"apiVersion": "v1", "kind": "Service", "metadata": _router_meta(),
                 "spec": {"selector": _labels(None),
                          "ports": [{"name": "http", "port": ROUTER_PORT, "targetPort": "http"}]}})
    return docs


def to_yaml(docs: list[dict[str, Any]], header: str = "") -> str:
    """The objects as one YAML stream (``kubectl apply -f``), ``header`` as leading comment lines."""
    import yaml

    head = "".join(f"# {line}\n" for line in header.splitlines())
    return head + yaml.safe_dump_all(docs, sort_keys=False, width=120)


def check_manifests(docs: list[dict[str, Any]], version: str = CHECK_VERSION) -> str:
    """Every object against Kubernetes ``version``'s OpenAPI schemas (strict), offline: what was found, one line."""
    try:
        import kubernetes_validate
    except ModuleNotFoundError:
        return "not checked (pip install kubernetes-validate checks them offline against Kubernetes' schemas)"
    bad = []
    for d in docs:
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            bad.append(f"{d.get('kind')} {d.get('metadata', {}).get('name')}: {e.message}")
    if bad:
        return f"REFUSED by Kubernetes {version}'s schemas: {bad[0][:200]}"
    return f"checked against Kubernetes {version}'s schemas, strict ({len(docs)} objects; kubernetes-validate)"
