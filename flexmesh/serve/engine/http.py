"""What the engine processes and the router share over HTTP: the OpenAI-compatible completion request
they accept, its one-line errors, and how a server starts on 127.0.0.1 and stops on a signal.

A completion request (``POST /v1/completions``, OpenAI's legacy completions API as vLLM serves it)::

    {"prompt": [17, 4, 980], "max_tokens": 32, "temperature": 0}

``prompt`` is a list of token ids (the models here have random weights and no tokenizer; a string is
refused with a line saying so), ``max_tokens`` the tokens to generate: exactly that many come back, as
no token of a random model means "stop" (vLLM's ``ignore_eos``). Decoding is greedy; a
``temperature`` other than 0 or ``stream: true`` is refused. ``request_id`` (vLLM's field) names the
request, so that ``POST /cancel`` can stop it. The answer is OpenAI's ``text_completion`` object with
the tokens in ``choices[0].token_ids`` (vLLM's field) and the request's times in ``metrics``
(perf_counter seconds; see :mod:`flexmesh.serve.engine.engine`); a cancelled request answers with the
tokens it had generated and ``finish_reason: "abort"``.

Test-time scaling (the router only): ``"n": 8`` branches of which ``"needed": 2`` are wanted, each
``"branch_tokens"`` long (flexmesh's fields: a random model never stops by itself, so each branch's
length stands for where a sampled answer would have ended); the router sends the branches to one
engine and stops the rest once ``needed`` have finished.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any

from flexmesh.errors import FlexmeshError, ServeError

HOST = "127.0.0.1"  # engines and the router listen on the loopback interface only
MAX_BODY_BYTES = 8 * 2**20  # the largest request body a server reads
READY = "flexmesh-serve-ready"  # the first line a started server prints: READY {"port": ...}
MAX_BRANCHES = 1024  # branches one request may sample
# Seconds a client keeps an idle connection to an engine: below the 5 s after which uvicorn (vLLM's and SGLang's
# server; vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE) closes one, so that no request is sent on a connection the server is
# closing (aiohttp keeps them 15 s; the request then fails with "Server disconnected", seen here under load)
KEEPALIVE_S = 2.0


@dataclass(frozen=True)
class Completion:
    """A parsed completion request: the prompt, the tokens to generate, and for test-time scaling ``n`` branches
    of which ``needed`` are wanted, each ``branch_tokens`` long where given (see the module doc)."""

    prompt: list[int]
    max_tokens: int
    n: int = 1
    needed: int = 1
    branch_tokens: tuple[int, ...] = ()
    request_id: str | None = None


def parse_completion(body: Any, max_tokens_cap: int, branches: bool = False) -> Completion:
    """The completion request ``body``; ServeError (one line) when malformed. ``n`` above 1 (with flexmesh's
    ``needed`` and ``branch_tokens``) only where ``branches`` (the router's fan-out; an engine serves one).

    >>> parse_completion({"prompt": [1, 2, 3], "max_tokens": 4}, 4096)
    Completion(prompt=[1, 2, 3], max_tokens=4, n=1, needed=1, branch_tokens=(), request_id=None)
    >>> parse_completion({"prompt": [[5, 6]], "max_tokens": 1, "temperature": 0.0}, 4096).prompt
    [5, 6]
    >>> parse_completion({"prompt": [5], "max_tokens": 9, "n": 3, "needed": 2, "branch_tokens": [4, 9, 2]}, 99,
    ...                  branches=True).branch_tokens
    (4, 9, 2)
    >>> parse_completion({"prompt": "hello", "max_tokens": 4}, 4096)
    Traceback (most recent call last):
    ...
    flexmesh.errors.ServeError: prompt must be a list of token ids: this model has no tokenizer
    """
    if not isinstance(body, dict):
        raise ServeError("the request body must be a JSON object with prompt and max_tokens")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # OpenAI's batch form with one prompt
    if isinstance(prompt, str):
        raise ServeError("prompt must be a list of token ids: this model has no tokenizer")
    if not isinstance(prompt, list) or not prompt or not all(type(t) is int for t in prompt):
        raise ServeError("prompt must be a non-empty list of token ids (one prompt per request)")
    max_tokens = body.get("max_tokens", 16)
    if type(max_tokens) is not int or not 1 <= max_tokens <= max_tokens_cap:
        raise ServeError(f"max_tokens must be an integer from 1 to {max_tokens_cap}, got {max_tokens!r}")
    temperature = body.get("temperature", 0)
    if temperature not in (0, 0.0, None):
        raise ServeError(f"only greedy decoding is served: temperature must be 0, got {temperature!r}")
    if body.get("stream"):
        raise ServeError("streaming is not served: send stream false")
    rid = body.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 200):
        raise ServeError("request_id must be a non-empty string of at most 200 characters")
    n, needed = body.get("n", 1), body.get("needed", 1)
    if n == 1 and needed == 1 and not body.get("branch_tokens"):
        return Completion(prompt, max_tokens, request_id=rid)
    if not branches:
        raise ServeError("one completion per request here: send n 1 (flexmesh's router fans out n branches)")
    if type(n) is not int or type(needed) is not int or not 1 <= needed <= n <= MAX_BRANCHES:
        raise ServeError(f"branches: give n from 1 to {MAX_BRANCHES} and needed from 1 to n, got n {n!r}, needed "
                         f"{needed!r}")
    lengths = body.get("branch_tokens") or [max_tokens] * n
    if (not isinstance(lengths, list) or len(lengths) != n
            or not all(type(x) is int and 1 <= x <= max_tokens for x in lengths)):
        raise ServeError(f"branch_tokens must list one length from 1 to max_tokens ({max_tokens}) per branch ({n})")
    return Completion(prompt, max_tokens, n, needed, tuple(lengths), rid)


def error_body(message: str, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error object around one line."""
    return {"error": {"message": message, "type": kind}}


def announce_ready(port: int, **extra: Any) -> None:
    """Print the line a parent process waits for (flexmesh.serve.engine.processes)."""
    print(READY, json.dumps({"port": port, **extra}), flush=True)


def check_port(port: int, what: str, host: str = HOST) -> None:
    """ServeError (one line) when ``host``:``port`` cannot be bound now (port 0, any free one: only the host)."""
    if not 0 <= port <= 65535:
        raise ServeError(f"{what}'s port must be from 0 to 65535, got {port}")
    if not host or not host.isprintable():
        raise ServeError(f"{what}'s host {host!r} is empty or holds a control character; give an address of this "
                         "machine (127.0.0.1, or 0.0.0.0 for every interface)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror as e:
            raise ServeError(f"{what} cannot listen on {host!r} ({e.strerror or e}); give an address of this machine "
                             "(127.0.0.1, or 0.0.0.0 for every interface)") from None
        except OSError as e:
            fix = "choose another port (0 picks a free one)" if port else "give an address of this machine"
            raise ServeError(f"{what} cannot listen on {host}:{port} ({e.strerror or e}); {fix}") from None


async def serve_until_signal(app, port: int, what: str, on_started=None) -> None:
    """Serve ``app`` on 127.0.0.1:``port`` (0: any free port) until SIGINT or SIGTERM, then stop it
    cleanly (its ``on_cleanup`` handlers run). A port that cannot be bound is one ServeError line."""
    from aiohttp import web

    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, HOST, port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ServeError(f"{what} cannot listen on {HOST}:{port} ({e.strerror or e}); choose another port "
                         "(0 picks a free one)") from None
    bound = runner.addresses[0][1] if runner.addresses else port
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if on_started is not None:
        await on_started(bound)
    announce_ready(bound)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await runner.cleanup()


def run_server(main) -> int:
    """Run the coroutine ``main()`` of a server process: a FlexmeshError is one line on stderr, exit 2."""
    try:
        asyncio.run(main())
    except FlexmeshError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0
