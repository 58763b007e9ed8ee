"""``flexmesh serve export``: a serving plan as launch commands for vLLM and SGLang and the configuration of
flexmesh's router in front of them, each command checked by the engine's own argument parser where it is
importable (docs/cli-serve.md)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from flexmesh.commands.args import folder, nonneg_int
from flexmesh.errors import SpecError
from flexmesh.serve.engines import exported
from flexmesh.serve.queues import QUEUES


def add_parser(kinds) -> argparse.ArgumentParser:
    p = kinds.add_parser("export", help="a serving plan as vLLM / SGLang launch commands and a router config",
                         description="Write a serving plan as launch commands for vLLM (`vllm serve`) and SGLang "
                                     "(`sglang.launch_server`), one engine per replica with the plan's tp, pp and "
                                     "knobs, and the configuration of flexmesh's router in front of them; each "
                                     "command is checked by the engine's own argument parser where it is "
                                     "importable, else the output says it was not checked.")
    p.add_argument("--plan", required=True, metavar="PLAN", help="a serving plan (flexmesh serve plan --out)")
    names = [e.name for e in exported()]
    p.add_argument("--engine", choices=(*names, "both"), default="both",
                   help=f"which engine's commands ({', '.join(names)}; both: each of them)")
    p.add_argument("--model-path", help="the model's weights as the engines load them (default: the plan's model "
                   "name)")
    p.add_argument("--host", default="127.0.0.1", help="the address each engine listens on (0.0.0.0 for a router "
                   "on another node)")
    p.add_argument("--base-port", type=nonneg_int, default=8100, help="replica K listens on this + K")
    p.add_argument("--queue", choices=QUEUES, default="fcfs", help="the router's queue policy in the config")
    p.add_argument("--vllm-python", help="the Python whose vllm checks the vLLM commands (default: this one)")
    p.add_argument("--sglang-python", help="the Python whose sglang checks the SGLang commands (default: this one)")
    p.add_argument("--out", type=folder, help="write launch-vllm.sh, launch-sglang.sh and router.json here (with "
                   "--target kubernetes: kubernetes-vllm.yaml, kubernetes-sglang.yaml)")
    p.add_argument("--target", choices=("scripts", "kubernetes"), default="scripts",
                   help="scripts: one shell line per engine on its node, and router.json; kubernetes: a StatefulSet "
                   "per replica group, the router as a Deployment and Service (checked offline against Kubernetes' "
                   "schemas where kubernetes-validate is installed)")
    p.add_argument("--image", help="kubernetes: the engine's container image (default: vllm/vllm-openai:latest, "
                   "lmsysorg/sglang:latest)")
    p.add_argument("--router-image", default="flexmesh:latest",
                   help="kubernetes: an image with flexmesh[serve] installed, running the router")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from flexmesh.files import make_folder, write_atomic
    from flexmesh.serve.export import check_launches, launch_script, launches, router_config
    from flexmesh.serve.layout.plan import load_plan
    from flexmesh.serve.plan.check import check_plan

    for flag, value in (("--model-path", args.model_path), ("--image", args.image),
                        ("--router-image", args.router_image)):
        if value is not None and not value.strip():
            raise SpecError(f"{flag} is empty; give a value, or leave the flag out for its default")
    for flag, python in (("--vllm-python", args.vllm_python), ("--sglang-python", args.sglang_python)):
        if python is not None and not shutil.which(python):
            raise SpecError(f"{flag} {python!r} is not a Python here; give the interpreter of the engine's "
                            "environment (e.g. .venvs/vllm/bin/python), or leave the flag out")
    plan = load_plan(args.plan)
    check_plan(plan)
    model = args.model_path or plan.models[0]
    engines = [e.name for e in exported()] if args.engine == "both" else [args.engine]
    out = Path(args.out) if args.out else None
    if out is not None:
        make_folder(out)
    if args.target == "kubernetes":
        return _kubernetes(args, plan, model, engines, out)
    first = None
    for engine in engines:
        commands = launches(engine, plan, model, args.base_port, args.host)
        first = first or commands
        checked = check_launches(engine, commands, getattr(args, f"{engine}_python", None))
        print(f"{engine}: {len(commands)} engine(s); {checked}", file=sys.stderr)
        script = launch_script(engine, commands, checked)
        if out is not None:
            write_atomic(out / f"launch-{engine}.sh", script)
        else:
            print(script)
    assert first is not None
    config = json.dumps(router_config(plan, first, args.queue), indent=1) + "\n"
    if out is not None:
        write_atomic(out / "router.json", config)
        print(f"wrote {out}", file=sys.stderr)
    else:
        print(config)
    return 0


def _kubernetes(args, plan, model: str, engines: list[str], out) -> int:
    from flexmesh.files import write_atomic
    from flexmesh.serve.kubernetes import check_manifests, manifests, to_yaml

    refused = False
    for engine in engines:
        docs = manifests(plan, engine, model, args.image, args.router_image, args.queue)
        checked = check_manifests(docs)
        refused = refused or checked.startswith("REFUSED")
        print(f"{engine}: {sum(d['kind'] == 'StatefulSet' for d in docs)} replica group(s), the router; {checked}",
              file=sys.stderr)
        text = to_yaml(docs, f"{engine} engines of a flexmesh serving plan and flexmesh's router in front of them\n"
                             f"({checked})\nkubectl label node NODE flexmesh.io/device=DEVICE for each node's GPUs, "
                             "then kubectl apply -f this file")
        if out is not None:
            write_atomic(out / f"kubernetes-{engine}.yaml", text)
        else:
            print(text)
    if out is not None:
        print(f"wrote {out}", file=sys.stderr)
    return 1 if refused else 0
