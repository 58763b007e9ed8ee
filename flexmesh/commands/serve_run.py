"""``flexmesh serve run``: engine processes on this machine behind flexmesh's router, an OpenAI-compatible endpoint
on 127.0.0.1, until Ctrl-C or SIGTERM: N engines of one config, or a serving plan's replicas (``--plan``)
(docs/serving-engines.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from flexmesh.commands.args import folder, new_file, nonneg_float, nonneg_int
from flexmesh.commands.engine_args import (
    add_engine_args,
    add_fleet_args,
    engine_config,
    need_aiohttp,
    router_options,
)
from flexmesh.errors import ServeError


def add_parser(kinds) -> argparse.ArgumentParser:
    p = kinds.add_parser("run", help="start engine processes behind flexmesh's router (OpenAI-compatible HTTP)",
                         description="Start engine processes (transformers' continuous batching) -- N of one config, "
                                     "or a serving plan's replicas -- and flexmesh's router in front of them on "
                                     "127.0.0.1; Ctrl-C or SIGTERM stops them all.")
    p.add_argument("--plan", metavar="PLAN", help="a serving plan (flexmesh serve plan --out): its replicas, their "
                   "knobs and its routing")
    p.add_argument("--map-to-cpu", action="store_true",
                   help="run a plan made for GPUs this machine lacks as CPU engines here (timings are then this "
                   "machine's, not the GPUs')")
    add_fleet_args(p, engines_default=2)
    p.add_argument("--port", type=nonneg_int, default=8000, help="the router's port on 127.0.0.1 (0: any free port)")
    p.add_argument("--requests", type=new_file, help="append one record per answered request to this JSONL file")
    p.add_argument("--events", type=new_file, help="append what happened (engines lost, requests re-sent) to this "
                   "JSONL file")
    p.add_argument("--logs", type=folder, help="folder for the engines' logs (default: a temporary folder)")
    p.add_argument("--progress-every", type=nonneg_float, default=10.0,
                   help="seconds between progress lines (0: none)")
    add_engine_args(p)
    p.set_defaults(func=run)
    return p


def resolve_fleet(args: argparse.Namespace):
    """(engine configs, router options, what to say first) of the flags: N engines of one config, or a plan's."""
    from flexmesh.serve.engine.local import plan_engines
    from flexmesh.serve.layout.plan import load_plan
    from flexmesh.serve.plan.check import check_plan

    base = engine_config(args)
    if not args.plan:
        if args.map_to_cpu:
            raise ServeError("--map-to-cpu maps a plan's GPUs to CPU engines; give --plan PLAN")
        cfgs = [base] * args.engines
        opts = router_options(args, base.model, len(cfgs))
        opts.setdefault("max_running", [c.max_requests_per_batch for c in cfgs])
        return cfgs, args.route or "round-robin", opts, []
    plan = load_plan(args.plan)
    check_plan(plan)
    local = plan_engines(plan, base, args.model, args.map_to_cpu)
    cfgs = list(local.configs)
    opts = router_options(args, cfgs[0].model, len(cfgs))
    opts.setdefault("max_running", list(local.max_running))
    route = args.route or "plan"
    if route == "plan":
        from dataclasses import replace as dc_replace

        opts["table"] = dc_replace(local.table, policy=local.routing)
    return cfgs, route, opts, list(local.notes)


def run(args: argparse.Namespace) -> int:
    from flexmesh.serve.engine.http import check_port
    from flexmesh.serve.engine.processes import serve_fleet

    need_aiohttp()
    cfgs, route, opts, notes = resolve_fleet(args)
    check_port(args.port, "the router")  # a port in use: one line now, not after minutes of starting engines
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="flexmesh-serve-"))
    for n in notes:
        print(n, file=sys.stderr)
    print(f"starting {len(cfgs)} engine(s) of {cfgs[0].model} (logs: {logs}) ...", file=sys.stderr, flush=True)

    def said(e: dict) -> None:
        what = {k: v for k, v in e.items() if k not in ("t", "event")}
        print(f"[{e['t']:8.2f} s] {e['event']}: " + ", ".join(f"{k} {v}" for k, v in what.items()),
              file=sys.stderr, flush=True)

    async def ready(url, engines) -> None:
        ports = ", ".join(str(e.port) for e in engines)
        print(f"serving {cfgs[0].model} on {url}/v1/completions ({len(engines)} engines on ports {ports}; route "
              f"{route}, queue {opts['queue']}); health: {url}/health; Ctrl-C stops", flush=True)
        if args.progress_every > 0:
            asyncio.ensure_future(progress(url.router, args.progress_every))

    alive = asyncio.run(serve_fleet(cfgs, len(cfgs), args.port, logs,
                                    Path(args.requests) if args.requests else None, route, on_ready=ready,
                                    max_outstanding=args.max_outstanding, request_timeout_s=args.request_timeout,
                                    events=Path(args.events) if args.events else None, on_event=said, **opts))
    if not alive:
        print(f"stopped: every engine was lost (their logs: {logs})", file=sys.stderr)
        return 1
    print("stopped", file=sys.stderr)
    return 0


async def progress(router, every_s: float) -> None:
    """A line now and then: engines up, requests held and answered, tokens per second."""
    t0, tokens0 = time.perf_counter(), router.decode_tokens
    while True:
        await asyncio.sleep(every_s)
        now = time.perf_counter()
        up = sum(r.up for r in router.replicas)
        held = " ".join(f"{len(r.running)}+{len(r.queue)}" for r in router.replicas)
        rate = (router.decode_tokens - tokens0) / max(now - t0, 1e-9)
        print(f"[{router.clock():8.2f} s] engines up {up}/{len(router.replicas)}; sent+queued per engine {held}; "
              f"answered {router.answered}, failed {router.failed}; {rate:,.0f} output tok/s", file=sys.stderr,
              flush=True)
        t0, tokens0 = now, router.decode_tokens
