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

from flexmesh.commands.args import first_given, folder, new_file, nonneg_float, nonneg_int
from flexmesh.commands.engine_args import (
    DEFAULT_ENGINES,
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
    add_fleet_args(p)
    p.add_argument("--port", type=nonneg_int, default=8000, help="the router's port (0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="the address the router listens on (0.0.0.0 in a container "
                   "others reach it in; the loopback by default)")
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
    fleet = first_given({"--plan": args.plan, "--backend": args.backend,
                         "--router-config": getattr(args, "router_config", None)})
    if fleet and args.engines is not None:
        raise ServeError(f"--engines starts that many engines of the flags' knobs; {fleet} gives the fleet itself: "
                         "drop one of them")
    args.engines = args.engines or DEFAULT_ENGINES
    running = fleet if fleet in ("--backend", "--router-config") else None
    starts = first_given({"--engine-arg": args.engine_arg, "--engine-python": args.engine_python})
    if running and starts:
        raise ServeError(f"{starts} shapes the engines flexmesh starts; {running} fronts engines already running: "
                         f"drop {starts} (give those flags to the engines where they start)")
    if getattr(args, "router_config", None):
        return _router_config(args)
    if args.backend:
        return _backends(args, base)
    if args.engine != "transformers":
        return _external(args, base)
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


def _model_folder(args, base, kv_tokens: int | None):
    """(the model folder a vLLM / SGLang engine loads, its extra flags, its card) (flexmesh.serve.engine.external):
    a flexmesh model's context is cut to the KV cache given, which vLLM refuses to be shorter."""
    from flexmesh.serve.engine.external import model_card, model_flags, write_model

    if args.model_path:
        folder = Path(args.model_path).resolve()
        return folder, [], model_card(folder)
    folder = write_model(base.model, base.seed, base.dtype, Path(tempfile.mkdtemp(prefix="flexmesh-model-")))
    card = model_card(folder)
    card["max_model_len"] = min(card["max_model_len"], kv_tokens or card["max_model_len"])
    return folder, model_flags(base.dtype, card["max_model_len"], tokenizer=False), card


def external_engines(args, base, plan=None):
    """(the vLLM or SGLang engines to start here: a plan's replicas, or --engines of the flags' knobs, by the
    export's commands; the model's card; the model folder; what to say first)."""
    from flexmesh.serve.engine.external import engine_python, externals, free_ports
    from flexmesh.serve.engines import engine
    from flexmesh.serve.export import Launch, launches
    from flexmesh.serve.layout.knobs import EngineKnobs
    from flexmesh.serve.layout.roles import Role

    python = engine_python(args.engine, args.engine_python)
    # vLLM keeps one of the KV blocks it is given aside (its null block) and refuses a context longer than the rest
    folder, flags, card = _model_folder(args, base, None if plan else (base.num_blocks - 1) * base.page_size)
    if plan is not None:
        runs = launches(args.engine, plan, str(folder), host="127.0.0.1")
        kv = [1 << 30] * len(runs)  # sized by each engine from its memory: unknown here, so not weighed
    else:
        knobs = EngineKnobs(base.max_requests_per_batch, base.max_batch_tokens, base.page_size,
                            prefix_caching=base.block_sharing, kv_blocks=base.num_blocks)
        launch = engine(args.engine).argv
        if launch is None:
            raise ServeError(f"flexmesh has no launch command for {args.engine}; engines it starts: vllm, sglang")
        argv = launch(knobs, 1, 1, Role.AGGREGATED, str(folder), "127.0.0.1", 0)
        runs = [Launch(k, 0, "cpu", "aggregated", 0, tuple(argv), {}, knobs.max_seqs) for k in range(args.engines)]
        kv = [base.kv_tokens] * len(runs)
    cfgs = externals(args.engine, runs, python, free_ports(len(runs)), flags + list(args.engine_arg),
                     {"OMP_NUM_THREADS": str(base.threads)}, kv, None if plan else base)
    return cfgs, card, folder, f"{args.engine} engines from {python}, model {folder}"


def _external(args, base):
    """vLLM or SGLang engines started here behind the router (:func:`external_engines`)."""
    from flexmesh.serve.engine.external import fronting
    from flexmesh.serve.layout.plan import load_plan

    plan = load_plan(args.plan) if args.plan else None
    cfgs, card, folder, note = external_engines(args, base, plan)
    route, opts = args.route or "round-robin", router_options(args, base.model, len(cfgs))
    if plan is not None and args.route is None:
        route, opts["table"] = "plan", plan.placement().table
    opts.update(fronting(card, folder))
    opts.setdefault("max_running", [c.max_running for c in cfgs])
    return cfgs, route, opts, [note]


def _router_config(args):
    """The engines and routing a router.json lists (``serve export``'s: vLLM / SGLang engines on other hosts)."""
    from flexmesh.files import read_json
    from flexmesh.serve.export import router_options as config_options

    if args.backend or args.plan:
        raise ServeError("--router-config lists the engines and the routing; give it without --backend or --plan")
    config = read_json(args.router_config, ServeError, invalid="not a router configuration (JSON)",
                       missing=f"router configuration {args.router_config!r} does not exist; write one with "
                               "`flexmesh serve export --out DIR`")
    try:
        opts = config_options(config)
    except (KeyError, TypeError, ValueError) as e:
        raise ServeError(f"{args.router_config}: not a router configuration of serve export ({type(e).__name__}: "
                         f"{e})") from None
    urls, route = opts.pop("urls"), opts.pop("route")
    placeholder = [u for u in urls if "HOST-OF-NODE-" in u]
    if placeholder:
        raise ServeError(f"{args.router_config}: {placeholder[0]} still holds serve export's placeholder host; replace "
                         "HOST-OF-NODE-N with that node's address")
    if args.queue != "fcfs":  # the flag over the file's
        opts["queue"] = args.queue
    opts.update(protocol=config.get("protocol", "openai"), health_interval_s=args.health_interval,
                health_timeout_s=args.health_timeout)
    return urls, args.route or route, opts, [f"fronting the {len(urls)} engine(s) of {args.router_config}"]


def silent_engines(urls: list[str]) -> list[str]:
    """Of engine ``urls``, ``"URL (why)"`` for each that does not answer ``GET /v1/models`` now (vLLM, SGLang and
    flexmesh's engines all serve it): a replay refuses them, a router starts and lets its health checks add them."""
    import urllib.error
    import urllib.request

    out = []
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10):  # noqa: S310 - http(s) URLs, checked
                pass
        except urllib.error.HTTPError:
            continue  # it answers, if not with a model card: the router's own checks say more
        except (urllib.error.URLError, OSError, ValueError) as e:
            out.append(f"{url} ({getattr(e, 'reason', e)})")
    return out


def _backends(args, base):
    """Engines already running at --backend's URLs: flexmesh's own (--engine transformers) or OpenAI-compatible."""
    urls = [u.strip().rstrip("/") for u in args.backend.split(",") if u.strip()]
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if not urls or bad:
        raise ServeError(f"--backend {args.backend!r}: give engine URLs, comma-separated "
                         "(http://127.0.0.1:8100,http://127.0.0.1:8101)")
    if args.plan:
        raise ServeError("--backend fronts engines already running; a plan's replicas are started with --plan alone "
                         "(or export them: flexmesh serve export)")
    opts = router_options(args, base.model, len(urls))
    if args.engine != "transformers":  # what the router tells of the model where the engines' card does not
        opts["protocol"] = "openai"
        if args.model_path:
            from flexmesh.serve.engine.external import fronting, model_card

            folder = Path(args.model_path).resolve()
            opts.update(fronting(model_card(folder), folder))
        elif args.model:
            from flexmesh.spec.model import parse_model

            opts["card"] = {"vocab_size": parse_model(args.model).vocab}
    return urls, args.route or "round-robin", opts, []


def run(args: argparse.Namespace) -> int:
    from flexmesh.serve.engine.http import check_port
    from flexmesh.serve.engine.processes import serve_fleet

    need_aiohttp()
    cfgs, route, opts, notes = resolve_fleet(args)
    check_port(args.port, "the router", args.host)  # one line now, not after minutes of starting engines
    if isinstance(cfgs[0], str):  # engines running elsewhere: the router's health checks add them as they answer
        notes += [f"note: no engine answers at {u} yet; the router adds it when it does" for u in silent_engines(cfgs)]
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="flexmesh-serve-"))
    for n in notes:
        print(n, file=sys.stderr)
    name = fleet_model(cfgs, opts, args)
    print(f"fronting {len(cfgs)} engine(s) at {', '.join(cfgs)}" if isinstance(cfgs[0], str) else
          f"starting {len(cfgs)} engine(s) of {name} (logs: {logs}) ...", file=sys.stderr, flush=True)

    def said(e: dict) -> None:
        what = {k: v for k, v in e.items() if k not in ("t", "event")}
        print(f"[{e['t']:8.2f} s] {e['event']}: " + ", ".join(f"{k} {v}" for k, v in what.items()),
              file=sys.stderr, flush=True)

    async def ready(url, engines) -> None:
        ports = ", ".join(str(e.port) for e in engines) or "given"
        print(f"serving {name} on {url}/v1/completions ({len(cfgs)} engines on ports {ports}; route "
              f"{route}, queue {opts['queue']}); health: {url}/health; Ctrl-C stops", flush=True)
        if args.progress_every > 0:
            asyncio.ensure_future(progress(url.router, args.progress_every))

    alive = asyncio.run(serve_fleet(cfgs, len(cfgs), args.port, logs,
                                    Path(args.requests) if args.requests else None, route, on_ready=ready,
                                    max_outstanding=args.max_outstanding, request_timeout_s=args.request_timeout,
                                    events=Path(args.events) if args.events else None, on_event=said,
                                    host=args.host, **opts))
    if not alive:
        print(f"stopped: every engine was lost (their logs: {logs})", file=sys.stderr)
        return 1
    print("stopped", file=sys.stderr)
    return 0


def fleet_model(cfgs, opts: dict, args) -> str:
    """What the fleet serves, as said to the user."""
    return getattr(cfgs[0], "model", None) or opts.get("model") or args.model or "the engines' model"


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
