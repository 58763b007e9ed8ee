"""flexmesh's router in front of N engine processes: one OpenAI-compatible endpoint on 127.0.0.1 that
sends each completion to one engine and writes one record per request to ``requests.jsonl``.

Routes: ``POST /v1/completions`` (forwarded whole; the answer gains ``replica``), ``GET /v1/models``,
``GET /health`` (200 when every engine answers its own health check within :data:`HEALTH_TIMEOUT_S`,
else 503 naming the engines that did not). Policies (``route``): ``round-robin`` takes the engines in
turn; ``least-outstanding`` the one with the fewest requests the router has sent it and not yet had
answered (ties: the lowest index).

The record of a request (:class:`flexmesh.serve.metrics.RequestRecord`; times in seconds from
``origin_s``, a perf_counter time: the router's start unless the caller gives one)::

    {"id": 7, "replica": 1, "arrival_s": 3.02, "first_token_s": 3.19, "finish_s": 4.87,
     "prompt_tokens": 412, "output_tokens": 60, "token_s": [3.19, ...]}

``arrival_s`` is when the router received the request; ``id`` the client's ``X-Request-Id`` header
(an integer) or the router's own count. TTFT, TPOT and E2E follow from it as SERVING.md defines them.

Bounded: at most ``max_outstanding`` requests in flight (more are answered 503 at once), and every
forwarded request waits at most ``request_timeout_s`` (then 504).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass

from flexmesh.errors import ServeError
from flexmesh.serve.engine.http import MAX_BODY_BYTES, error_body
from flexmesh.serve.metrics import RequestRecord

HEALTH_TIMEOUT_S = 5.0
ROUTES = ("round-robin", "least-outstanding")


@dataclass
class Replica:
    """An engine the router sends requests to."""

    index: int
    url: str  # http://127.0.0.1:PORT
    outstanding: int = 0
    sent: int = 0


def pick(route: str, replicas: list[Replica], turn: int) -> Replica:
    """The replica ``route`` sends the next request to (``turn``: requests routed so far).

    >>> rs = [Replica(0, "a", outstanding=2), Replica(1, "b", outstanding=0), Replica(2, "c", outstanding=0)]
    >>> pick("round-robin", rs, 4).index, pick("least-outstanding", rs, 4).index
    (1, 1)
    """
    if route == "round-robin":
        return replicas[turn % len(replicas)]
    if route == "least-outstanding":
        return min(replicas, key=lambda r: (r.outstanding, r.index))
    raise ServeError(f"route {route!r} is not one of {', '.join(ROUTES)}")


def request_record(rid: int, replica: int, arrival_s: float, body: dict, origin_s: float) -> RequestRecord:
    """The per-request record of an engine's answer ``body`` (times rebased to ``origin_s``).

    >>> body = {"usage": {"prompt_tokens": 3}, "metrics": {"token_s": [10.5, 10.75, 11.0]}}
    >>> r = request_record(4, 1, 10.0, body, origin_s=10.0)
    >>> r.ttft_s, r.tpot_s, r.output_tokens
    (0.5, 0.25, 3)
    """
    token_s = tuple(t - origin_s for t in body["metrics"]["token_s"])
    return RequestRecord(id=rid, replica=replica, arrival_s=arrival_s - origin_s, first_token_s=token_s[0],
                         finish_s=token_s[-1], prompt_tokens=body["usage"]["prompt_tokens"],
                         output_tokens=len(token_s), token_s=token_s)


class Router:
    """The router's state: replicas, policy, the open records file."""

    def __init__(self, urls: list[str], route: str = "round-robin", records=None, origin_s: float | None = None,
                 max_outstanding: int = 4096, request_timeout_s: float = 600.0) -> None:
        if not urls:
            raise ServeError("the router needs at least one engine")
        if route not in ROUTES:
            raise ServeError(f"route {route!r} is not one of {', '.join(ROUTES)}")
        self.replicas = [Replica(i, u.rstrip("/")) for i, u in enumerate(urls)]
        self.route = route
        self.records = records  # a text file open for appending, or None
        self.origin_s = time.perf_counter() if origin_s is None else origin_s
        self.max_outstanding = max_outstanding
        self.request_timeout_s = request_timeout_s
        self._turn = 0
        self._ids = itertools.count()
        self.session = None

    @property
    def outstanding(self) -> int:
        return sum(r.outstanding for r in self.replicas)

    def app(self):
        """The aiohttp application (its client session opens on startup and closes on cleanup)."""
        from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

        async def start(app) -> None:
            self.session = ClientSession(timeout=ClientTimeout(total=self.request_timeout_s),
                                         connector=TCPConnector(limit=0))

        async def stop(app) -> None:
            if self.session is not None:
                await self.session.close()

        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.on_startup.append(start)
        app.on_cleanup.append(stop)
        return app

    async def _completions(self, request):
        from aiohttp import ClientError, web

        arrival = time.perf_counter()
        header = request.headers.get("X-Request-Id")
        try:
            rid = int(header) if header is not None else next(self._ids)
        except ValueError:
            return web.json_response(error_body(f"X-Request-Id must be an integer, got {header!r}"), status=400)
        if self.outstanding >= self.max_outstanding:
            return web.json_response(error_body(f"the router holds {self.max_outstanding} requests already; "
                                                "retry later", "overloaded"), status=503)
        payload = await request.read()
        replica = pick(self.route, self.replicas, self._turn)
        self._turn += 1
        replica.outstanding += 1
        replica.sent += 1
        try:
            async with self.session.post(f"{replica.url}/v1/completions", data=payload,
                                         headers={"Content-Type": "application/json"}) as resp:
                status, text = resp.status, await resp.text()
        except asyncio.TimeoutError:
            return web.json_response(error_body(f"engine {replica.index} gave no answer within "
                                                f"{self.request_timeout_s:g} s", "timeout"), status=504)
        except ClientError as e:
            return web.json_response(error_body(f"engine {replica.index} at {replica.url} did not answer ({e})",
                                                "unavailable"), status=502)
        finally:
            replica.outstanding -= 1
        if status != 200:
            return web.Response(text=text, status=status, content_type="application/json")
        body = json.loads(text)
        body["replica"] = replica.index
        body["metrics"]["arrival_s"] = arrival
        if self.records is not None:
            record = request_record(rid, replica.index, arrival, body, self.origin_s)
            self.records.write(json.dumps(record.to_json()) + "\n")
            self.records.flush()
        return web.json_response(body)

    async def _models(self, request):
        """The first engine's model list (every engine of a fleet serves the same model)."""
        from aiohttp import ClientError, web

        url = self.replicas[0].url
        try:
            async with self.session.get(f"{url}/v1/models") as r:
                return web.Response(text=await r.text(), status=r.status, content_type="application/json")
        except (ClientError, asyncio.TimeoutError) as e:
            return web.json_response(error_body(f"engine 0 at {url} did not answer ({e})", "unavailable"), status=502)

    async def _health(self, request):
        from aiohttp import web

        states = await asyncio.gather(*(self.engine_health(r) for r in self.replicas))
        down = [r.index for r, ok in zip(self.replicas, states) if not ok]
        body = {"status": "ok" if not down else "degraded", "engines": len(self.replicas), "down": down,
                "outstanding": [r.outstanding for r in self.replicas], "sent": [r.sent for r in self.replicas]}
        return web.json_response(body, status=200 if not down else 503)

    async def engine_health(self, replica: Replica) -> bool:
        from aiohttp import ClientError, ClientTimeout

        try:
            async with self.session.get(f"{replica.url}/health", timeout=ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                return r.status == 200
        except (ClientError, asyncio.TimeoutError):
            return False
