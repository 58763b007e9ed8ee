"""A serving plan as launch commands for production engines (vLLM, SGLang) and the configuration of flexmesh's
router in front of them (``flexmesh serve export``). Torch-free: it writes commands, and checks them with the
engines' own argument parsers in a separate process where those are importable.

Each replica of the plan (in :meth:`~flexmesh.serve.layout.plan.ServingPlan.placement`'s order) is one
engine process on its node, its GPUs named by ``CUDA_VISIBLE_DEVICES`` (the node-local indices of the devices it
was placed on), listening on ``base_port + replica``. The plan's knobs, by the engines' names:

=========================  ==================================  =========================================
plan (vLLM's names)        ``vllm serve``                      ``python -m sglang.launch_server``
=========================  ==================================  =========================================
tp, pp                     --tensor/--pipeline-parallel-size   --tp-size, --pp-size
max_seqs                   --max-num-seqs                      --max-running-requests
max_batched_tokens         --max-num-batched-tokens            --chunked-prefill-size
memory_fraction            --gpu-memory-utilization            --mem-fraction-static
block_tokens               --block-size                        --page-size
kv_blocks                  --num-gpu-blocks-override           --max-total-tokens (blocks x block size)
prefix_caching off         --no-enable-prefix-caching          --disable-radix-cache
role prefill / decode      --kv-transfer-config (NIXL,         --disaggregation-mode prefill / decode
                           kv_role kv_both)                    (--disaggregation-transfer-backend nixl)
=========================  ==================================  =========================================

The router's configuration (``router.json``) lists the engines (URL, role, ``max_running`` = the plan's
``max_seqs``), the plan's routing (bucket edges and each engine's weight per bucket, the policy inside a bucket)
and the queue policy; :func:`router_options` turns it back into :class:`flexmesh.serve.engine.router.Router`'s
arguments.

>>> from flexmesh.serve.layout.plan import ServingPlan
>>> import json
>>> plan = ServingPlan.from_dict(json.loads(EXAMPLE_PLAN))
>>> [" ".join(x.argv[:4]) for x in vllm_launches(plan, "/models/llama")]
['vllm serve /models/llama --tensor-parallel-size', 'vllm serve /models/llama --tensor-parallel-size']
>>> [(x.node, x.env["CUDA_VISIBLE_DEVICES"], x.port) for x in vllm_launches(plan, "/models/llama")]
[(0, '0,1', 8100), (1, '0', 8101)]
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

from flexmesh.errors import SpecError
from flexmesh.serve.layout.roles import Role

ENGINES = ("vllm", "sglang")
BASE_PORT = 8100
# vLLM's disaggregated prefill/decode through NIXL: both sides hold kv_role kv_both and a proxy (flexmesh's
# router) sends each request to a prefill engine, then to a decode engine (vLLM docs, "Disaggregated Prefilling").
VLLM_KV_TRANSFER = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
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


def vllm_launches(plan, model_path: str, base_port: int = BASE_PORT, host: str = "127.0.0.1") -> list[Launch]:
    """``vllm serve`` per replica of ``plan`` (see the module doc)."""
    if len(plan.models) > 1:
        raise SpecError("the plan serves several models; export one model's plan at a time")
    out = []
    for r, k, node, local, note in _placed(plan):
        port = base_port + r.index
        argv = ["vllm", "serve", model_path, "--tensor-parallel-size", str(r.spec.tp),
                "--pipeline-parallel-size", str(r.spec.pp), "--max-num-seqs", str(k.max_seqs),
                "--max-num-batched-tokens", str(k.max_batched_tokens), "--gpu-memory-utilization",
                f"{k.memory_fraction:g}", "--block-size", str(k.block_tokens),
                "--enable-prefix-caching" if k.prefix_caching else "--no-enable-prefix-caching",
                "--host", host, "--port", str(port)]
        if k.kv_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(k.kv_blocks)]
        if r.spec.role != Role.AGGREGATED:
            argv += ["--kv-transfer-config", json.dumps(VLLM_KV_TRANSFER, separators=(",", ":"))]
        out.append(Launch(r.index, node, r.device.name, r.spec.role, port, tuple(argv),
                          {"CUDA_VISIBLE_DEVICES": ",".join(map(str, local))}, k.max_seqs, note))
    return out


def sglang_launches(plan, model_path: str, base_port: int = BASE_PORT, host: str = "127.0.0.1") -> list[Launch]:
    """``python -m sglang.launch_server`` per replica of ``plan`` (see the module doc)."""
    if len(plan.models) > 1:
        raise SpecError("the plan serves several models; export one model's plan at a time")
    out = []
    for r, k, node, local, note in _placed(plan):
        port = base_port + r.index
        argv = ["python", "-m", "sglang.launch_server", "--model-path", model_path, "--tp-size", str(r.spec.tp),
                "--pp-size", str(r.spec.pp), "--max-running-requests", str(k.max_seqs), "--chunked-prefill-size",
                str(k.max_batched_tokens), "--mem-fraction-static", f"{k.memory_fraction:g}", "--page-size",
                str(k.block_tokens), "--host", host, "--port", str(port)]
        if k.kv_blocks is not None:
            argv += ["--max-total-tokens", str(k.kv_blocks * k.block_tokens)]
        if not k.prefix_caching:
            argv.append("--disable-radix-cache")
        if r.spec.role != Role.AGGREGATED:
            argv += ["--disaggregation-mode", r.spec.role, "--disaggregation-transfer-backend", "nixl"]
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
    """The Router arguments of a router configuration (:func:`router_config`).

    >>> from flexmesh.serve.layout.plan import ServingPlan
    >>> plan = ServingPlan.from_dict(json.loads(EXAMPLE_PLAN))
    >>> opts = router_options(router_config(plan, vllm_launches(plan, "m")))
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


_CHECK = {
    "vllm": ("from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
             "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
             "parser = make_arg_parser(FlexibleArgumentParser())\n"
             "import vllm\nversion = vllm.__version__\n", 2),  # argv after 'vllm serve'
    "sglang": ("from sglang.srt.server_args import ServerArgs\nimport argparse\n"
               "parser = argparse.ArgumentParser()\nServerArgs.add_cli_args(parser)\n"
               "import sglang\nversion = sglang.__version__\n", 3),  # argv after 'python -m sglang.launch_server'
}


def check_launches(engine: str, launches: list[Launch], python: str | None = None, timeout_s: float = 300.0) -> str:
    """Each command through ``engine``'s own argument parser, in ``python`` (default: this interpreter): what it
    said, one line -- ``checked by vLLM 0.x's argument parser``, the parser's error, or ``not checked`` and why."""
    setup, skip = _CHECK[engine]
    script = (setup + "import json, sys\nbad = []\n"
              "for argv in json.loads(sys.stdin.read()):\n"
              "    try:\n        parser.parse_args(argv)\n    except SystemExit:\n        bad.append(argv)\n"
              "print(json.dumps({'version': version, 'bad': bad}))\n")
    argvs = [list(x.argv[skip:]) for x in launches]
    if engine == "vllm":  # vllm serve MODEL ...: the model is the parser's --model
        argvs = [["--model", a[0], *a[1:]] for a in argvs]
    try:
        r = subprocess.run([python or sys.executable, "-c", script], input=json.dumps(argvs), capture_output=True,
                           text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"not checked ({python or sys.executable}: {e})"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        if "ModuleNotFoundError" in last or "ImportError" in last:
            return f"not checked ({engine} is not importable by {python or sys.executable})"
        return f"not checked ({engine}'s parser could not be loaded: {last[:160]})"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    name = {"vllm": "vLLM", "sglang": "SGLang"}[engine]
    if got["bad"]:
        err = [ln for ln in r.stderr.splitlines() if "error:" in ln]
        return f"REFUSED by {name} {got['version']}'s argument parser: {(err or ['?'])[-1].strip()[:200]}"
    return f"checked by {name} {got['version']}'s argument parser ({len(argvs)} command(s))"


def launch_script(engine: str, launches: list[Launch], checked: str) -> str:
    lines = ["#!/bin/sh", f"# {engine} engines of a flexmesh serving plan, one per replica; on each node run its lines",
             f"# ({checked})"]
    for x in launches:
        lines.append(f"# replica {x.replica}: {x.role} on {x.device}, node {x.node}" + (f"; {x.note}" if x.note
                                                                                       else ""))
        lines.append(x.line + " &")
    lines.append("wait")
    return "\n".join(lines) + "\n"
