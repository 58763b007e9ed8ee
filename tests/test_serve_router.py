"""flexmesh's router over stand-in engines (aiohttp apps in this process; no model): it spreads requests,
writes one record per request in the shape serve.metrics reads, says which engine is down, and refuses
what it cannot hold with one line. The engines themselves: tests/test_serve_engine.py."""

import asyncio
import json
import time

import pytest

from flexmesh.errors import ServeError
from flexmesh.serve.engine.http import parse_completion
from flexmesh.serve.engine.replay import replay
from flexmesh.serve.engine.router import Replica, Router, pick
from flexmesh.serve.metrics import RequestRecord, read_records

aiohttp = pytest.importorskip("aiohttp")  # the serve extra: pip install -e .[serve]
from aiohttp import web  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def fake_engine(index: int, delay_s: float = 0.0, status: int = 200):
    """An app answering completions as an engine does: prompt_tokens and max_tokens tokens with times."""
    seen = []

    async def completions(request):
        body = await request.json()
        seen.append(body)
        await asyncio.sleep(delay_s)
        if status != 200:
            return web.json_response({"error": {"message": "broken", "type": "engine_error"}}, status=status)
        now = time.perf_counter()
        n = body["max_tokens"]
        return web.json_response({"choices": [{"token_ids": [index] * n}],
                                  "usage": {"prompt_tokens": len(body["prompt"])},
                                  "metrics": {"token_s": [now + 0.001 * i for i in range(n)]}})

    async def health(request):
        return web.json_response({"status": "ok"})

    async def models(request):
        return web.json_response({"data": [{"id": "fake", "vocab_size": 50, "max_model_len": 64}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app, seen


async def started(app):
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def with_router(engines, body, **router_kwargs):
    """Run ``body(router_url, router)`` against a router over ``engines`` (apps), everything on 127.0.0.1."""

    async def main():
        runners, urls = [], []
        for app in engines:
            r, u = await started(app)
            runners.append(r)
            urls.append(u)
        router = Router(urls, **router_kwargs)
        rr, url = await started(router.app())
        try:
            return await body(url, router)
        finally:
            for r in [rr, *runners]:
                await r.cleanup()

    return asyncio.run(main())


async def post(url, body, rid=None):
    headers = {"X-Request-Id": str(rid)} if rid is not None else {}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def test_policies_pick_in_turn_and_the_least_loaded():
    rs = [Replica(i, f"u{i}") for i in range(3)]
    assert [pick("round-robin", rs, t).index for t in range(5)] == [0, 1, 2, 0, 1]
    rs[0].outstanding, rs[1].outstanding, rs[2].outstanding = 3, 1, 1
    assert pick("least-outstanding", rs, 0).index == 1
    with pytest.raises(ServeError, match="route 'random'"):
        pick("random", rs, 0)


def test_router_spreads_requests_and_writes_records(tmp_path):
    (a, seen_a), (b, seen_b) = fake_engine(0), fake_engine(1)
    path = tmp_path / "requests.jsonl"

    async def body(url, router):
        with open(path, "a") as f:
            router.records = f
            got = await asyncio.gather(*(post(url, {"prompt": [1, 2, 3], "max_tokens": 4}, rid=10 + i)
                                         for i in range(6)))
        return got

    got = with_router([a, b], body)
    assert all(status == 200 for status, _ in got)
    assert sorted(b["replica"] for _, b in got) == [0, 0, 0, 1, 1, 1]
    assert len(seen_a) == len(seen_b) == 3
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(d["id"] for d in lines) == list(range(10, 16))
    assert set(lines[0]) == {"id", "replica", "arrival_s", "first_token_s", "finish_s", "prompt_tokens",
                             "output_tokens", "token_s"}
    recs = read_records(path)
    assert all(r.output_tokens == 4 and r.prompt_tokens == 3 and r.ttft_s >= 0 and r.tpot_s > 0 for r in recs)
    assert all(len(r.token_s) == 4 and r.first_token_s == r.token_s[0] for r in recs)


def test_least_outstanding_avoids_a_slow_engine():
    (slow, _), (fast, _) = fake_engine(0, delay_s=0.5), fake_engine(1)

    async def body(url, router):
        first = asyncio.ensure_future(post(url, {"prompt": [1], "max_tokens": 1}))
        for _ in range(400):  # until engine 0 holds the first request (bounded: 4 s)
            if router.replicas[0].outstanding:
                break
            await asyncio.sleep(0.01)
        rest = [await post(url, {"prompt": [1], "max_tokens": 1}) for _ in range(3)]
        return [await first, *rest]

    got = with_router([slow, fast], body, route="least-outstanding")
    assert [b["replica"] for _, b in got] == [0, 1, 1, 1]


def test_health_names_the_engine_that_is_down_and_errors_are_one_line():
    (a, _), (broken, _) = fake_engine(0), fake_engine(1, status=500)

    async def body(url, router):
        router.replicas.append(Replica(2, "http://127.0.0.1:9"))  # nothing listens on the discard port
        async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
            health = (r.status, await r.json())
        router._turn = 1
        bad = await post(url, {"prompt": [1], "max_tokens": 2})  # round robin: engine 1 (broken)
        gone = await post(url, {"prompt": [1], "max_tokens": 2})  # engine 2: nothing there
        wrong_id = await post(url, {"prompt": [1], "max_tokens": 2}, rid="x")
        return health, bad, gone, wrong_id

    health, bad, gone, wrong_id = with_router([a, broken], body)
    assert health[0] == 503 and health[1]["down"] == [2]
    assert bad[0] == 500 and bad[1]["error"]["message"] == "broken"
    assert gone[0] == 502 and "engine 2" in gone[1]["error"]["message"]
    assert wrong_id[0] == 400 and "\n" not in wrong_id[1]["error"]["message"]


def test_router_refuses_past_its_bound():
    (slow, _), = [fake_engine(0, delay_s=0.5)]

    async def body(url, router):
        return await asyncio.gather(*(post(url, {"prompt": [1], "max_tokens": 1}) for _ in range(4)))

    got = with_router([slow], body, max_outstanding=2)
    statuses = sorted(s for s, _ in got)
    assert statuses == [200, 200, 503, 503]
    assert "holds 2 requests" in next(b for s, b in got if s == 503)["error"]["message"]


def test_replay_sends_on_schedule_and_records_from_its_start():
    (a, seen), = [fake_engine(0)]

    class R:
        def __init__(self, i, t):
            self.id, self.arrival_s, self.prompt_tokens, self.output_tokens = i, t, 5 + i, 3

    async def body(url, router):
        return await replay(url, [R(i, 0.1 * i) for i in range(5)], vocab=50)

    rep = with_router([a], body)
    assert not rep.failed and [r.id for r in rep.records] == list(range(5))
    assert [len(b["prompt"]) for b in sorted(seen, key=lambda b: len(b["prompt"]))] == [5, 6, 7, 8, 9]
    assert all(0 <= b < 50 for body in seen for b in body["prompt"])
    for r in rep.records:  # never before their schedule, on the replay's clock (late only by the machine's load)
        assert r.arrival_s >= 0.1 * r.id - 1e-3 and r.first_token_s >= r.arrival_s
    assert min(rep.send_lag_s) >= -1e-3
    assert isinstance(rep.records[0], RequestRecord)


@pytest.mark.parametrize("body, message", [
    ({"prompt": "hi", "max_tokens": 3}, "no tokenizer"),
    ({"prompt": [], "max_tokens": 3}, "non-empty list"),
    ({"prompt": [1], "max_tokens": 0}, "max_tokens must be an integer from 1"),
    ({"prompt": [1], "max_tokens": 3, "temperature": 0.7}, "greedy"),
    ({"prompt": [1], "max_tokens": 3, "stream": True}, "streaming"),
    ([1, 2], "JSON object"),
])
def test_malformed_completions_are_one_line(body, message):
    with pytest.raises(ServeError, match=message) as e:
        parse_completion(body, 4096)
    assert "\n" not in str(e.value)
