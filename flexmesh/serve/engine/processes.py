"""Start N engine processes and the router in front of them; stop them all, each step bounded in time.

:func:`start_engines` launches ``python -m flexmesh.serve.engine.server`` N times (any free port each,
``OMP_NUM_THREADS`` set to the engine's threads, stderr to ``engine-K.log`` in the log folder) and
waits for each to print its ready line; an engine that exits first, or is not ready within the
start timeout, stops them all and raises one ServeError line with the last line of its log. Each
engine gets SIGTERM when the process that started it dies (Linux ``PR_SET_PDEATHSIG``), so none
outlives its fleet. :func:`stop_engines` sends SIGTERM, waits, then SIGKILL.

:func:`serve_fleet` is ``flexmesh serve run``: engines, then the router on 127.0.0.1:PORT, until
SIGINT or SIGTERM, then everything stops cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import os
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flexmesh
from flexmesh.errors import ServeError
from flexmesh.files import create_file, make_folder
from flexmesh.serve.engine.config import EngineConfig
from flexmesh.serve.engine.external import ExternalEngine
from flexmesh.serve.engine.http import HOST, READY, check_port

START_TIMEOUT_S = 180.0  # building a model and its KV cache, under load
EXTERNAL_START_TIMEOUT_S = 900.0  # a production engine compiles its model as it starts: minutes on a loaded CPU
STOP_TIMEOUT_S = 15.0
_PR_SET_PDEATHSIG = 1


@dataclass
class EngineProcess:
    index: int
    proc: asyncio.subprocess.Process
    log: Path
    port: int = 0
    external: bool = False  # a production engine (vLLM, SGLang) in its own process group

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def _die_with_parent(cores: Sequence[int] = ()) -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: engines are still stopped by stop_engines
        pass
    if cores and hasattr(os, "sched_setaffinity"):  # every process it starts inherits them
        os.sched_setaffinity(0, cores)


def _child_env(cfg: EngineConfig) -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(cfg.threads)
    root = str(Path(flexmesh.__file__).resolve().parent.parent)  # this flexmesh, not another install
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def _last_line(log: Path, first: bool = False) -> str:
    """The line of an engine's log that says why it stopped: its last error line, or (``first``: a production
    engine, whose wrappers re-raise what its workers said) the first exception line of its own."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    if first:
        raised = [ln for ln in lines if re.match(r"[A-Za-z_.]*(Error|Exception): ", ln)]
        if raised:
            return raised[0][:400]
    errors = [ln for ln in lines if ln.startswith(("error:", "Error", "ServeError")) or "Error:" in ln]
    return (errors or lines or [""])[-1].removeprefix("error: ")


async def start_engines(cfg: EngineConfig | Sequence[EngineConfig | ExternalEngine], n: int, log_dir: Path,
                        start_timeout_s: float = START_TIMEOUT_S) -> list[EngineProcess]:
    """N engine processes of ``cfg`` (or one of each config of a list: flexmesh's engine, or a production engine's
    :class:`~flexmesh.serve.engine.external.ExternalEngine`), each ready (see the module doc)."""
    cfgs: list[EngineConfig | ExternalEngine] = [cfg] * n if isinstance(cfg, EngineConfig) else list(cfg)
    if not cfgs:
        raise ServeError(f"engines must be at least 1, got {len(cfgs)}")
    make_folder(log_dir)
    engines: list[EngineProcess] = []
    try:
        for k, c in enumerate(cfgs):
            log = log_dir / f"engine-{k}.log"
            with create_file(log, log_dir, exclusive=False) as err:  # a later run's log replaces an earlier one
                if isinstance(c, ExternalEngine):  # its own session: its workers stop with it (stop_engines)
                    proc = await asyncio.create_subprocess_exec(
                        *c.argv, stdin=asyncio.subprocess.DEVNULL, stdout=err, stderr=asyncio.subprocess.STDOUT,
                        env={**os.environ, **c.env}, preexec_fn=functools.partial(_die_with_parent, c.cores),
                        start_new_session=True)
                    engines.append(EngineProcess(k, proc, log, c.port, external=True))
                    continue
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "flexmesh.serve.engine.server", "--config", c.to_json(), "--port", "0",
                    stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=err,
                    env=_child_env(c), preexec_fn=_die_with_parent)
            engines.append(EngineProcess(k, proc, log))
        await asyncio.gather(*(_wait_healthy(e, max(start_timeout_s, EXTERNAL_START_TIMEOUT_S)) if e.external
                               else _wait_ready(e, start_timeout_s) for e in engines))
    except BaseException:
        await stop_engines(engines)
        raise
    return engines


async def _wait_ready(e: EngineProcess, timeout_s: float) -> None:
    async def ready() -> None:
        assert e.proc.stdout is not None
        while True:
            line = await e.proc.stdout.readline()
            if not line:  # the process closed its stdout: it exited
                code = await e.proc.wait()
                why = _last_line(e.log) or f"exit code {code}"
                raise ServeError(f"engine {e.index} failed to start: {why} (log: {e.log})")
            text = line.decode(errors="replace").strip()
            if text.startswith(READY):
                e.port = int(json.loads(text[len(READY):])["port"])
                return

    try:
        await asyncio.wait_for(ready(), timeout_s)
    except asyncio.TimeoutError:
        raise ServeError(f"engine {e.index} was not ready within {timeout_s:.0f} s (log: {e.log}); "
                         "the machine may be overloaded") from None


async def _wait_healthy(e: EngineProcess, timeout_s: float) -> None:
    """A production engine is ready once its ``/health`` answers 200 (it prints no ready line of flexmesh's) and it
    has answered one warm-up completion."""
    from aiohttp import ClientError, ClientSession, ClientTimeout

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with ClientSession(timeout=ClientTimeout(total=5)) as s:
        while True:
            if e.proc.returncode is not None:
                why = _last_line(e.log, first=True) or f"exit code {e.proc.returncode}"
                raise ServeError(f"engine {e.index} failed to start: {why} (log: {e.log})")
            try:
                async with s.get(f"{e.url}/health") as r:
                    healthy = r.status == 200
            except (ClientError, asyncio.TimeoutError):
                healthy = False
            if healthy:  # one warm-up answer: a CPU build traces its model at its first request (seconds)
                body = {"prompt": list(range(1, 17)), "max_tokens": 2, "temperature": 0}
                try:
                    async with s.post(f"{e.url}/v1/completions", json=body,
                                      timeout=ClientTimeout(total=max(deadline - loop.time(), 5))) as r:
                        status, text = r.status, await r.text()
                except (ClientError, asyncio.TimeoutError) as failed:
                    status, text = 0, f"{type(failed).__name__}: {failed}"
                if status != 200:
                    raise ServeError(f"engine {e.index} did not answer a warm-up completion ({status or 'no answer'}: "
                                     f"{text[:200]}) (log: {e.log})")
                return
            if loop.time() > deadline:
                raise ServeError(f"engine {e.index} was not healthy within {timeout_s:.0f} s (log: {e.log}); "
                                 "the machine may be overloaded")
            await asyncio.sleep(0.5)


def signal_engine(e: EngineProcess, sig: int) -> None:
    """``sig`` to an engine: to its whole process group where it has its own (a production engine's workers)."""
    try:
        if e.external:
            os.killpg(e.proc.pid, sig)
        else:
            e.proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass


async def stop_engines(engines: list[EngineProcess], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every engine, wait up to ``timeout_s`` for all, SIGKILL what is left (a production engine's whole
    process group, its workers with it)."""
    live = [e for e in engines if e.proc.returncode is None]
    for e in live:
        signal_engine(e, signal.SIGTERM)
    if live:
        _, pending = await asyncio.wait([asyncio.ensure_future(e.proc.wait()) for e in live], timeout=timeout_s)
        for e in live:
            if e.proc.returncode is None:
                signal_engine(e, signal.SIGKILL)
        if pending:
            await asyncio.wait(pending, timeout=timeout_s)
    for e in engines:  # a production engine's workers may outlive its server process
        if e.external:
            signal_engine(e, signal.SIGKILL)


@contextlib.asynccontextmanager
async def running_fleet(cfg: EngineConfig | Sequence[EngineConfig | ExternalEngine | str], n: int, log_dir: Path,
                        records: Path | None = None,
                        route: str = "round-robin", port: int = 0, max_outstanding: int = 4096,
                        request_timeout_s: float = 600.0, events: Path | None = None, **router):
    """N engines (or one per config of a list; a list of URLs: engines already running) and the router on
    127.0.0.1:``port`` (0: any free port) for the body of an ``async with``: yields ``(router url, engines)``, the
    :class:`~flexmesh.serve.engine.router.RouterService` as the url's ``router`` attribute; everything stops on
    leaving it, whatever happened. ``router``: the RouterService's other options (queue, predictor, max_running,
    ...; each engine's ``max_running`` and ``kv_tokens`` default to its config's request cap and KV cache)."""
    items = [cfg] * n if isinstance(cfg, EngineConfig) else list(cfg)
    check_port(port, "the router")  # before minutes of starting engines
    urls = [c for c in items if isinstance(c, str)]
    if urls and len(urls) == len(items):  # URLs of engines already running: none to start
        async with router_on(urls, port, records, events, route=route, max_outstanding=max_outstanding,
                             request_timeout_s=request_timeout_s, **router) as url:
            yield url, []
        return
    cfgs = [c for c in items if not isinstance(c, str)]
    if len(cfgs) != len(items):
        raise ServeError("give engines to start or URLs of running ones, not both")
    engines = await start_engines(cfgs, len(cfgs), log_dir)
    try:
        router.setdefault("max_running", [c.max_running if isinstance(c, ExternalEngine) else
                                          c.max_requests_per_batch for c in cfgs])
        router.setdefault("kv_tokens", [c.kv_tokens for c in cfgs])
        router.setdefault("protocol", ["openai" if isinstance(c, ExternalEngine) else "flexmesh" for c in cfgs])
        async with router_on([e.url for e in engines], port, records, events, route=route,
                             max_outstanding=max_outstanding, request_timeout_s=request_timeout_s,
                             **router) as url:
            yield url, engines
    finally:
        await stop_engines(engines)


@contextlib.asynccontextmanager
async def router_on(urls: list[str], port: int = 0, records: Path | None = None, events: Path | None = None,
                    host: str = HOST, **router):
    """flexmesh's router over running engines at ``urls``, listening on 127.0.0.1:``port`` for the body of an
    ``async with``: yields its :class:`RouterUrl`. ``host``: the address it listens on (0.0.0.0: every interface, as
    a container must; the loopback by default). ``router``: the RouterService's options."""
    from aiohttp import web

    from flexmesh.files import append_file
    from flexmesh.serve.engine.router import RouterService

    out = append_file(records) if records is not None else None
    ev = append_file(events) if events is not None else None
    runner = None
    try:
        r = RouterService(urls, records=out, events=ev, **router)
        runner = web.AppRunner(r.app(), handle_signals=False, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port, reuse_address=True).start()
        except OSError as e:
            raise ServeError(f"the router cannot listen on {host}:{port} ({e.strerror or e}); choose another port "
                             "(0 picks a free one)") from None
        where = HOST if host in ("0.0.0.0", "::", "") else host  # reached from here through the loopback
        yield RouterUrl(f"http://{where}:{runner.addresses[0][1]}", r)
    finally:
        if runner is not None:
            await runner.cleanup()
        for f in (out, ev):
            if f is not None:
                f.close()


class RouterUrl(str):
    """The router's URL, with the running router beside it (for its events and state)."""

    router: Any

    def __new__(cls, url: str, router: Any) -> RouterUrl:
        s = super().__new__(cls, url)
        s.router = router
        return s


async def serve_fleet(cfg: EngineConfig | list[EngineConfig], n: int, port: int, log_dir: Path,
                      records: Path | None, route: str = "round-robin", on_ready=None, **limits) -> bool:
    """Engines + router on ``port`` until SIGINT or SIGTERM, or until every engine is lost (see the module doc).
    ``on_ready(url, engines)`` is awaited once the router listens. False when it stopped for want of engines."""
    async with running_fleet(cfg, n, log_dir, records, route, port, **limits) as (url, engines):
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        async def watch() -> None:
            while any(r.up for r in url.router.replicas):
                await asyncio.sleep(0.5)
            stop.set()

        watcher = asyncio.ensure_future(watch())
        try:
            if on_ready is not None:
                await on_ready(url, engines)
            await stop.wait()
        finally:
            watcher.cancel()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        return any(r.up for r in url.router.replicas)


async def fetch_iterations(session, engine_url: str, since: int = 0) -> list[dict]:
    """An engine's iterations from the ``since``-th on (``GET /iterations``, every page)."""
    out: list[dict] = []
    while True:
        async with session.get(f"{engine_url}/iterations", params={"since": str(since + len(out))}) as r:
            if r.status != 200:
                raise ServeError(f"engine at {engine_url} did not give its iterations (HTTP {r.status})")
            page = (await r.json())["iterations"]
        if not page:
            return out
        out.extend(page)


async def iteration_count(session, engine_url: str) -> int:
    """How many iterations an engine keeps (its next iteration's index while fewer than it can keep)."""
    async with session.get(f"{engine_url}/iterations", params={"since": str(2**62)}) as r:
        if r.status != 200:
            raise ServeError(f"engine at {engine_url} did not give its iterations (HTTP {r.status})")
        return int((await r.json())["total"])
