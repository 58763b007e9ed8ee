"""``flexmesh serve run``: N engine processes on this machine behind flexmesh's router, an OpenAI-compatible
endpoint on 127.0.0.1, until Ctrl-C or SIGTERM (docs/serving-engines.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from flexmesh.commands.args import folder, new_file, nonneg_int
from flexmesh.commands.engine_args import add_engine_args, add_fleet_args, engine_config, need_aiohttp


def add_parser(kinds) -> argparse.ArgumentParser:
    p = kinds.add_parser("run", help="start engine processes behind flexmesh's router (OpenAI-compatible HTTP)",
                         description="Start N engine processes (transformers' continuous batching) and flexmesh's "
                                     "router in front of them on 127.0.0.1; Ctrl-C or SIGTERM stops them all.")
    add_fleet_args(p, engines_default=2)
    p.add_argument("--port", type=nonneg_int, default=8000, help="the router's port on 127.0.0.1 (0: any free port)")
    p.add_argument("--requests", type=new_file, help="append one record per answered request to this JSONL file")
    p.add_argument("--logs", type=folder, help="folder for the engines' logs (default: a temporary folder)")
    add_engine_args(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from flexmesh.serve.engine.fleet import serve_fleet
    from flexmesh.serve.engine.http import check_port

    need_aiohttp()
    cfg = engine_config(args)
    check_port(args.port, "the router")  # a port in use: one line now, not after minutes of starting engines
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="flexmesh-serve-"))
    print(f"starting {args.engines} engine(s) of {cfg.model} (logs: {logs}) ...", file=sys.stderr, flush=True)

    async def ready(url: str, engines) -> None:
        ports = ", ".join(str(e.port) for e in engines)
        print(f"serving {cfg.model} on {url}/v1/completions ({len(engines)} engines on ports {ports}, "
              f"{args.route}); health: {url}/health; Ctrl-C stops", flush=True)

    asyncio.run(serve_fleet(cfg, args.engines, args.port, logs, Path(args.requests) if args.requests else None,
                            args.route, on_ready=ready, max_outstanding=args.max_outstanding,
                            request_timeout_s=args.request_timeout))
    print("stopped", file=sys.stderr)
    return 0
