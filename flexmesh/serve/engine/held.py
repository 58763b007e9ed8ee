"""What flexmesh's router (:mod:`flexmesh.serve.engine.router`) holds: each engine as the router sees it
(:class:`Replica`, the routers' ``Routable``: its queue, what it runs, its outstanding work and KV load), the
requests and branches it holds until an engine answers them, and the per-request record of an answer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from flexmesh.data.requests import Request
from flexmesh.serve.metrics import RequestRecord
from flexmesh.serve.queues import QueuePolicy, make_queue


@dataclass(eq=False)
class Held:
    """A request, or one branch of one, that the router holds until an engine has answered it."""

    r: Request  # what queues, routers and predictors read (arrival_s on the router's clock, from its origin)
    body: dict  # what the engine is sent (n 1)
    tokens: int  # the output tokens it asks for (its branch's)
    predicted: float  # its predicted output tokens (routers' estimate of its work and KV)
    branch: int = 0
    group: BranchGroup | None = None
    future: asyncio.Future | None = None  # (status, answer) for the client (one-branch requests)
    replica: Replica | None = None
    attempts: int = 0
    engine_rid: str = ""
    task: asyncio.Task | None = None
    stream: Any = None  # the open response of a streamed request (closing it stops it on the engine)
    cancelled: bool = False
    resent: bool = False  # moved off an engine that was lost
    serial: int = 0  # the router's key of its request (unique, whatever id the client sent)


@dataclass(eq=False)
class BranchGroup:
    """A test-time-scaling request's branches."""

    r: Request
    future: asyncio.Future
    alive: dict[int, Held] = field(default_factory=dict)
    answers: list[tuple[int, dict]] = field(default_factory=list)  # (branch, engine answer) of finished ones
    tokens: int = 0  # generated over every branch so far
    replica: Replica | None = None
    complete: bool = False  # its needed branches have answered


class Replica:
    """An engine as the router sees it (the routers' ``Routable``): what it holds, queued and sent."""

    def __init__(self, index: int, url: str, queue: QueuePolicy | None = None, max_running: int = 1 << 30,
                 kv_tokens: int = 1 << 30, s_prefill: float = 1.0, s_decode: float = 1.0,
                 protocol: str = "flexmesh"):
        self.index, self.url = index, url.rstrip("/")
        self.protocol = protocol  # flexmesh's engine, or an OpenAI-compatible one (flexmesh.serve.engine.openai)
        self.queue: QueuePolicy = queue if queue is not None else make_queue("fcfs")
        self.max_running, self.kv_tokens = max_running, kv_tokens
        self.s_prefill, self.s_decode = s_prefill, s_decode
        self.running: dict[str, Held] = {}  # by the request id the engine knows it by
        self.up = True
        self.why = ""
        self.failures = 0  # health checks failed in a row
        self.sent = 0
        self._prompt = 0  # prompt tokens of what it holds (queued and sent)
        self._out = 0.0  # predicted output tokens of the same

    @property
    def outstanding(self) -> int:
        return len(self.running) + len(self.queue)

    def outstanding_s(self) -> float:
        return self._prompt * self.s_prefill + self._out * self.s_decode

    def kv_load(self) -> float:
        return (self._prompt + self._out) / self.kv_tokens

    def hold(self, h: Held) -> None:
        self._prompt += h.r.prompt_tokens
        self._out += h.predicted

    def release(self, h: Held) -> None:
        self._prompt -= h.r.prompt_tokens
        self._out -= h.predicted


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
