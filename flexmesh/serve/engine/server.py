"""One engine process: an :class:`~flexmesh.serve.engine.engine.Engine` behind an OpenAI-compatible HTTP
endpoint on 127.0.0.1 (aiohttp).

    python -m flexmesh.serve.engine.server --config '{"model": "tiny", "num_blocks": 2048}' --port 0

Routes: ``POST /v1/completions`` (:mod:`flexmesh.serve.engine.http`), ``GET /v1/models``,
``GET /health`` (200 while the engine loop runs, with its outstanding requests; 503 once it stopped, or
while it holds requests and ran no iteration for :data:`STALL_S`: a stuck loop), ``POST /cancel``
(``{"request_id": ...}``: stop a request; it answers with the tokens it had) and
``GET /iterations?since=K`` (the engine's iterations from the K-th on, at most :data:`ITERATIONS_PAGE` per
answer). It prints ``flexmesh-serve-ready {"port": N}`` once it listens
and stops cleanly on SIGINT or SIGTERM (requests still running are answered with an error).

Bounded: at most ``--max-outstanding`` requests at once (more are answered 503 at once) and none
waits longer than ``--request-timeout`` seconds (504).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from flexmesh.errors import ServeError
from flexmesh.serve.engine.config import EngineConfig
from flexmesh.serve.engine.http import (
    MAX_BODY_BYTES,
    check_port,
    error_body,
    parse_completion,
    run_server,
    serve_until_signal,
)

ITERATIONS_PAGE = 20_000
STALL_S = 30.0  # an engine holding requests that ran no iteration for this long is unhealthy (a stuck loop)


def build_app(engine, max_outstanding: int, request_timeout_s: float, stall_s: float = STALL_S):
    """The aiohttp application of one engine."""
    from aiohttp import web

    model_id = engine.cfg.model

    async def completions(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            c = parse_completion(body, engine.max_position)
            prompt, max_tokens = c.prompt, c.max_tokens
            engine.check(prompt, max_tokens)
        except (ValueError, RecursionError) as e:  # not JSON (JSONDecodeError is a ValueError), or nested past it
            msg = str(e) if isinstance(e, ServeError) else f"the request body is not JSON ({type(e).__name__})"
            return web.json_response(error_body(msg), status=400)
        if engine.outstanding >= max_outstanding:
            return web.json_response(error_body(f"the engine holds {max_outstanding} requests already; retry later",
                                                "overloaded"), status=503)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def settle(f) -> None:
            if not done.done():
                done.set_result(f)

        def finished(f) -> None:
            loop.call_soon_threadsafe(settle, f)

        try:
            engine.submit(prompt, max_tokens, finished, c.request_id)
        except ServeError as e:
            return web.json_response(error_body(str(e), "unavailable"), status=503)
        try:
            f = await asyncio.wait_for(done, request_timeout_s)
        except asyncio.TimeoutError:
            return web.json_response(error_body(f"no answer within {request_timeout_s:g} s", "timeout"), status=504)
        if f.error is not None and not f.cancelled:
            return web.json_response(error_body(f.error, "engine_error"), status=500)
        return web.json_response(completion_body(model_id, f))

    async def health(request: web.Request) -> web.Response:
        # Stalled: requests held, and no iteration for stall_s (the loop thread is stuck while HTTP still answers).
        quiet = time.perf_counter() - engine.last_iteration_s
        status = ("stopped" if not engine.running else
                  "stalled" if engine.outstanding and quiet > stall_s else "ok")
        return web.json_response({"status": status, "model": model_id, "outstanding": engine.outstanding,
                                  "since_iteration_s": round(quiet, 3), "config": engine.cfg.to_json()},
                                 status=200 if status == "ok" else 503)

    async def cancel(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            rid = body["request_id"]
        except (ValueError, KeyError, TypeError, RecursionError):
            return web.json_response(error_body('send {"request_id": "..."}'), status=400)
        return web.json_response({"request_id": rid, "cancelled": engine.cancel(str(rid))})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [model_card(engine)]})

    async def iterations(request: web.Request) -> web.Response:
        try:
            since = int(request.query.get("since", "0"))
        except ValueError:
            return web.json_response(error_body("since must be an integer"), status=400)
        its = list(engine.iterations)
        page = its[max(since, 0):max(since, 0) + ITERATIONS_PAGE]
        return web.json_response({"total": len(its), "iterations": [i.to_dict() for i in page]})

    async def close(app) -> None:
        await asyncio.get_running_loop().run_in_executor(None, engine.close)

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/iterations", iterations)
    app.router.add_post("/cancel", cancel)
    app.on_cleanup.append(close)
    return app


def model_card(engine) -> dict:
    """OpenAI's model object, with vLLM's ``max_model_len``, the vocabulary a client draws token ids from, and what
    the engine runs with for speed (:func:`flexmesh.serve.engine.engine.speed`)."""
    return {"id": engine.cfg.model, "object": "model", "owned_by": "flexmesh", "max_model_len": engine.max_position,
            "vocab_size": engine.vocab, "speed": engine.speed}


def completion_body(model_id: str, f) -> dict:
    """OpenAI's ``text_completion`` object of a finished request, with token ids and times."""
    return {
        "id": f"cmpl-{f.request_id}", "object": "text_completion", "created": int(time.time()), "model": model_id,
        "choices": [{"index": 0, "text": " ".join(map(str, f.tokens)), "token_ids": f.tokens, "logprobs": None,
                     "finish_reason": "abort" if getattr(f, "cancelled", False) else "length"}],
        "usage": {"prompt_tokens": f.prompt_tokens, "completion_tokens": len(f.tokens),
                  "total_tokens": f.prompt_tokens + len(f.tokens)},
        "metrics": {"queued_s": f.queued_s, "started_s": f.started_s, "token_s": f.token_s},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexmesh.serve.engine.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="{}", help="EngineConfig as JSON (default: its defaults)")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free port)")
    p.add_argument("--max-outstanding", type=int, default=1024, help="requests held at once; more get 503")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may wait; then 504")
    args = p.parse_args(argv)

    async def serve() -> None:
        from flexmesh.serve.engine.engine import Engine

        cfg = EngineConfig.from_json(args.config)
        check_port(args.port, "the engine")  # before seconds of building the model
        loop = asyncio.get_running_loop()
        engine = await loop.run_in_executor(None, Engine, cfg)  # builds the model: seconds
        print(f"engine speed: {engine.speed['note']}", file=sys.stderr, flush=True)
        try:
            app = build_app(engine, args.max_outstanding, args.request_timeout)
        except BaseException:
            engine.close()
            raise
        await serve_until_signal(app, args.port, "the engine")

    return run_server(serve)


if __name__ == "__main__":
    sys.exit(main())
