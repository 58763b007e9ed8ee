"""flexmesh's router in front of N engine processes: one OpenAI-compatible endpoint on 127.0.0.1 that routes each
completion to an engine, holds it in that engine's queue until the engine has room, survives engines that die or
hang, fans test-time-scaling requests out into branches, and writes one record per request to ``requests.jsonl``.

Routes: ``POST /v1/completions`` (:mod:`flexmesh.serve.engine.http`; the answer gains ``replica``),
``GET /v1/models`` (the first live engine's, with what the router was told of the model where the engine
says nothing: a vocabulary size), ``GET /health`` (200 while every engine is up, else 503 naming those that are
``down``, with what each holds) and ``GET /events`` (what happened: engines lost, requests re-sent).

**Engines** speak flexmesh's protocol (its own engine: each token's time in the answer, ``POST /cancel``) or
OpenAI's streamed completions (vLLM, SGLang: :mod:`flexmesh.serve.engine.openai`), one ``protocol`` per engine.

**Routing** is the simulator's (:mod:`flexmesh.serve.router`, the same classes): ``round-robin``, ``least-work``,
``least-kv``, ``weights``, ``plan`` (a serving plan's routing table by length bucket) and ``long-to-kv``. Each
engine is a :class:`~flexmesh.serve.engine.held.Replica` that answers the routers' questions from what the router
holds for it: its outstanding work (prompt tokens at its prefill price and predicted output tokens at its decode
price) and its KV load (prompt + predicted output tokens of what it holds, over its KV capacity).

**Queues** are the simulator's too (:mod:`flexmesh.serve.queues`: FCFS, SJF, TIE). The router sends an engine at
most ``max_running`` requests at once (the plan's ``max_seqs``, vLLM's ``max_num_seqs``) and holds the rest in
that engine's queue, in the policy's order. Why here and not inside the engine: transformers' schedulers admit
every waiting request whose KV fits (no cap on running requests, and a request that does not fit is skipped, not
waited for), so an engine-side queue forms only once the KV cache is full; subclassing them would tie the policy
to transformers' private scheduler API, while a queue in the router is the simulator's object, works in front of
any engine (vLLM or SGLang started with the same ``max_num_seqs``) and costs one HTTP hop per admission (a
millisecond or two). The twin (:mod:`flexmesh.serve.engine.twin`) models exactly this: each replica admits from
its queue while fewer than ``max_seqs`` run.

**Failures**: a request whose engine drops its connection (the process died) or that an engine's health check
declares lost (no answer within ``health_timeout_s`` ``health_failures`` times in a row: hung; or a stuck loop,
which the engine's own ``/health`` reports) is re-sent to another engine, first in its queue; the lost engine's
queued requests move too, and the routing policy is rebuilt over the engines left (a plan's table keeps its
weights over those, a bucket left with none goes by least work). Nothing is lost while one engine is up. Every
such step is an event (``GET /events``, ``on_event``): ``engine-lost`` (which, why, how many it was running and
held queued), ``rerouted`` (the engines left, the routing rebuilt over them), ``resent`` per request moved, and
``recovered`` once a re-sent request is answered, with ``accepted_s``: when the live engine took it (the engine's
own time, on the router's clock), so a failure's recovery time is the last ``accepted_s`` less the kill's time.

**Test-time scaling** (:mod:`flexmesh.serve.branches`): a request with ``n`` branches sends them all to one engine
(``max_tokens`` each its ``branch_tokens``); once ``needed`` have finished, the others are cancelled
(``POST /cancel`` on the engine, which answers with the tokens each had generated), and a score hook may prune
branches each time one finishes. The answer carries the ``needed`` finished branches (``choices``) and
``usage.decode_tokens``: the tokens every branch generated.

The record of a request (:class:`flexmesh.serve.metrics.RequestRecord`; times in seconds from ``origin_s``, a
perf_counter time: the router's start unless the caller gives one)::

    {"id": 7, "replica": 1, "arrival_s": 3.02, "first_token_s": 3.19, "finish_s": 4.87,
     "prompt_tokens": 412, "output_tokens": 60, "token_s": [3.19, ...]}

``arrival_s`` is when the router received the request; ``id`` the client's ``X-Request-Id`` header (an integer)
or the router's own count. Bounded: at most ``max_outstanding`` requests held (more are answered 503 at once),
every request waits at most ``request_timeout_s`` (then 504).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from flexmesh.data.requests import Request
from flexmesh.errors import FlexmeshError, ServeError
from flexmesh.serve.branches import Score, to_prune
from flexmesh.serve.engine.held import BranchGroup, Held, Replica, request_record
from flexmesh.serve.engine.http import KEEPALIVE_S, MAX_BODY_BYTES, error_body, parse_completion
from flexmesh.serve.engine.openai import PROTOCOLS, Streamed, stream_body
from flexmesh.serve.layout.routing import RoutingTable
from flexmesh.serve.lengths import LengthPredictor
from flexmesh.serve.metrics import RequestRecord
from flexmesh.serve.queues import make_queue
from flexmesh.serve.router import ROUTERS, make_router
from flexmesh.serve.router import Router as Policy

# A client's X-Request-Id: a whole number of at most 18 digits (its record's id)
REQUEST_ID = re.compile(r"[0-9]{1,18}")

if TYPE_CHECKING:
    from aiohttp import ClientSession

HEALTH_TIMEOUT_S = 5.0
HEALTH_INTERVAL_S = 1.0
HEALTH_FAILURES = 2  # health checks in a row without an answer before an engine counts as lost
ROUTES = ROUTERS


class RouterService:
    """The router's state: engines, policies, the open records and events files (see the module doc).

    ``queue`` and ``predictor``: each engine's queue policy and the lengths it (and ``long-to-kv``) reads;
    ``max_running``: requests sent to an engine at once (one number, or one per engine); ``kv_tokens`` and
    ``prices`` (seconds per prompt and per output token): what the routers weigh; ``table`` / ``weights``: the
    plan and weights routers'; ``score`` and ``prune_below``: the branch score hook."""

    def __init__(self, urls: list[str], route: str = "round-robin", records=None, origin_s: float | None = None,
                 max_outstanding: int = 4096, request_timeout_s: float = 600.0, queue: str = "fcfs",
                 predictor: LengthPredictor | None = None, max_running: int | list[int] = 1 << 30,
                 kv_tokens: int | list[int] = 1 << 30, prices: tuple[float, float] = (1.0, 1.0),
                 context: int = 2**31 - 1, table: RoutingTable | None = None,
                 weights: tuple[float, ...] | None = None, score: Score | None = None, prune_below: float = 0.5,
                 health_interval_s: float = HEALTH_INTERVAL_S, health_timeout_s: float = HEALTH_TIMEOUT_S,
                 health_failures: int = HEALTH_FAILURES, events=None,
                 on_event: Callable[[dict], None] | None = None, protocol: str | list[str] = "flexmesh",
                 model: str | None = None, card: dict | None = None) -> None:
        if not urls:
            raise ServeError("the router needs at least one engine")
        if route not in ROUTES:
            raise ServeError(f"route {route!r} is not one of {', '.join(ROUTES)}")
        n = len(urls)
        running = max_running if isinstance(max_running, list) else [max_running] * n
        kv = kv_tokens if isinstance(kv_tokens, list) else [kv_tokens] * n
        protocols = protocol if isinstance(protocol, list) else [protocol] * n
        bad = sorted(set(protocols) - set(PROTOCOLS))
        if bad:
            raise ServeError(f"engine protocol {bad[0]!r} is not one of {', '.join(PROTOCOLS)}")
        try:
            self.replicas = [Replica(i, u, make_queue(queue, predictor, running[i], context), running[i], kv[i],
                                     *prices, protocol=protocols[i]) for i, u in enumerate(urls)]
            self._policy = partial(make_router, weights=weights, table=table, predictor=predictor, context=context)
            self.policy: Policy[Replica] = self._policy(route, self.replicas)
        except FlexmeshError as e:
            raise ServeError(str(e)) from None
        self.route, self.predictor, self.context = route, predictor, context
        self.model = model  # the served model's name, sent to OpenAI-compatible engines where the client gave none
        self.card = card or {}  # what /v1/models adds to an engine's card where it says nothing (vocab_size)
        self.records = records  # a text file open for appending, or None
        self.events_file = events
        self.on_event = on_event
        self.events: list[dict] = []
        self.origin_s = time.perf_counter() if origin_s is None else origin_s
        self.max_outstanding = max_outstanding
        self.request_timeout_s = request_timeout_s
        self.score, self.prune_below = score, prune_below
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.health_failures = health_failures
        self._ids = itertools.count()  # ids of requests sent without X-Request-Id
        self._serials = itertools.count()
        self.records_error = ""  # why the records file was dropped
        self.session: ClientSession | None = None  # while the app runs
        self.answered = self.failed = self.decode_tokens = 0

    @property
    def outstanding(self) -> int:
        return sum(r.outstanding for r in self.replicas)

    def clock(self) -> float:
        return time.perf_counter() - self.origin_s

    def event(self, kind: str, **what: Any) -> None:
        e = {"t": round(self.clock(), 6), "event": kind, **what}
        self.events.append(e)
        if self.events_file is not None:
            self.events_file.write(json.dumps(e) + "\n")
            self.events_file.flush()
        if self.on_event is not None:
            self.on_event(e)

    @property
    def client(self) -> ClientSession:
        """The client session to the engines (the app's, while it runs)."""
        if self.session is None:
            raise ServeError("the router's app is not running: its client session starts with it (RouterService.app())")
        return self.session

    def app(self):
        """The aiohttp application (its client session and the health watch start on startup, stop on cleanup)."""
        from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

        watch: list[asyncio.Task] = []

        async def start(app) -> None:
            # No total timeout on a forward: a request may wait long in an overloaded engine; an engine that
            # hangs is found by its health checks, and each client request has its own timeout.
            self.session = ClientSession(timeout=ClientTimeout(total=None, sock_connect=self.health_timeout_s),
                                         connector=TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S))
            if self.health_interval_s > 0:
                watch.append(asyncio.ensure_future(self._watch()))

        async def stop(app) -> None:
            for t in watch:
                t.cancel()
            for r in self.replicas:
                for h in list(r.running.values()):
                    if h.task is not None:
                        h.task.cancel()
            if self.session is not None:
                await self.session.close()

        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/events", self._events)
        app.on_startup.append(start)
        app.on_cleanup.append(stop)
        return app

    # ---- requests in --------------------------------------------------------------------------------------------
    async def _completions(self, request):
        from aiohttp import web

        arrival = time.perf_counter()
        header = request.headers.get("X-Request-Id")
        if header is not None and not REQUEST_ID.fullmatch(header):
            return web.json_response(error_body(f"X-Request-Id must be a whole number of 1 to 18 digits, got "
                                                f"{header[:40]!r}"), status=400)
        rid = int(header) if header is not None else next(self._ids)  # the client's: its record keeps it
        try:
            body = json.loads(await request.read())
            c = parse_completion(body, self.context if self.context < 2**31 - 1 else 1 << 30, branches=True)
        except (ValueError, ServeError, RecursionError) as e:  # not JSON, nested past the parser, not a completion
            msg = str(e) if isinstance(e, ServeError) else f"the request body is not JSON ({type(e).__name__})"
            return web.json_response(error_body(msg), status=400)
        if len(c.prompt) >= self.context:
            return web.json_response(error_body(f"the prompt of {len(c.prompt):,} tokens leaves no room in the "
                                                f"model's context of {self.context:,}"), status=400)
        if self.outstanding + c.n > self.max_outstanding:
            return web.json_response(error_body(f"the router holds {self.max_outstanding} requests already; "
                                                "retry later", "overloaded"), status=503)
        r = Request(rid, arrival - self.origin_s, len(c.prompt), c.max_tokens, branches=c.n, needed=c.needed,
                    branch_tokens=c.branch_tokens if c.n > 1 else ())
        fwd = {k: v for k, v in body.items() if k not in ("n", "needed", "branch_tokens", "request_id")}
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        rep = self._choose(r)
        if rep is None:
            return web.json_response(error_body("every engine is down; restart the fleet", "unavailable"),
                                     status=503)
        predicted = self._predicted(r)
        serial = next(self._serials)  # the router's own key: two requests with one client id never meet
        if c.n == 1:
            h = Held(r, fwd, c.max_tokens, predicted, future=future, serial=serial)
            self._admit(rep, h)
        else:
            g = BranchGroup(r, future, replica=rep)
            for b, n in enumerate(r.branch_lengths()):
                h = Held(r, fwd, n, min(predicted, n), branch=b, group=g, serial=serial)
                g.alive[b] = h
                self._admit(rep, h, pump=False)
            self._pump(rep)
        try:
            status, answer = await asyncio.wait_for(asyncio.shield(future), self.request_timeout_s)
        except asyncio.TimeoutError:
            self._give_up(future)
            return web.json_response(error_body(f"no answer within {self.request_timeout_s:g} s", "timeout"),
                                     status=504)
        if status != 200:
            self.failed += 1
            return web.json_response(answer, status=status)
        answer["metrics"]["arrival_s"] = arrival
        self.answered += 1
        return web.json_response(answer)

    def _predicted(self, r: Request) -> float:
        if self.predictor is None:
            return float(r.output_tokens)
        return self.predictor.predict(r, max(self.context - r.prompt_tokens, 1)).mean()

    def _choose(self, r: Request) -> Replica | None:
        if not any(x.up for x in self.replicas):
            return None
        return self.policy.choose(r)

    def _admit(self, rep: Replica, h: Held, front: bool = False, pump: bool = True) -> None:
        h.replica = rep
        rep.hold(h)
        (rep.queue.push_front if front else rep.queue.push)(h)
        if pump:
            self._pump(rep)

    def _pump(self, rep: Replica) -> None:
        """Send the engine what its queue holds while it has room."""
        while rep.up and len(rep.running) < rep.max_running and len(rep.queue):
            h = rep.queue.pop()
            h.attempts += 1
            h.engine_rid = f"{h.serial}.{h.branch}.{h.attempts}"
            rep.running[h.engine_rid] = h
            rep.sent += 1
            h.task = asyncio.ensure_future(self._forward(rep, h))

    # ---- one request on one engine ------------------------------------------------------------------------------
    async def _forward(self, rep: Replica, h: Held) -> None:
        from aiohttp import ClientConnectionError, ClientError

        try:
            status, text = await (self._streamed(rep, h) if rep.protocol == "openai" else self._posted(rep, h))
        except asyncio.CancelledError:  # its engine was declared lost: the request was re-sent already
            raise
        except (ClientConnectionError, asyncio.TimeoutError) as e:
            # The engine closed or refused the connection (its process died), or did not take it in time.
            if h.engine_rid in rep.running:  # else its engine was declared lost: re-sent already
                self._lost(rep, f"its connection failed ({type(e).__name__}: {e})".replace("\n", " "))
            return
        except ClientError as e:
            rep.running.pop(h.engine_rid, None)
            rep.release(h)
            self._fail(h, 502, error_body(f"engine {rep.index} at {rep.url} did not answer ({e})", "unavailable"))
            self._pump(rep)
            return
        if rep.running.pop(h.engine_rid, None) is None:  # lost meanwhile and re-sent elsewhere
            return
        rep.release(h)
        self._pump(rep)
        if status != 200:
            if isinstance(text, dict):
                answer = text
            else:
                try:
                    answer = json.loads(text)
                except ValueError:
                    answer = error_body(text.strip()[:200] or f"HTTP {status}", "engine_error")
            self._fail(h, status, answer)
            return
        answer = json.loads(text) if isinstance(text, str) else text
        answer["replica"] = rep.index
        if h.resent:  # a re-sent request answered: when the live engine took it (its own clock, perf_counter)
            accepted = answer.get("metrics", {}).get("queued_s")
            self.event("recovered", id=h.r.id, branch=h.branch, engine=rep.index, attempt=h.attempts,
                       accepted_s=None if accepted is None else round(accepted - self.origin_s, 6))
        if h.group is not None:
            self._branch_answered(h, answer)
            return
        self.decode_tokens += len(answer["choices"][0]["token_ids"])
        self._write(request_record(h.r.id, rep.index, h.r.arrival_s + self.origin_s, answer, self.origin_s))
        if h.future is not None and not h.future.done():
            h.future.set_result((200, answer))

    async def _posted(self, rep: Replica, h: Held) -> tuple[int, str]:
        """flexmesh's engine: one request, one answer with its tokens' times."""
        body = {**h.body, "max_tokens": h.tokens, "request_id": h.engine_rid}
        async with self.client.post(f"{rep.url}/v1/completions", json=body) as resp:
            return resp.status, await resp.text()

    async def _streamed(self, rep: Replica, h: Held) -> tuple[int, str | dict]:
        """An OpenAI-compatible engine: the request streamed, each token timed as it arrives, stopped by closing
        the stream (:mod:`flexmesh.serve.engine.openai`)."""
        from aiohttp import ClientConnectionError, ClientPayloadError, ServerDisconnectedError

        got = Streamed(time.perf_counter())
        async with self.client.post(f"{rep.url}/v1/completions",
                                    json=stream_body(h.body, h.tokens, self.model)) as resp:
            if resp.status != 200:
                return resp.status, await resp.text()
            h.stream = resp
            try:
                async for line in resp.content:
                    got.add(line)
                    if h.cancelled:
                        break
            except (ClientConnectionError, ClientPayloadError) as e:
                if not h.cancelled:  # the engine went away mid-answer: as lost as one that refuses connections
                    raise ServerDisconnectedError(f"its stream broke ({type(e).__name__})") from None
            except ValueError as e:  # a chunk that is not what was asked for
                return 502, error_body(f"engine {rep.index} at {rep.url}: {e}", "engine_error")
            finally:
                h.stream = None
        if not got.done and not h.cancelled:
            raise ServerDisconnectedError("its stream ended before [DONE]")
        return 200, got.answer(str(h.body.get("model", self.model)), h.r.prompt_tokens, h.cancelled)

    def _fail(self, h: Held, status: int, answer: dict) -> None:
        target = h.group.future if h.group is not None else h.future
        if h.group is not None:
            self._stop_branches(h.group)
        if target is not None and not target.done():
            target.set_result((status, answer))

    def _write(self, record: RequestRecord) -> None:
        """The record of an answered request, appended to the records file; a file that fails is reported once
        (an event, ``/health``'s ``records``) and dropped: the answers go on."""
        if self.records is None:
            return
        try:
            self.records.write(json.dumps(record.to_json()) + "\n")
            self.records.flush()
        except (OSError, ValueError) as e:  # full disk, a closed file, ...
            self.records, self.records_error = None, f"{type(e).__name__}: {e}".replace("\n", " ")
            self.event("records-lost", why=self.records_error)

    def _give_up(self, future: asyncio.Future) -> None:
        """A request past its timeout: drop what of it is still held."""
        for rep in self.replicas:
            for h in [x for x in rep.running.values() if x.future is future or
                      (x.group is not None and x.group.future is future)]:
                asyncio.ensure_future(self._cancel(rep, h))

    # ---- branches -----------------------------------------------------------------------------------------------
    def _branch_answered(self, h: Held, answer: dict) -> None:
        g = h.group
        assert g is not None
        tokens = answer["choices"][0]["token_ids"]
        g.tokens += len(tokens)
        self.decode_tokens += len(tokens)
        g.alive.pop(h.branch, None)
        if h.cancelled or answer["choices"][0].get("finish_reason") == "abort" or g.complete:
            return
        g.answers.append((h.branch, answer))
        if len(g.answers) < g.r.needed:
            for b in to_prune(g.r, sorted(g.alive), len(g.answers), self.score, self.prune_below):
                self._drop(g.alive[b])
            return
        g.complete = True
        self._stop_branches(g)
        asyncio.ensure_future(self._finish_group(g, answer))

    async def _finish_group(self, g: BranchGroup, last: dict) -> None:
        """The request is done (its ``needed``-th branch answered ``last``): once the cancelled branches have
        answered with their tokens, its record and its answer, with every branch's tokens counted."""
        waits = [h.task for h in g.alive.values() if h.task is not None]
        if waits:
            await asyncio.wait(waits, timeout=self.request_timeout_s)
        firsts = [a["metrics"]["token_s"][0] for _, a in g.answers]
        rec = request_record(g.r.id, last["replica"], g.r.arrival_s + self.origin_s, last, self.origin_s)
        self._write(RequestRecord(rec.id, rec.replica, rec.arrival_s, min(firsts) - self.origin_s, rec.finish_s,
                                  rec.prompt_tokens, rec.output_tokens, rec.token_s, decode_tokens=g.tokens,
                                  branches=g.r.branches))
        choices = [{**a["choices"][0], "index": b} for b, a in g.answers]
        usage = {**last["usage"], "completion_tokens": sum(len(c["token_ids"]) for c in choices),
                 "decode_tokens": g.tokens}
        metrics = {**last["metrics"], "first_token_s": min(firsts)}
        if not g.future.done():
            g.future.set_result((200, {**last, "choices": choices, "usage": usage, "metrics": metrics}))

    def _stop_branches(self, g: BranchGroup) -> None:
        for h in list(g.alive.values()):
            self._drop(h)

    def _drop(self, h: Held) -> None:
        """Stop a branch: out of its queue at once, or cancelled on its engine (which answers with its tokens)."""
        if h.cancelled:
            return
        h.cancelled = True
        rep = h.replica
        assert rep is not None and h.group is not None
        if rep.queue.remove(h):
            rep.release(h)
            h.group.alive.pop(h.branch, None)
            return
        if h.engine_rid in rep.running:
            asyncio.ensure_future(self._cancel(rep, h))

    async def _cancel(self, rep: Replica, h: Held) -> None:
        from aiohttp import ClientError

        if rep.protocol == "openai":  # closing the stream aborts it on the engine; its reader answers what came
            if h.stream is not None:
                h.stream.close()
            return
        try:
            async with self.client.post(f"{rep.url}/cancel", json={"request_id": h.engine_rid}) as r:
                await r.read()
        except (ClientError, asyncio.TimeoutError):
            pass  # the engine is gone: its health watch re-routes or fails what it held

    # ---- failures -----------------------------------------------------------------------------------------------
    def _lost(self, rep: Replica, why: str) -> None:
        """``rep`` is lost: route around it, re-send what it held (see the module doc)."""
        if not rep.up:
            return
        rep.up = False
        rep.why = why
        held = list(rep.running.values())
        queued = []
        while len(rep.queue):
            queued.append(rep.queue.pop())
        rep.running.clear()
        self.event("engine-lost", engine=rep.index, why=why, sent=len(held), queued=len(queued))
        live = [r for r in self.replicas if r.up]
        if live:
            self.policy = self._policy(self.route if self.route != "weights" else "least-work", live)
            self.event("rerouted", engines=[r.index for r in live], route=self.policy.__class__.__name__)
        current = asyncio.current_task()
        for h in held:
            if h.task is not None and h.task is not current:
                h.task.cancel()
        for h in held + queued:
            self._resend(h, rep)

    def _resend(self, h: Held, rep: Replica) -> None:
        rep.release(h)
        if h.cancelled:  # a branch no longer wanted
            if h.group is not None:
                h.group.alive.pop(h.branch, None)
            return
        g = h.group
        dst = g.replica if g is not None and g.replica is not None and g.replica.up else self._choose(h.r)
        if dst is None:
            self.event("request-failed", id=h.r.id, branch=h.branch, why="every engine is down")
            self._fail(h, 503, error_body("every engine is down; restart the fleet", "unavailable"))
            return
        if g is not None:
            g.replica = dst
        h.resent = True
        self.event("resent", id=h.r.id, branch=h.branch, src=rep.index, dst=dst.index, attempt=h.attempts + 1)
        self._admit(dst, h, front=True)

    async def _watch(self) -> None:
        """Every ``health_interval_s``: each engine's health; lost after ``health_failures`` misses in a row (at
        once when nothing listens on its port any more)."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            up = [r for r in self.replicas if r.up]
            states = await asyncio.gather(*(self.engine_state(r) for r in up))
            for r, (ok, why, gone) in zip(up, states):
                if ok:
                    r.failures = 0
                    continue
                r.failures += 1
                if gone or r.failures >= self.health_failures:
                    self._lost(r, f"its health check failed {r.failures} time(s) in a row ({why})")

    async def engine_state(self, replica: Replica) -> tuple[bool, str, bool]:
        """(healthy, why not, its port refuses connections)."""
        from aiohttp import ClientConnectorError, ClientError, ClientTimeout

        try:
            async with self.client.get(f"{replica.url}/health",
                                        timeout=ClientTimeout(total=self.health_timeout_s)) as r:
                if r.status == 200:
                    return True, "", False
                try:
                    status = (await r.json(content_type=None)).get("status", r.status)
                except ValueError:
                    status = r.status
                return False, f"it reports {status}", False
        except ClientConnectorError as e:
            return False, f"nothing listens: {e.strerror or e}", True
        except asyncio.TimeoutError:
            return False, f"no answer within {self.health_timeout_s:g} s: hung?", False
        except ClientError as e:
            return False, str(e).replace("\n", " "), False

    async def engine_health(self, replica: Replica) -> bool:
        return (await self.engine_state(replica))[0]

    # ---- other routes -------------------------------------------------------------------------------------------
    async def _models(self, request):
        """The first live engine's model list (every engine of a fleet serves the same model)."""
        from aiohttp import ClientError, web

        rep = next((r for r in self.replicas if r.up), self.replicas[0])
        try:
            async with self.client.get(f"{rep.url}/v1/models") as r:
                text, status = await r.text(), r.status
            if status == 200 and self.card:
                body = json.loads(text)
                for m in body.get("data") or []:
                    for k, v in self.card.items():
                        m.setdefault(k, v)
                return web.json_response(body)
            return web.Response(text=text, status=status, content_type="application/json")
        except (ClientError, asyncio.TimeoutError) as e:
            return web.json_response(error_body(f"engine {rep.index} at {rep.url} did not answer ({e})",
                                                "unavailable"), status=502)

    async def _health(self, request):
        from aiohttp import web

        up = [r for r in self.replicas if r.up]
        states = await asyncio.gather(*(self.engine_state(r) for r in up))
        bad = {r.index for r, (ok, _, _) in zip(up, states) if not ok}
        down = sorted(bad | {r.index for r in self.replicas if not r.up})
        body = {"status": "ok" if not down else "degraded", "engines": len(self.replicas), "down": down,
                "why": {r.index: r.why for r in self.replicas if not r.up},
                "outstanding": [len(r.running) for r in self.replicas],
                "queued": [len(r.queue) for r in self.replicas], "sent": [r.sent for r in self.replicas],
                "answered": self.answered, "failed": self.failed}
        if self.records_error:  # answers go on; what was asked to be kept is not
            body["records"] = f"lost: {self.records_error}"
        return web.json_response(body, status=200 if not down else 503)

    async def _events(self, request):
        from aiohttp import web

        return web.json_response({"events": self.events})
