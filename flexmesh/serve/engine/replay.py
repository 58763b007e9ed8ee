"""Replay requests against a router in open loop: each request is sent at its arrival time whether or
not earlier ones were answered, as users arrive (a closed loop would slow its arrivals down with the
server and hide the knee).

A request is anything with ``id``, ``arrival_s`` (seconds from the replay's start), ``prompt_tokens``
and ``output_tokens`` (flexmesh.data.requests.Request). Its prompt is ``prompt_tokens`` token ids
drawn from a generator seeded by the request's id (so every replay of a trace sends the same prompts)
and it asks for exactly ``output_tokens`` tokens.

The records (:class:`flexmesh.serve.metrics.RequestRecord`) have their times in seconds from the replay's start:
``arrival_s`` when the router received the request, ``first_token_s`` and ``finish_s`` from the
engine's per-token timestamps, all on one clock (perf_counter: CLOCK_MONOTONIC on Linux). How late
each request was sent against its schedule is kept (``send_lag_s`` in :class:`Replay`): a client that
falls behind its own schedule would measure a lower rate than asked for.

Bounded: every request waits at most ``request_timeout_s``, and the replay as a whole ends at most
``drain_timeout_s`` after its last arrival; requests not answered by then count as failed.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from flexmesh.errors import ServeError
from flexmesh.serve.engine.held import request_record
from flexmesh.serve.engine.http import KEEPALIVE_S
from flexmesh.serve.metrics import RequestRecord, write_records


@dataclass
class Replay:
    """What a replay measured."""

    records: list[RequestRecord]  # answered requests, by id
    failed: dict[int, str] = field(default_factory=dict)  # request id -> why
    send_lag_s: list[float] = field(default_factory=list)  # actual send time - scheduled, per request
    wall_s: float = 0.0  # first send to last answer
    origin_s: float = 0.0  # the perf_counter time the records' times count from

    def write(self, path) -> None:
        """``requests.jsonl``: one record per line, by id (written atomically)."""
        write_records(path, self.records)


def prompt_ids(request_id: int, length: int, vocab: int) -> list[int]:
    """The prompt sent for a request: ``length`` ids in [0, vocab), seeded by its id.

    >>> prompt_ids(3, 4, 100) == prompt_ids(3, 4, 100) != prompt_ids(4, 4, 100)
    True
    """
    rng = random.Random(request_id * 7919 + length)
    return [rng.randrange(vocab) for _ in range(length)]


async def replay(url: str, requests: list[Any], vocab: int, request_timeout_s: float = 600.0,
                 drain_timeout_s: float = 600.0, progress=None) -> Replay:
    """Send ``requests`` to the router at ``url`` at their arrival times (see the module doc)."""
    from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector

    if not requests:
        raise ServeError("no request to replay; widen the trace window")
    reqs = sorted(requests, key=lambda r: (r.arrival_s, r.id))
    bodies = {r.id: json.dumps(completion_body(r, vocab)) for r in reqs}
    out = Replay(records=[])
    got: dict[int, RequestRecord] = {}
    done = 0

    async with ClientSession(timeout=ClientTimeout(total=request_timeout_s),
                             connector=TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)) as session:
        origin = out.origin_s = time.perf_counter()

        async def one(r) -> None:
            nonlocal done
            delay = origin + r.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            out.send_lag_s.append(time.perf_counter() - origin - r.arrival_s)
            try:
                async with session.post(f"{url}/v1/completions", data=bodies[r.id],
                                        headers={"Content-Type": "application/json",
                                                 "X-Request-Id": str(r.id)}) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        out.failed[r.id] = f"HTTP {resp.status}: {_message(text)}"
                        return
                body = json.loads(text)
                rec = request_record(r.id, body["replica"], body["metrics"]["arrival_s"], body, origin)
                if getattr(r, "branches", 1) > 1:
                    rec = replace(rec, first_token_s=body["metrics"]["first_token_s"] - origin,
                                  decode_tokens=body["usage"].get("decode_tokens"), branches=r.branches)
                got[r.id] = rec
            except (ClientError, asyncio.TimeoutError) as e:
                out.failed[r.id] = f"{type(e).__name__}: {e}"
            finally:
                done += 1
                if progress is not None:
                    progress(done, len(reqs))

        tasks = [asyncio.ensure_future(one(r)) for r in reqs]
        limit = reqs[-1].arrival_s + drain_timeout_s
        _, pending = await asyncio.wait(tasks, timeout=limit)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending)
        out.wall_s = time.perf_counter() - origin
    for r in reqs:
        if r.id not in got and r.id not in out.failed:
            out.failed[r.id] = f"unanswered {drain_timeout_s:g} s after the last arrival"
    out.records = [got[i] for i in sorted(got)]
    return out


def completion_body(r: Any, vocab: int) -> dict:
    """What is sent for request ``r``: its prompt, its output length as ``max_tokens`` and, for test-time scaling,
    its branches (``n``, ``needed``, ``branch_tokens``)."""
    # ignore_eos (vLLM's and SGLang's field; flexmesh's engine never stops early): exactly the trace's output length
    body = {"prompt": prompt_ids(r.id, r.prompt_tokens, vocab), "max_tokens": r.output_tokens, "temperature": 0,
            "ignore_eos": True}
    if getattr(r, "branches", 1) > 1:
        body.update(n=r.branches, needed=r.needed, branch_tokens=list(r.branch_lengths()))
    return body


def _message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip().splitlines()[0][:200] if text.strip() else "(empty)"


@dataclass
class RateRun:
    """One replay at one rate: what the client measured and the iterations each engine ran meanwhile."""

    rate: float
    replay: Replay
    iterations: list[list[dict]]  # per engine: {"start_s", "end_s", "batch"} (perf_counter seconds)


async def model_card(url: str) -> dict:
    """The served model's card (``GET /v1/models``): its ``vocab_size`` and ``max_model_len``."""
    from aiohttp import ClientError, ClientSession, ClientTimeout

    try:
        async with ClientSession(timeout=ClientTimeout(total=30)) as s, s.get(f"{url}/v1/models") as r:
            body = await r.json(content_type=None)
    except (ClientError, asyncio.TimeoutError, ValueError) as e:
        raise ServeError(f"no flexmesh router answers at {url} ({e}); start one with `flexmesh serve run`") from None
    try:
        card = body["data"][0]
        int(card["vocab_size"]), int(card["max_model_len"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise ServeError(f"{url}/v1/models does not name a vocab_size and max_model_len; is it a flexmesh "
                         "router?") from None
    return card


async def replay_rates(url: str, workloads: list[tuple[float, Any]], engine_urls: Sequence[str] = (),
                       progress=None, **limits) -> list[RateRun]:
    """Replay each ``(rate, workload)`` in turn against the router at ``url``; the iterations of the engines at
    ``engine_urls`` (when the caller started them) are collected for each replay."""
    from aiohttp import ClientSession, ClientTimeout

    from flexmesh.serve.engine.processes import fetch_iterations, iteration_count

    vocab = int((await model_card(url))["vocab_size"])
    runs = []
    async with ClientSession(timeout=ClientTimeout(total=60)) as session:
        for rate, workload in workloads:
            before = [await iteration_count(session, u) for u in engine_urls]
            rep = await replay(url, list(workload.requests), vocab, progress=progress, **limits)
            its = [await fetch_iterations(session, u, since=b) for u, b in zip(engine_urls, before)]
            runs.append(RateRun(rate, rep, its))
    return runs
