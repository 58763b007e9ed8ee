"""A serving plan as launch commands for production engines (vLLM, SGLang) and the configuration of flexmesh's
router in front of them (``flexmesh serve export``). Torch-free: it writes commands, and checks them with the
engines' own argument parsers in a separate process where those are importable.

Each replica of the plan (in :meth:`~flexmesh.serve.layout.plan.ServingPlan.placement`'s order) is one
engine process on its node, its GPUs named by ``CUDA_VISIBLE_DEVICES`` (the node-local indices of the devices it
was placed on), listening on ``base_port + replica``; the command is the engine's (:mod:`flexmesh.serve.engines`:
the plan's knobs by each engine's names).

The router's configuration (``router.json``) lists the engines (URL, role, ``max_running`` = the plan's
``max_seqs``), the plan's routing (bucket edges and each engine's weight per bucket, the policy inside a bucket)
and the queue policy; :func:`router_options` turns it back into :class:`flexmesh.serve.engine.router.RouterService`'s
arguments.

>>> from flexmesh.serve.layout.plan import ServingPlan
>>> import json
>>> plan = ServingPlan.from_dict(json.loads(EXAMPLE_PLAN))
>>> [" ".join(x.argv[:4]) for x in launches("vllm", plan, "/models/llama")]
['vllm serve /models/llama --tensor-parallel-size', 'vllm serve /models/llama --tensor-parallel-size']
>>> [(x.node, x.env["CUDA_VISIBLE_DEVICES"], x.port) for x in launches("vllm", plan, "/models/llama")]
[(0, '0,1', 8100), (1, '0', 8101)]
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from flexmesh.cost.inference.memory import served_dtype
from flexmesh.errors import SpecError
from flexmesh.serve.engines import engine

BASE_PORT = 8100
EXAMPLE_PLAN = """{"version": 1, "kind": "flexmesh serving plan", "models": ["llama3.1-8b"], "cluster": "2xH100+1xL4",
 "slo": {"ttft_s": 1.0, "tpot_s": 0.1, "attainment": 0.9},
 "buckets": {"prompt_edges": [], "output_edges": [], "buckets": [{"share": 1.0, "prompt_mean": 400,
             "output_mean": 200, "prompt_high": 900, "output_high": 420, "longest": 1700}]},
 "groups": [{"model": 0, "group": 0, "device": "H100-80GB", "replicas": 1, "tp": 2, "role": "aggregated",
             "engine": {"max_seqs": 256, "max_batched_tokens": 2048}, "entry": [0.8]},
            {"model": 0, "group": 1, "device": "L4", "replicas": 1, "tp": 1, "role": "aggregated",
             "engine": {"max_seqs": 64, "max_batched_tokens": 1024, "prefix_caching": false}, "entry": [0.2]}],
 "routing": "weights", "prices": {}, "predicted": {}}"""


@dataclass(frozen=True)
class Launch:
    """One engine of the plan: where it runs and the command that starts it."""

    replica: int
    node: int  # the cluster's global node index
    device: str
    role: str
    port: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    max_running: int = 0
    note: str = ""

    @property
    def line(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.argv)}".strip()


def _placed(plan):
    placed = plan.placement()
    cluster = placed.cluster
    out = []
    for r, k in zip(placed.replicas, placed.knobs):
        ranks = range(r.first_rank, r.first_rank + r.spec.devices)
        nodes = sorted({cluster.node_of(x) for x in ranks})
        per_node = cluster.groups[r.spec.group].devices_per_node
        local = [cluster.local_rank(x) % per_node for x in ranks if cluster.node_of(x) == nodes[0]]
        note = "" if len(nodes) == 1 else (f"spans nodes {nodes}: start it as a multi-node engine (vLLM: Ray; "
                                            "SGLang: --nnodes/--node-rank)")
        out.append((r, k, nodes[0], local, note))
    return out


def launches(name: str, plan, model_path: str, base_port: int = BASE_PORT, host: str = "127.0.0.1") -> list[Launch]:
    """Engine ``name``'s launch command for each replica of ``plan`` (see the module doc)."""
    e = engine(name)
    for what, value in (("model path", model_path), ("host", host)):  # each one quoted word of a one-line command
        if not value or not value.isprintable():
            raise SpecError(f"the {what} {value!r} is empty or holds a line break or another control character; give "
                            "one without")
    if e.argv is None:
        raise SpecError(f"flexmesh does not export {e.title} launch commands; engines it exports: vllm, sglang")
    if len(plan.models) > 1:
        raise SpecError("the plan serves several models; export one model's plan at a time")
    placed = _placed(plan)
    last = base_port + max((r.index for r, *_ in placed), default=0)
    if last > 65535:
        raise SpecError(f"replica ports run from {base_port} to {last}, past 65535; give a --base-port of at most "
                        f"{65535 - (last - base_port)}")
    out = []
    specs = plan.model_specs()
    for r, k, node, local, note in placed:
        port = base_port + r.index
        argv = e.argv(k, r.spec.tp, r.spec.pp, r.spec.role, model_path, host, port)
        if e.flags is not None:  # what the plan's engine description does that the engine's defaults do not
            argv += e.flags(plan.engine)
        dtype = specs[r.spec.tier].dtype
        if served_dtype(dtype, r.device) != dtype:
            argv += list(e.half)
        out.append(Launch(r.index, node, r.device.name, r.spec.role, port, tuple(argv),
                          {"CUDA_VISIBLE_DEVICES": ",".join(map(str, local))}, k.max_seqs, note))
    return out


def router_config(plan, launches: list[Launch], queue: str = "fcfs") -> dict:
    """flexmesh's router in front of ``launches`` (see the module doc)."""
    table = plan.placement().table
    return {"kind": "flexmesh router", "version": 1, "model": plan.models[0],
            "engines": [{"url": f"http://HOST-OF-NODE-{x.node}:{x.port}", "replica": x.replica, "node": x.node,
                         "device": x.device, "role": x.role, "max_running": x.max_running} for x in launches],
            "route": "plan", "queue": queue,
            "table": {"prompt_edges": list(table.prompt_edges), "output_edges": list(table.output_edges),
                      "entry": [list(row) for row in table.entry], "decode": [list(row) for row in table.decode],
                      "policy": table.policy}}


def router_options(config: dict) -> dict[str, Any]:
    """The RouterService arguments of a router configuration (:func:`router_config`).

    >>> from flexmesh.serve.layout.plan import ServingPlan
    >>> plan = ServingPlan.from_dict(json.loads(EXAMPLE_PLAN))
    >>> opts = router_options(router_config(plan, launches("vllm", plan, "m")))
    >>> opts["route"], opts["max_running"], opts["table"].entry
    ('plan', [256, 64], ((0.8, 0.2),))
    """
    from flexmesh.serve.layout.routing import RoutingTable

    t = config["table"]
    table = RoutingTable(tuple(t["prompt_edges"]), tuple(t["output_edges"]), tuple(map(tuple, t["entry"])),
                         tuple(map(tuple, t["decode"])), t["policy"])
    engines = config["engines"]
    return {"urls": [e["url"] for e in engines], "route": config["route"], "queue": config["queue"], "table": table,
            "max_running": [e["max_running"] for e in engines]}


def check_launches(name: str, commands: list[Launch], python: str | None = None, timeout_s: float = 300.0) -> str:
    """Each command through engine ``name``'s own argument parser, in ``python`` (default: this interpreter): what
    it said, one line -- ``checked by vLLM 0.x's argument parser``, the parser's error, or ``not checked`` and
    why."""
    e = engine(name)
    if e.check is None:
        return f"not checked (no argument parser of {e.title} is known)"
    script = (e.check.setup + "import json, sys\nbad = []\n"
              "for argv in json.loads(sys.stdin.read()):\n"
              "    try:\n        parser.parse_args(argv)\n    except SystemExit:\n        bad.append(argv)\n"
              "print(json.dumps({'version': version, 'bad': bad}))\n")
    argvs = [list(x.argv[e.check.skip:]) for x in commands]
    if e.check.model_flag:  # vllm serve MODEL ...: the model is the parser's --model
        argvs = [[e.check.model_flag, a[0], *a[1:]] for a in argvs]
    try:
        r = subprocess.run([python or sys.executable, "-c", script], input=json.dumps(argvs), capture_output=True,
                           text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as failed:
        return f"not checked ({python or sys.executable}: {failed})"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        if "ModuleNotFoundError" in last or "ImportError" in last:
            return f"not checked ({name} is not importable by {python or sys.executable})"
        return f"not checked ({name}'s parser could not be loaded: {last[:160]})"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    if got["bad"]:
        err = [ln for ln in r.stderr.splitlines() if "error:" in ln]
        return f"REFUSED by {e.title} {got['version']}'s argument parser: {(err or ['?'])[-1].strip()[:200]}"
    return f"checked by {e.title} {got['version']}'s argument parser ({len(argvs)} command(s))"


def _comment(text: str) -> str:
    """``text`` as one comment line: a line break or other control character in it is written escaped, so that
    nothing it carries becomes a line of the script."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def launch_script(name: str, commands: list[Launch], checked: str) -> str:
    lines = ["#!/bin/sh", f"# {name} engines of a flexmesh serving plan, one per replica; on each node run its lines",
             _comment(f"# ({checked})")]
    for x in commands:
        lines.append(_comment(f"# replica {x.replica}: {x.role} on {x.device}, node {x.node}"
                              + (f"; {x.note}" if x.note else "")))
        lines.append(x.line + " &")
    lines.append("wait")
    return "\n".join(lines) + "\n"
