"""flexmesh's router over stand-in engines (aiohttp apps in this process; no model): it spreads requests,
writes one record per request in the shape serve.metrics reads, holds requests in its queue policy's order,
re-sends what a dead or hung engine held, stops branches once enough have finished, and refuses what it cannot
hold with one line. The engines themselves: tests/test_serve_engine.py."""

import asyncio
import json
import time

import pytest

from flexmesh.errors import ServeError
from flexmesh.serve.engine.http import parse_completion
from flexmesh.serve.engine.replay import replay
from flexmesh.serve.engine.router import RouterService
from flexmesh.serve.lengths import Oracle
from flexmesh.serve.metrics import RequestRecord, read_records

aiohttp = pytest.importorskip("aiohttp")  # the serve extra: pip install -e .[serve]
from aiohttp import web  # noqa: E402

pytestmark = pytest.mark.timeout(60)
STATE = web.AppKey("state", dict)


def fake_engine(index: int, delay_s: float = 0.0, status: int = 200, per_token_s: float = 0.0):
    """An app answering completions as an engine does: prompt_tokens and max_tokens tokens with times, one every
    ``per_token_s`` (so a long request takes long); ``POST /cancel`` stops a request, which answers with the
    tokens it had (finish_reason abort). ``app["state"]["hang"] = True`` makes it stop answering anything;
    ``app[STATE]["hold"] = True`` holds the completions it has taken (health still answers) until set False."""
    seen = []
    state = {"hang": False, "hold": False, "cancel": set(), "running": 0, "peak": 0}

    async def hang_if_asked():
        while state["hang"]:
            await asyncio.sleep(0.05)

    async def completions(request):
        await hang_if_asked()
        body = await request.json()
        seen.append(body)
        state["running"] += 1
        state["peak"] = max(state["peak"], state["running"])
        try:
            await asyncio.sleep(delay_s)
            while state["hold"]:
                await asyncio.sleep(0.01)
            if status != 200:
                return web.json_response({"error": {"message": "broken", "type": "engine_error"}}, status=status)
            n, made, start = body["max_tokens"], 0, time.perf_counter()
            while made < n and body.get("request_id") not in state["cancel"]:
                await asyncio.sleep(per_token_s)
                await hang_if_asked()
                made += 1
            now = time.perf_counter()
            return web.json_response({
                "choices": [{"token_ids": [index] * made, "finish_reason": "length" if made == n else "abort"}],
                "usage": {"prompt_tokens": len(body["prompt"])},
                "metrics": {"token_s": [start + (now - start) * (i + 1) / max(made, 1) for i in range(made)]}})
        finally:
            state["running"] -= 1

    async def cancel(request):
        state["cancel"].add((await request.json())["request_id"])
        return web.json_response({"cancelled": True})

    async def health(request):
        await hang_if_asked()
        return web.json_response({"status": "ok"})

    async def models(request):
        return web.json_response({"data": [{"id": "fake", "vocab_size": 50, "max_model_len": 64}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/cancel", cancel)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app[STATE] = state
    return app, seen


async def started(app):
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def with_router(engines, body, **router_kwargs):
    """Run ``body(router_url, router)`` against a router over ``engines`` ((app, seen) pairs), everything on
    127.0.0.1; the engines' runners are ``router.runners`` (to stop one)."""

    async def main():
        runners, urls = [], []
        for app, _ in engines:
            r, u = await started(app)
            runners.append(r)
            urls.append(u)
        router_kwargs.setdefault("health_interval_s", 0.1)
        router_kwargs.setdefault("health_timeout_s", 0.5)
        router = RouterService(urls, **router_kwargs)
        router.runners = runners
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


def test_router_spreads_requests_and_writes_records(tmp_path):
    (a, seen_a), (b, seen_b) = fake_engine(0), fake_engine(1)
    path = tmp_path / "requests.jsonl"

    async def body(url, router):
        with open(path, "a") as f:
            router.records = f
            got = await asyncio.gather(*(post(url, {"prompt": [1, 2, 3], "max_tokens": 4}, rid=10 + i)
                                         for i in range(6)))
        return got

    got = with_router([(a, seen_a), (b, seen_b)], body)
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


def test_least_work_avoids_a_busy_engine():
    slow, fast = fake_engine(0), fake_engine(1)
    slow[0][STATE]["hold"] = True  # engine 0 keeps the first request until the others are answered

    async def body(url, router):
        first = asyncio.ensure_future(post(url, {"prompt": [1], "max_tokens": 1}))
        for _ in range(400):  # until engine 0 holds the first request (bounded: 4 s)
            if router.replicas[0].outstanding:
                break
            await asyncio.sleep(0.01)
        try:  # a request routed to engine 0 now would wait there: bounded, and released either way
            rest = [await asyncio.wait_for(post(url, {"prompt": [1], "max_tokens": 1}), 30) for _ in range(3)]
        finally:
            slow[0][STATE]["hold"] = False
        return [await first, *rest]

    got = with_router([slow, fast], body, route="least-work")
    assert [b["replica"] for _, b in got] == [0, 1, 1, 1]


def test_engine_errors_are_passed_on_in_one_line():
    async def body(url, router):
        bad = await post(url, {"prompt": [1], "max_tokens": 2})
        wrong_id = await post(url, {"prompt": [1], "max_tokens": 2}, rid="x")
        branches_wrong = await post(url, {"prompt": [1], "max_tokens": 2, "n": 2, "needed": 3})
        return bad, wrong_id, branches_wrong

    bad, wrong_id, branches_wrong = with_router([fake_engine(1, status=500)], body)
    assert bad[0] == 500 and bad[1]["error"]["message"] == "broken"
    assert wrong_id[0] == 400 and "\n" not in wrong_id[1]["error"]["message"]
    assert branches_wrong[0] == 400 and "needed from 1 to n" in branches_wrong[1]["error"]["message"]
    with pytest.raises(ServeError, match="route 'random'"):
        RouterService(["http://127.0.0.1:9"], route="random")


def test_a_dead_engine_loses_no_request():
    engines = [fake_engine(i, per_token_s=0.01) for i in range(3)]

    async def body(url, router):
        sends = [asyncio.ensure_future(post(url, {"prompt": [1, 2], "max_tokens": 20}, rid=i)) for i in range(12)]
        for _ in range(200):  # until engine 1 holds requests
            if router.replicas[1].running:
                break
            await asyncio.sleep(0.01)
        await router.runners[1].cleanup()  # engine 1 dies with requests in flight
        got = await asyncio.gather(*sends)
        async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
            health = (r.status, await r.json())
        after = await post(url, {"prompt": [1], "max_tokens": 2}, rid=99)
        return got, health, after, list(router.events)

    got, health, after, events = with_router(engines, body)
    assert all(status == 200 for status, _ in got)
    assert all(len(b["choices"][0]["token_ids"]) == 20 for _, b in got)
    assert health[0] == 503 and health[1]["down"] == [1] and "1" in health[1]["why"]
    assert after[0] == 200 and after[1]["replica"] != 1
    kinds = [e["event"] for e in events]
    assert kinds[0] == "engine-lost" and events[0]["engine"] == 1 and "rerouted" in kinds
    assert all(e["src"] == 1 and e["dst"] != 1 for e in events if e["event"] == "resent")
    assert sum(e["event"] == "resent" for e in events) == events[0]["sent"] + events[0]["queued"] >= 1


def test_a_hung_engine_is_found_by_its_health_check():
    engines = [fake_engine(i, per_token_s=0.01) for i in range(2)]

    async def body(url, router):
        engines[0][0][STATE]["hang"] = True  # engine 0 stops answering, its port still open
        got = await asyncio.gather(*(post(url, {"prompt": [1], "max_tokens": 5}, rid=i) for i in range(4)))
        engines[0][0][STATE]["hang"] = False
        return got, list(router.events)

    got, events = with_router(engines, body)
    assert all(status == 200 and b["replica"] == 1 for status, b in got)
    lost = next(e for e in events if e["event"] == "engine-lost")
    assert lost["engine"] == 0 and "health check failed" in lost["why"] and "hung" in lost["why"]


def test_the_router_holds_requests_in_the_queue_policy_order():
    eng = fake_engine(0, per_token_s=0.01)

    async def body(url, router):
        first = asyncio.ensure_future(post(url, {"prompt": [1], "max_tokens": 10}, rid=0))
        while not router.replicas[0].running:
            await asyncio.sleep(0.005)
        rest = []
        for i, n in enumerate([40, 5, 20, 2], start=1):  # held while the first runs (one at a time)
            rest.append(asyncio.ensure_future(post(url, {"prompt": [1], "max_tokens": n}, rid=i)))
            await asyncio.sleep(0.01)
        return await asyncio.gather(first, *rest)

    got = with_router([eng], body, queue="sjf", predictor=Oracle(), max_running=1)
    assert all(s == 200 for s, _ in got) and eng[0][STATE]["peak"] == 1
    assert [b["max_tokens"] for b in eng[1]] == [10, 2, 5, 20, 40]


def test_branches_stop_once_enough_finish(tmp_path):
    eng = fake_engine(0, per_token_s=0.01)
    path = tmp_path / "requests.jsonl"
    lengths = [30, 4, 50, 8, 60, 45]

    async def body(url, router):
        with open(path, "a") as f:
            router.records = f
            got = await post(url, {"prompt": [1, 2], "max_tokens": 60, "n": 6, "needed": 2,
                                   "branch_tokens": lengths}, rid=5)
            for _ in range(300):
                if path.read_text():
                    break
                await asyncio.sleep(0.01)
        return got, router.decode_tokens

    (status, answer), spent = with_router([eng], body)
    assert status == 200 and sorted(c["index"] for c in answer["choices"]) == [1, 3]
    assert [len(c["token_ids"]) for c in sorted(answer["choices"], key=lambda c: c["index"])] == [4, 8]
    rec = read_records(path)[0]
    assert rec.branches == 6 and rec.output_tokens == 8 and rec.decode_tokens == spent
    # The four cancelled branches stopped soon after the 8th token, far short of their lengths.
    assert 4 + 8 + 4 * 8 <= spent < 4 + 8 + 4 * 20 < sum(lengths)
    assert sorted(b["max_tokens"] for b in eng[1]) == sorted(lengths)


def test_router_refuses_past_its_bound():
    (slow, _), = [fake_engine(0, delay_s=0.5)]

    async def body(url, router):
        return await asyncio.gather(*(post(url, {"prompt": [1], "max_tokens": 1}) for _ in range(4)))

    got = with_router([(slow, None)], body, max_outstanding=2, max_running=1)
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

    rep = with_router([(a, seen)], body)
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
    ({"prompt": [1], "max_tokens": 3, "n": 2, "branch_tokens": [1]}, "one length from 1 to max_tokens"),
    ({"prompt": [1], "max_tokens": 3, "n": 2, "branch_tokens": [1, 9]}, "one length from 1 to max_tokens"),
])
def test_malformed_completions_are_one_line(body, message):
    with pytest.raises(ServeError, match=message) as e:
        parse_completion(body, 4096, branches=True)
    assert "\n" not in str(e.value)


def test_two_requests_with_one_client_id_are_both_answered_and_recorded(tmp_path):
    eng = fake_engine(0, per_token_s=0.01)
    records = tmp_path / "records.jsonl"

    async def body(url, router):
        return await asyncio.gather(post(url, {"prompt": [1, 2], "max_tokens": 5}, rid=7),
                                    post(url, {"prompt": [3], "max_tokens": 3}, rid=7))

    with records.open("a") as f:
        (s1, a1), (s2, a2) = with_router([eng], body, records=f, request_timeout_s=10)
    assert (s1, s2) == (200, 200)
    assert (len(a1["choices"][0]["token_ids"]), len(a2["choices"][0]["token_ids"])) == (5, 3)
    assert sorted(r.id for r in read_records(records)) == [7, 7]  # the client's id kept in each record
    assert len({b["request_id"] for b in eng[1]}) == 2  # the engine saw two ids


@pytest.mark.parametrize("what, send, says", [
    ("a 300-digit id", {"rid": "9" * 300}, "1 to 18 digits"),
    ("a negative id", {"rid": "-3"}, "1 to 18 digits"),
    ("deep nesting", {"raw": "[" * 100_000 + "]" * 100_000}, "not JSON"),
    ("a prompt past the context", {"body": {"prompt": [1] * 64, "max_tokens": 1}}, "no room in the model's context"),
])
def test_malformed_requests_are_a_400_in_one_line(what, send, says):
    async def body(url, router):
        headers = {"X-Request-Id": send["rid"]} if "rid" in send else {}
        data = send.get("raw") or json.dumps(send.get("body", {"prompt": [1], "max_tokens": 1}))
        async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions", data=data,
                                                        headers=headers) as r:
            return r.status, await r.json(content_type=None)

    status, answer = with_router([fake_engine(0)], body, context=64)
    assert status == 400 and says in answer["error"]["message"], (what, answer)
    assert "\n" not in answer["error"]["message"]


def test_a_records_file_that_fails_loses_no_answer_and_says_so(tmp_path):
    class Failing:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

    async def body(url, router):
        first = await post(url, {"prompt": [1], "max_tokens": 2})
        second = await post(url, {"prompt": [1], "max_tokens": 2})
        async with aiohttp.ClientSession() as s, s.get(f"{url}/health") as r:
            return first, second, await r.json()

    (s1, _), (s2, _), health = with_router([fake_engine(0)], body, records=Failing())
    assert (s1, s2) == (200, 200)
    assert health["records"].startswith("lost: OSError") and "No space left" in health["records"]
