"""flexmesh's router in front of engines that speak OpenAI's streamed completions as vLLM does
(flexmesh.serve.engine.openai): stand-ins in this process, streaming vLLM's chunks. The router times each token as
it arrives, stops a branch by closing its stream (the engine sees the client go), re-sends what an engine held when
its stream breaks, and fills the model card from what it was told. vLLM itself: tests/test_vllm_router.py."""

import asyncio
import json
import statistics

import pytest

from flexmesh.profile.iteration import TERMS, iteration_features
from flexmesh.serve.engine.openai import Streamed, stream_body
from tests.test_serve_router import post, with_router

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def greedy(prompt: list[int], n: int) -> list[int]:
    """The stand-in's 'greedy tokens': a function of the prompt alone, as an engine's are."""
    return [(sum(prompt) * 31 + 7 * i) % 997 for i in range(n)]


def streaming_engine(per_token_s: float = 0.01, break_after: int | None = None):
    """An app streaming vLLM's chunks (one token each, ``data: [DONE]`` at the end); it records each request's
    body and whether its client went away before the end. ``break_after``: its connection drops after that many
    tokens of every request, and its health fails from then on (a process that died)."""
    state = {"bodies": [], "gone": 0, "dead": False}

    async def completions(request):
        body = await request.json()
        state["bodies"].append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        tokens = greedy(body["prompt"], body["max_tokens"])
        try:
            for i, t in enumerate(tokens):
                if break_after is not None and i == break_after:
                    state["dead"] = True
                    request.transport.close()
                    return resp
                await asyncio.sleep(per_token_s)
                chunk = {"object": "text_completion", "choices": [{"index": 0, "text": "", "token_ids": [t],
                         "finish_reason": "length" if i == len(tokens) - 1 else None}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            state["gone"] += 1
            raise
        return resp

    async def health(request):
        return web.json_response({}, status=503 if state["dead"] else 200)

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 64}]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    return app, state


def test_stream_body_asks_for_token_ids_and_drops_flexmesh_fields():
    b = stream_body({"prompt": [1], "max_tokens": 50, "request_id": "1.0.1", "ignore_eos": True}, 7, "m")
    assert b == {"prompt": [1], "max_tokens": 7, "stream": True, "return_token_ids": True, "temperature": 0,
                 "ignore_eos": True, "model": "m"}


def test_streamed_chunks_are_timed_per_token_and_text_without_ids_is_refused():
    s = Streamed(sent_s=1.0)
    s.add(b'data: {"choices": [{"token_ids": [5, 6], "finish_reason": null}]}', now=2.0)
    s.add(b": a comment line", now=2.5)
    s.add(b'data: {"choices": [{"token_ids": [7], "finish_reason": "length"}]}', now=3.0)
    s.add(b"data: [DONE]", now=3.5)
    assert (s.tokens, s.token_s, s.finish_reason, s.done) == ([5, 6, 7], [2.0, 2.0, 3.0], "length", True)
    a = s.answer("m", prompt_tokens=4, cancelled=False)
    assert a["usage"]["completion_tokens"] == 3 and a["metrics"]["token_s"] == [2.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="return_token_ids"):
        Streamed(0.0).add(b'data: {"choices": [{"text": "hi"}]}')


def test_router_streams_from_openai_engines_and_records_each_token(tmp_path):
    (a, sa), (b, sb) = streaming_engine(), streaming_engine()
    path = tmp_path / "requests.jsonl"

    async def body(url, router):
        with open(path, "a") as f:
            router.records = f
            got = await asyncio.gather(*(post(url, {"prompt": [i, 2, 3], "max_tokens": 5}, rid=i) for i in range(4)))
            async with aiohttp.ClientSession() as s, s.get(f"{url}/v1/models") as r:
                card = await r.json()
        return got, card

    (got, card) = with_router([(a, sa), (b, sb)], body, protocol="openai", model="m", card={"vocab_size": 50})
    assert [s for s, _ in got] == [200] * 4
    assert [x["choices"][0]["token_ids"] for _, x in got] == [greedy([i, 2, 3], 5) for i in range(4)]
    assert all(x["stream"] and x["return_token_ids"] and x["model"] == "m" for x in sa["bodies"] + sb["bodies"])
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["id"] for r in recs) == [0, 1, 2, 3]
    for r in recs:  # one time per token, in order, each after the request arrived
        assert len(r["token_s"]) == 5 and r["token_s"] == sorted(r["token_s"]) and r["token_s"][0] > r["arrival_s"]
    assert card["data"][0] == {"id": "m", "max_model_len": 64, "vocab_size": 50}  # the engine's, and what it lacks


def test_branches_on_an_openai_engine_are_stopped_by_closing_their_streams():
    app, state = streaming_engine(per_token_s=0.02)

    async def body(url, router):
        status, answer = await post(url, {"prompt": [1, 2], "max_tokens": 40, "n": 4, "needed": 2,
                                          "branch_tokens": [3, 4, 40, 40]})
        await asyncio.sleep(0.3)  # the engine's handlers see their clients gone
        return status, answer

    status, answer = with_router([(app, state)], body, protocol="openai", model="m")
    assert status == 200 and len(answer["choices"]) == 2
    assert state["gone"] == 2  # the two long branches were aborted, not run to their 40 tokens
    assert answer["usage"]["decode_tokens"] < 3 + 4 + 40 + 40


def test_a_stream_that_breaks_is_resent_to_another_engine():
    (a, sa), (b, sb) = streaming_engine(break_after=2), streaming_engine()

    async def body(url, router):
        got = await asyncio.gather(*(post(url, {"prompt": [i], "max_tokens": 6}, rid=i) for i in range(4)))
        return got, list(router.events)

    got, events = with_router([(a, sa), (b, sb)], body, protocol="openai", model="m")
    assert [s for s, _ in got] == [200] * 4
    assert [x["choices"][0]["token_ids"] for _, x in got] == [greedy([i], 6) for i in range(4)]
    assert all(x["replica"] == 1 for _, x in got)
    kinds = [e["event"] for e in events]
    assert kinds.count("engine-lost") == 1 and kinds.count("resent") == 2 and kinds.count("recovered") == 2


def test_an_unknown_engine_protocol_is_one_line():
    from flexmesh.errors import ServeError
    from flexmesh.serve.engine.router import RouterService

    with pytest.raises(ServeError, match="protocol 'grpc' is not one of flexmesh, openai"):
        RouterService(["http://127.0.0.1:1"], protocol="grpc")


def test_a_streamed_sweep_fits_what_the_engine_spends_per_iteration():
    """flexmesh.profile.streamed on a stand-in whose every token takes 20 ms whatever the batch: the fit puts it in
    the per-iteration terms, the fit prices what was measured, and the request's way in comes out small."""
    from flexmesh.profile.streamed import REPEATS, chunks, fit_streamed, sweep
    from tests.test_serve_router import started

    app, _ = streaming_engine(per_token_s=0.02)

    async def main():
        runner, url = await started(app)
        try:
            return await sweep([url], "m", 50, budget=256, max_seqs=4, context=2048, quick=True)
        finally:
            await runner.cleanup()

    its, firsts = asyncio.run(main())
    # lone prompts, the one past the budget in chunks of it
    assert [b for b, _ in firsts] == [chunks(p, 256) for p in [16, 64, 128, 256, 1024] * REPEATS]
    assert len(firsts[4][0]) == 4 and firsts[4][0][-1] == ((768, 256),)
    sizes = {len(b) for b, _ in its}  # lone decodes and batches of 2 and 4, then 2 joined by a prompt
    assert {1, 2, 4} <= sizes <= {1, 2, 3, 4}
    assert all(b[-1] == (0, 128) and all(q == 1 for _, q in b[:-1]) for b, _ in its if len(b) == 3)
    fit, admission, samples = fit_streamed(its, firsts)
    priced = [sum(fit[t] * f for t, f in zip(TERMS, iteration_features(b))) for b, _ in samples]
    assert statistics.median(abs(p / s - 1) for p, (_, s) in zip(priced, samples)) < 0.25
    # a sleep is never shorter than asked (a loaded machine makes it longer: no upper bound is asserted)
    assert fit["c0_s"] + fit["per_request_s"] >= 0.018 and 0 <= admission < 0.1


def test_the_hosts_replays_through_the_router_count_requests_prompt_and_output_tokens():
    """flexmesh.profile.host.host_rows in front of the stand-in: short requests, long answers and long prompts (cut
    to the model's context), each the router's and the client's CPU seconds; long answers cost this process more."""
    from flexmesh.profile.host import HOST_REPLAYS, HOST_REQUESTS, host_rows

    app, _ = streaming_engine(per_token_s=0.002)

    async def body(url, router):
        return await host_rows(url, 50, 1, context=64)

    rows = with_router([(app, {})], body, protocol="openai", model="m", card={"vocab_size": 50})
    prompts = [min(p, 64 - o - 1) for p, o in HOST_REPLAYS]
    assert [r[:3] for r in rows] == [(HOST_REQUESTS, HOST_REQUESTS * p, HOST_REQUESTS * o)
                                     for p, (_, o) in zip(prompts, HOST_REPLAYS)]
    assert rows[1][3] > rows[0][3] > 0  # 31 more tokens a request, each read and written again by the router
