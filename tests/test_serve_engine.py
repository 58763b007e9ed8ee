"""Real engines: transformers' continuous batching gives the tokens transformers' own ``generate`` gives
(greedy, same seeded weights), in this process and through engine processes behind the router; engines
start and stop cleanly; a bad port or an engine that fails to start is one line. The router alone
(stand-in engines): tests/test_serve_router.py."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flexmesh.errors import ServeError
from flexmesh.serve.engine.config import EngineConfig
from flexmesh.serve.engine.replay import prompt_ids

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
CFG = EngineConfig(model="tiny", num_blocks=256, page_size=16, max_batch_tokens=64, max_requests_per_batch=8)
LENGTHS = [(5, 12), (90, 6), (33, 1), (140, 9)]  # (prompt, output): prompts over the 64-token budget are chunked


def reference(cfg, prompts, outputs):
    """transformers' own greedy ``generate`` on the same seeded model, one prompt at a time."""
    from flexmesh.serve.engine.model import build_model

    model = build_model(cfg)
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p, n in zip(prompts, outputs)]


def test_weights_are_seeded_per_name():
    from flexmesh.serve.engine.model import build_model

    a, b, c = build_model(CFG), build_model(CFG), build_model(EngineConfig(model="tiny", seed=1))
    for (name, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(p, q), name  # exact: weights seeded by name: the same operations
        if p.ndim >= 2:
            assert not torch.equal(p, r), name


@pytest.mark.timeout(300)
def test_engine_tokens_equal_generate_and_iterations_add_up():
    from flexmesh.serve.engine.engine import Engine

    prompts = [prompt_ids(i, n, 4096) for i, (n, _) in enumerate(LENGTHS)]
    outputs = [o for _, o in LENGTHS]
    with Engine(CFG) as engine:
        got = engine.run(prompts, outputs)
        its = list(engine.iterations)
    assert [f.tokens for f in got] == reference(CFG, prompts, outputs)
    for f, n in zip(got, outputs):
        assert len(f.token_s) == n and f.token_s == sorted(f.token_s) and f.queued_s <= f.started_s <= f.token_s[0]
    # every prompt token is computed once and every output token but the last is fed back once
    assert sum(q for it in its for _, q in it.batch) == sum(len(p) for p in prompts) + sum(n - 1 for n in outputs)
    assert all(sum(q for _, q in it.batch) <= CFG.max_batch_tokens and it.duration_s > 0 for it in its)
    assert max(len(it.batch) for it in its) > 1  # requests shared iterations
    # a prompt over the budget is prefilled in chunks, each after the one before
    chunks = [b for it in its for b in it.batch if b[1] > 1 and b[0] > 0]
    assert chunks and all(c < 140 for c, _ in chunks)


@pytest.mark.timeout(300)
def test_iterations_count_the_requests_taken_in_and_answered_while_they_ran():
    import threading

    from flexmesh.serve.engine.engine import Engine

    done = threading.Event()
    with Engine(CFG) as engine:
        # a long request runs alone, then a short one is taken in while it decodes, and answered before it ends
        engine.submit(prompt_ids(0, 8, 4096), 120, lambda f: done.set())
        while len(engine.iterations) < 3:
            threading.Event().wait(0.001)
        short = threading.Event()
        engine.submit(prompt_ids(1, 8, 4096), 2, lambda f: short.set())
        assert short.wait(60) and done.wait(120)
        its = list(engine.iterations)
    assert sum(it.taken for it in its) == 1  # the short one: the long one reached an idle loop
    assert sum(it.answered for it in its) == 1  # the short one: nothing iterated after the long one's answer
    took = next(k for k, it in enumerate(its) if it.taken)
    answered = next(k for k, it in enumerate(its) if it.answered)
    assert took >= 2 and took < answered < len(its) - 1
    assert its[took].to_dict()["taken"] == 1 and its[answered].to_dict()["answered"] == 1
    assert all(it.others_cpu_s >= 0 for it in its) and "others_cpu_s" in its[0].to_dict()


def test_engine_refuses_what_it_cannot_run():
    from flexmesh.serve.engine.engine import Engine
    from flexmesh.serve.engine.server import model_card

    with Engine(EngineConfig(model="tiny", num_blocks=128, page_size=16)) as engine:
        for prompt, n, match in (([], 3, "prompt is empty"), ([1, 4096], 3, "not a token id"),
                                 ([1] * 4000, 200, "exceed the model's 4096 positions"),
                                 ([1] * 2000, 100, "KV cache of 2048 tokens")):
            with pytest.raises(ServeError, match=match):
                engine.check(prompt, n)
        # what it runs with for speed, as transformers decided it, on its card: on a CPU no graphs, and why
        card = model_card(engine)
        assert card["speed"]["cuda_graphs"] == {"prefill": False, "decode": False}
        assert card["speed"]["attention"] == engine.model.config._attn_implementation
        assert card["speed"]["note"].startswith("cpu: no CUDA graphs or flash attention on a CPU")


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fleet_tokens_equal_generate_through_the_router_and_an_engine_killed_loses_no_request(tmp_path):
    """Two engine processes behind the router (one fleet for both parts: an engine process's start is most of
    their time). First four requests: the tokens one engine alone gives (greedy), spread round robin, recorded.
    Then one engine SIGKILLed while it runs requests and the router holds more for it: every request is
    answered, with those tokens, the requests it held re-sent to the other. Leaving, the survivor stops
    cleanly on SIGTERM."""
    pytest.importorskip("aiohttp")
    import aiohttp

    from flexmesh.serve.engine.processes import fetch_iterations, running_fleet
    from flexmesh.serve.metrics import read_records

    prompts = [prompt_ids(i, n, 4096) for i, (n, _) in enumerate(LENGTHS)]
    outputs = [o for _, o in LENGTHS]
    records = tmp_path / "requests.jsonl"
    KILL = 10  # the second part's request ids: KILL + i
    lengths = [(20 + 7 * i, 40) for i in range(8)]
    kill_prompts = [prompt_ids(i, n, 4096) for i, (n, _) in enumerate(lengths)]
    kill_outputs = [o for _, o in lengths]

    async def main():
        async with running_fleet(CFG, 2, tmp_path / "logs", records=records, max_running=2,
                                 health_interval_s=0.5, health_timeout_s=10.0) as (url, engines):
            router = url.router
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=200)) as s:
                async def one(rid, prompt, n):
                    async with s.post(f"{url}/v1/completions", headers={"X-Request-Id": str(rid)},
                                      json={"prompt": prompt, "max_tokens": n, "temperature": 0}) as r:
                        assert r.status == 200, await r.text()
                        return await r.json()

                answers = await asyncio.gather(*(one(i, prompts[i], outputs[i]) for i in range(len(prompts))))
                async with s.get(f"{url}/health") as r:
                    health = await r.json()
                its = [await fetch_iterations(s, e.url) for e in engines]

                sends = [asyncio.ensure_future(one(KILL + i, kill_prompts[i], kill_outputs[i]))
                         for i in range(len(kill_prompts))]
                while not (router.replicas[1].running and len(router.replicas[1].queue)):
                    await asyncio.sleep(0.005)
                engines[1].proc.send_signal(signal.SIGKILL)  # running 2, holding 2 more for it
                killed = router.clock()
                kill_answers = await asyncio.gather(*sends)
                async with s.get(f"{url}/health") as r:
                    kill_health = (r.status, await r.json())
            pids = [e.proc.pid for e in engines]
        return answers, health, its, pids, engines, kill_answers, kill_health, list(router.events), killed

    answers, health, its, pids, engines, kill_answers, (status, kill_health), events, killed = asyncio.run(main())
    # the four requests through the router
    assert [a["choices"][0]["token_ids"] for a in answers] == reference(CFG, prompts, outputs)
    assert health["sent"] == [2, 2] and health["down"] == []  # round robin spread them
    assert sorted(a["replica"] for a in answers) == [0, 0, 1, 1]
    assert all(a["usage"]["completion_tokens"] == n for a, n in zip(answers, outputs))
    recs = {r.id: r for r in read_records(records) if r.id < KILL}
    assert sorted(recs) == [0, 1, 2, 3]
    assert all(recs[i].output_tokens == outputs[i] and recs[i].prompt_tokens == len(prompts[i])
               and 0 <= recs[i].arrival_s <= recs[i].first_token_s <= recs[i].finish_s for i in recs)
    assert all(its[e] and all(len(it["batch"]) >= 1 for it in its[e]) for e in (0, 1))
    # the engine killed mid-replay
    assert [a["choices"][0]["token_ids"] for a in kill_answers] == reference(CFG, kill_prompts, kill_outputs)
    assert status == 503 and kill_health["down"] == [1] and kill_health["failed"] == 0
    lost = next(e for e in events if e["event"] == "engine-lost")
    assert lost["engine"] == 1 and lost["sent"] == 2 and lost["queued"] == 2 and lost["t"] >= killed
    assert any(e["event"] == "rerouted" and e["engines"] == [0] for e in events)
    resent = {e["id"] for e in events if e["event"] == "resent"}
    recovered = {e["id"]: e for e in events if e["event"] == "recovered"}
    assert len(resent) == 4 and set(recovered) == resent and all(i >= KILL for i in resent)
    assert all(kill_answers[i - KILL]["replica"] == 0 for i in resent)
    assert all(killed <= e["accepted_s"] <= e["t"] and e["engine"] == 0 for e in recovered.values())
    # leaving: the survivor stops on SIGTERM with a clean exit, and no engine process is left
    assert engines[0].proc.returncode == 0 and engines[1].proc.returncode == -signal.SIGKILL
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_engine_process_stops_on_sigint(tmp_path):
    """Ctrl-C on an engine started alone: a clean exit. (SIGTERM, how a fleet stops its engines: the fleet
    test above, the surviving engine's exit code 0; Ctrl-C on a fleet: the serve run test below.)"""
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-m", "flexmesh.serve.engine.server", "--config", CFG.to_json(),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=_env(), cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        assert line.startswith("flexmesh-serve-ready"), line
        port = json.loads(line.split(" ", 1)[1])["port"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
            assert json.loads(r.read())["status"] == "ok"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(120)
def test_a_port_in_use_is_one_line(tmp_path, monkeypatch):
    """`flexmesh serve run` and an engine process refuse a port in use before they start anything (engines, the
    model): both run in this process, as their command lines run them."""
    pytest.importorskip("aiohttp")
    import contextlib
    import io

    from helpers import flexmesh_here

    from flexmesh.serve.engine import server

    def engine_server(*argv: str) -> subprocess.CompletedProcess:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = server.main(list(argv))
        return subprocess.CompletedProcess(argv, code, "", err.getvalue())

    monkeypatch.chdir(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for r in (flexmesh_here("serve", "run", "--port", str(port), "--engines", "1"),
                  engine_server("--port", str(port))):
            assert r.returncode == 2, r.stderr
            lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
            assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "choose another port" in lines[0], lines


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_engine_that_fails_to_start_is_one_line(tmp_path):
    pytest.importorskip("aiohttp")
    from flexmesh.serve.engine.processes import start_engines

    bad = EngineConfig(model=str(tmp_path / "missing" / "config.json"))
    with pytest.raises(ServeError) as e:  # one engine: the line is the failing engine's, however many start
        asyncio.run(start_engines(bad, 1, tmp_path / "logs", start_timeout_s=150))
    msg = str(e.value)
    assert "\n" not in msg and "failed to start" in msg and "missing" in msg, msg


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_serve_run_then_bench_against_it_then_ctrl_c(tmp_path, monkeypatch):
    pytest.importorskip("aiohttp")
    from helpers import flexmesh_here

    from flexmesh.serve.metrics import read_records

    records = tmp_path / "served.jsonl"
    run = subprocess.Popen([sys.executable, "-m", "flexmesh", "serve", "run", "--engines", "2", "--port", "0",
                            "--kv-blocks", "256", "--requests", str(records), "--logs", str(tmp_path / "logs")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path)
    try:
        line = run.stdout.readline()
        assert line.startswith("serving tiny on http://127.0.0.1:"), line + run.stderr.read()
        url = line.split()[3].removesuffix("/v1/completions")
        # the client in this process: it starts nothing, it sends requests to the fleet `serve run` started
        monkeypatch.setenv("COLUMNS", "200")
        bench = flexmesh_here("serve", "bench", "--url", url, "--rate", "4,8", "--requests", "6", "--context", "256",
                              "--out", str(tmp_path / "bench"))
        assert bench.returncode == 0, bench.stdout + bench.stderr
        assert "TTFT p50" in bench.stdout and "wrote" in bench.stdout
        assert "replaying: 6 of 6 requests answered or failed" in bench.stderr  # each replay says how it went
        for rate in ("4", "8"):
            recs = read_records(tmp_path / "bench" / f"requests-{rate}.jsonl")
            assert len(recs) == 6 and all(r.prompt_tokens + r.output_tokens <= 256 for r in recs)
            assert {r.replica for r in recs} == {0, 1}
        summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
        assert [s["rate"] for s in summary] == [4.0, 8.0] and all(not s["failed"] for s in summary)
        run.send_signal(signal.SIGINT)  # Ctrl-C: the router and both engines stop
        assert run.wait(timeout=60) == 0, run.stderr.read()
    finally:
        if run.poll() is None:
            run.kill()
    served = read_records(records)
    assert len(served) == 12  # the router's own records: every request of both replays


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_engine_cancels_a_request_with_the_tokens_it_had():
    import threading
    import time

    from flexmesh.serve.engine.engine import Engine

    cfg = EngineConfig(num_blocks=256, page_size=16, max_batch_tokens=64, max_requests_per_batch=8)
    done, lock = {}, threading.Lock()

    def finished(f):
        with lock:
            done[f.request_id] = f

    with Engine(cfg) as engine:
        engine.submit([1, 2, 3, 4], 3000, finished, request_id="long.0.1")
        assert [len(f.tokens) for f in engine.run([[5, 6, 7]], [10])] == [10]  # served beside the long one
        assert engine.cancel("long.0.1") and not engine.cancel("nobody")
        deadline = time.time() + 120
        while "long.0.1" not in done and time.time() < deadline:
            time.sleep(0.01)
        with pytest.raises(ServeError, match="running already"):
            engine.submit([1], 2, finished, request_id="again")
            engine.submit([1], 2, finished, request_id="again")
    f = done["long.0.1"]
    assert f.cancelled and 10 <= len(f.tokens) < 3000
    assert f.tokens == reference(cfg, [[1, 2, 3, 4]], [len(f.tokens)])[0]  # the greedy tokens, cut short


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_engine_whose_kv_cache_cannot_be_built_fails_to_start_in_one_line():
    from flexmesh.serve.engine.engine import Engine

    with pytest.raises(ServeError, match="generation loop failed to start .MemoryError") as e:
        Engine(EngineConfig(num_blocks=10**11))
    assert "\n" not in str(e.value)
