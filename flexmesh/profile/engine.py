"""``flexmesh profile engine``: measure a local engine's iterations into an engine profile.

The engines are the processes ``flexmesh serve run`` starts (:mod:`flexmesh.serve.engine.processes`, the same
:class:`~flexmesh.serve.engine.config.EngineConfig`), ``engines`` of them side by side, each sent every
scenario at once over its own HTTP endpoint (no router): so each is measured as it serves, with its HTTP
thread and its neighbours on the machine's cores and memory. Every time comes from an engine's own
iteration log (``GET /iterations``): an iteration is timed from scheduling to the tokens handed out, so the
engine's per-iteration overhead is in every sample. Scenarios, each run twice:

- prefill chunks: one request whose prompt is one chunk (8 tokens up to the token budget) or several
  (two and four budgets: chunks after a prefix);
- decode batches: ``b`` requests with prompts of ``c`` tokens, for ``b`` from 1 to the engine's request cap
  and ``c`` over a grid of contexts (``b * c`` at most 8192 tokens, and what the KV cache holds), with
  outputs long enough that all ``b`` decode together at the end; their prefill iterations (several
  prompts in one budget, then decodes beside the last prompts' chunks) are samples too;
- mixed batches: ``b`` short requests decoding while a long prompt is prefilled in the budget left;
- serving: the engines behind flexmesh's router, as ``flexmesh serve run`` serves, sent synthetic requests
  in open loop (:data:`SERVING`: prompt and output lengths drawn log-uniformly over the sweep's ranges,
  Poisson arrivals at a few loads, placed by the sweep's own fit so far and the share of a core the engines
  had in it, so that a busy machine is not sent more than its engines serve). The scenarios above time each batch
  alone; while serving, an engine's iterations run beside its HTTP thread taking requests in and answering
  finished ones, beside the router and the client, and its batches are those serving makes (contexts
  of every length, one new prompt beside a few decodes). On a quiet 2-core machine, iterations served so
  took a fifth more CPU time than a fit of the scenarios alone prices them at (most in batches of three
  requests or more and in a new prompt's first chunk), which the simulator would leave out without them.

Every iteration is a sample ``(batch, seconds)``; identical batches (over repeats, scenarios and engines)
keep their median, which the fit (:func:`flexmesh.profile.iteration.fit_iterations`) is made from. How well
the form carries between the two phases is kept beside it (``produced_by.sweep.held_out``:
:func:`flexmesh.profile.samples.held_out_errors`, fitted on one phase, priced against the other). With
``samples_out`` every iteration is also kept as it was measured, one JSON object a line (its batch, wall and CPU
seconds, its start and end, the engine, and the phase: ``sweep`` with its scenario, or ``serving`` with its load),
so that forms of the fit can be compared offline (:func:`flexmesh.profile.samples.read_iteration_samples`).

The first iteration after an engine idled costs more than the fit prices (its caches went cold): the profile's
``after_idle`` (:func:`flexmesh.profile.iteration.after_idle_from`), from the iterations in the order each
engine ran them. A busy engine's iteration during which it takes a request in or answers one takes more wall
time than its thread's CPU time (its HTTP thread holds the interpreter meanwhile): the profile's ``intake_s`` and
``answer_s`` (:func:`flexmesh.profile.iteration.request_costs_from`), from each iteration's own counts and the CPU
time the engine's other threads had over it. Both are measured from the serving phase's iterations where it holds
enough of them (requests arrive one at a time there, as served; a sweep's scenario sends a burst at once).
:func:`refit` derives everything the iterations give (the samples and fit, these, the held-out errors) from
``samples_out``'s lines, so a profile's constants can be redone by later code.

Admission (the profile's ``admission_s``): a request that reaches an idle engine, timed from the router receiving
it to the start of the engine's iteration that holds it (the router's HTTP hop, the engine's parsing and checks,
its queue hand-off, the loop waking): single requests sent one at a time through the router to idle engines,
and every serving-phase request that found its engine idle (:func:`idle_admissions`: there the router and the
client share the machine with the other engine at work, which makes the hop longer); the median of both. The
seconds are the CPU time of the engine's thread over the iteration (``time.thread_time``), not its wall
time: on a machine other work shares, an iteration's wall time also holds the time the engine waited for a
core, which depends on that work, not on the engine; the CPU time keeps what the engine did, stalls on
memory included. On cores of its own an engine's wall time is its CPU time (96% of it, measured while
serving on a quiet machine), which is what the simulator prices. Profile with as many engines as will
serve side by side (``engines``): they share the machine's caches and memory bandwidth, and one alone runs
faster than one of two.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypedDict

from flexmesh.errors import ProfileError
from flexmesh.files import write_atomic
from flexmesh.profile.format import produced_by, spec_hash
from flexmesh.profile.host import HOST_IDLE_S, carried, host_cores, host_costs_from, host_rows
from flexmesh.profile.iteration import (
    IDLE_GAP_S,
    EngineProfile,
    ProfiledIterationTiming,
    after_idle_from,
    fit_iterations,
    request_costs_from,
)
from flexmesh.profile.samples import IterationSample, held_out_errors
from flexmesh.serve.engine.config import EngineConfig
from flexmesh.serve.engine.replay import prompt_ids

SCENARIO_TIMEOUT_S = 600.0  # the longest one scenario may take on one engine
DECODE_TOKENS = 6  # decode iterations of a whole decode-scenario batch once every prompt is in
ADMISSIONS = 6  # single requests per engine timed from the router into the engine's batch


class Grid(TypedDict):
    """The scenarios a sweep runs: prompt lengths alone, decode batches x contexts, mixed batches."""

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill: tuple[int, ...]
    mixed: tuple[int, ...]
    repeats: int
    batch_kv: int


# A decode scenario's iterations grow as b x (b x c) (transformers' SDPA path: module doc of
# flexmesh.profile.iteration), so the grid keeps b x c within "batch_kv" tokens: minutes, not an hour.
FULL: Grid = {"batches": (1, 2, 4, 8, 16, 32, 64), "contexts": (16, 128, 512, 1024), "prefill": (8, 32, 64, 128),
              "mixed": (1, 4, 16), "repeats": 2, "batch_kv": 8192}
QUICK: Grid = {"batches": (1, 4, 16), "contexts": (16, 256), "prefill": (16, 64), "mixed": (4,), "repeats": 2,
               "batch_kv": 4096}


class Serving(TypedDict):
    """The serving phase: requests per load, the loads (arrival rate x a request's seconds alone, per engine:
    above 1 the queues grow), and the longest output drawn (tokens)."""

    requests: int
    loads: tuple[float, ...]
    max_output: int


SERVING: dict[bool, Serving] = {False: {"requests": 60, "loads": (0.4, 0.8, 1.2), "max_output": 128},
                                True: {"requests": 24, "loads": (0.8,), "max_output": 64}}


def scenarios(cfg: EngineConfig, quick: bool, max_position: int) -> list[tuple[str, list[int], list[int]]]:
    """(name, prompt lengths, output tokens) of every scenario the sweep runs for ``cfg``.

    >>> [s[0] for s in scenarios(EngineConfig(num_blocks=256, max_batch_tokens=64), True, 4096)][:4]
    ['prefill 16', 'prefill 64', 'prefill 128', 'prefill 256']
    """
    grid = QUICK if quick else FULL
    budget = cfg.max_batch_tokens
    room = int(cfg.kv_tokens * (1.0 - cfg.safety_margin))  # the FIFO scheduler admits no prefill beyond this
    out: list[tuple[str, list[int], list[int]]] = []
    for n in sorted({p for p in grid["prefill"] if p < budget} | {budget, 2 * budget, 4 * budget}):
        if n + 1 <= min(room, max_position):
            out.append((f"prefill {n}", [n], [1]))
    for b in grid["batches"]:
        for c in grid["contexts"]:
            # outputs outlast the prefill of the whole batch, so that all b requests decode together at the end
            n_out = -(-b * c // budget) + DECODE_TOKENS
            if (b <= cfg.max_requests_per_batch and b * (c + n_out) <= room and c + n_out <= max_position
                    and b * c <= grid["batch_kv"]):
                out.append((f"decode {b} x {c}", [c] * b, [n_out] * b))
    long = 2 * budget
    for b in grid["mixed"]:
        if b < cfg.max_requests_per_batch and b * 24 + long <= room and long < max_position:
            # short prompts finish prefill together first; they decode while the long prompt is chunked
            out.append((f"mixed {b} + {long}", [8] * b + [long], [16] * b + [1]))
    if not out:
        raise ProfileError(f"an engine of {cfg.num_blocks} blocks x {cfg.page_size} tokens holds no scenario of the "
                           "sweep; raise num_blocks")
    return out


def serving_lengths(cfg: EngineConfig, quick: bool, max_position: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, output) tokens of the serving phase's requests: log-uniform, prompts from 8 tokens to four token
    budgets and outputs from 1 to ``max_output``, each request within the model's positions and a quarter of the
    KV cache.

    >>> lengths = serving_lengths(EngineConfig(num_blocks=256, max_batch_tokens=64), True, 4096)
    >>> len(lengths), all(8 <= p <= 256 and 1 <= o <= 64 for p, o in lengths)
    (24, True)
    """
    import numpy as np

    plan = SERVING[quick]
    fit = min(max_position, cfg.kv_tokens // 4)
    top_p = max(8, min(4 * cfg.max_batch_tokens, fit - 1))
    top_o = max(1, min(plan["max_output"], fit - top_p))
    rng = np.random.default_rng(seed)
    prompts = np.exp(rng.uniform(np.log(8), np.log(top_p + 1), plan["requests"])).astype(int).clip(1, top_p)
    outputs = np.exp(rng.uniform(0.0, np.log(top_o + 1), plan["requests"])).astype(int).clip(1, top_o)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


def profile_engine(cfg: EngineConfig, quick: bool = False, engines: int = 2,
                   progress: Callable[[int, int, str], None] | None = None,
                   log_dir: Path | None = None, samples_out: Path | None = None) -> EngineProfile:
    """Run the sweep on ``engines`` engine processes of ``cfg`` at once and fit it (see the module doc); every
    iteration measured written to ``samples_out`` (JSON lines) when given."""
    from flexmesh.serve.engine.model import engine_spec

    spec = engine_spec(cfg)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="flexmesh-profile-engine-"))
    raw: list[dict] = []
    _, plan, _, served, admission, host = asyncio.run(_sweep(cfg, quick, engines, logs, progress, raw))
    if log_dir is None:  # the engines' logs are kept where a failure names them; a sweep that ran leaves none
        shutil.rmtree(logs, ignore_errors=True)
    if samples_out is not None:
        write_atomic(samples_out, "".join(json.dumps(r) + "\n" for r in raw))
    spec_dict = spec.to_dict()
    base = EngineProfile(model={**spec_dict, "hash": spec_hash(spec_dict)}, engine=_engine_dict(cfg), fit={},
                         produced_by=produced_by(engines, device_type="cpu"),
                         admission_s=statistics.median(admission), host_cores=host_cores())
    base.host_request_s, base.host_token_s, base.host_output_s = host_costs_from(host)
    base.produced_by["sweep"] = {"quick": quick, "repeats": (QUICK if quick else FULL)["repeats"], "scenarios": plan,
                                 "serving": served, "admissions": len(admission),
                                 "host": [{"requests": n, "prompt_tokens": t, "output_tokens": o, "cpu_s": round(c, 6)}
                                          for n, t, o, c in host]}
    return refit(base, raw)


def refit(prof: EngineProfile, raw: Sequence[dict]) -> EngineProfile:
    """``prof`` with everything an engine's iterations give measured again from ``raw`` (every iteration of a sweep,
    as ``--samples`` writes them: module doc) by this code: the samples (identical batches' median CPU seconds) and
    their fit, ``after_idle``, ``intake_s`` and ``answer_s``, and under ``produced_by.sweep`` the iterations, the
    share of a core the engines had (CPU over wall time) and the held-out errors; the rest (the model, the engine,
    ``admission_s``, the scenarios and serving rates) kept. A profile's constants can so be redone from its samples
    when the code that derives them changes.

    >>> its = [{"phase": "sweep", "engine": 0, "batch": [[c, 1]] * b, "start_s": 0.1 * k, "end_s": 0.1 * k + 0.004,
    ...         "wall_s": 0.004, "cpu_s": 1e-3 + 1e-4 * b + 1e-7 * b * b * c}
    ...        for k, (b, c) in enumerate((b, c) for b in (1, 2, 4, 8) for c in (16, 64, 256))]
    >>> p = refit(EngineProfile({}, {"max_batch_tokens": 256}, {}, produced_by={"sweep": {}}), its)
    >>> len(p.samples), round(p.fit["c0_s"] * 1e3, 2), round(p.produced_by["sweep"]["cpu_share"], 3)
    (12, 1.0, 0.403)
    """
    timed: dict[tuple, list[float]] = defaultdict(list)
    for r in raw:
        timed[tuple(sorted(tuple(b) for b in r["batch"]))].append(r["cpu_s"])
    samples = _medians(timed)
    engines = sorted({r["engine"] for r in raw})
    out = EngineProfile(model=prof.model, engine=prof.engine, fit=fit_iterations(samples), samples=samples,
                        produced_by={**prof.produced_by, "sweep": dict(prof.produced_by.get("sweep", {}))},
                        name=prof.name, admission_s=prof.admission_s, host_cores=prof.host_cores,
                        host_request_s=prof.host_request_s, host_token_s=prof.host_token_s,
                        host_output_s=prof.host_output_s)
    out.after_idle = after_idle_from([[r for r in raw if r["engine"] == k] for k in engines],
                                     ProfiledIterationTiming(out))
    out.intake_s, out.answer_s = request_costs_from(raw)
    wall = sum(r["end_s"] - r["start_s"] for r in raw)
    out.produced_by["sweep"].update(iterations=len(raw), cpu_share=sum(r["cpu_s"] for r in raw) / wall if wall > 0
                                    else 1.0, held_out=held_out_errors([IterationSample.from_dict(r) for r in raw]))
    return out


def _medians(timed: dict[tuple, list[float]]) -> list[tuple[list, float]]:
    return [(list(batch), statistics.median(secs)) for batch, secs in sorted(timed.items())]


async def _sweep(cfg: EngineConfig, quick: bool, engines: int, logs: Path, progress, raw: list[dict]):
    """Every scenario ``repeats`` times on every engine at once, then the serving phase and the admissions: the
    CPU seconds of each batch they ran, the scenarios, the share of a core the engines had while iterating (CPU
    time over wall time), the serving phase's loads and rates, and the admissions' seconds; every iteration as
    measured appended to ``raw`` (module doc)."""
    from aiohttp import ClientSession, ClientTimeout

    from flexmesh.serve.engine.processes import fetch_iterations, iteration_count, start_engines, stop_engines

    repeats = (QUICK if quick else FULL)["repeats"]
    timed: dict[tuple, list[float]] = defaultdict(list)
    wall = cpu = 0.0
    procs = await start_engines(cfg, engines, logs)
    try:
        async with ClientSession(timeout=ClientTimeout(total=SCENARIO_TIMEOUT_S)) as session:
            async with session.get(f"{procs[0].url}/v1/models") as r:
                card = (await r.json())["data"][0]
            vocab, max_position = int(card["vocab_size"]), int(card["max_model_len"])
            plan = scenarios(cfg, quick, max_position)

            async def run(url: str, prompts: list[list[int]], outputs: list[int]) -> None:
                async def one(prompt: list[int], n: int) -> None:
                    async with session.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": n}) as resp:
                        if resp.status != 200:
                            raise ProfileError(f"engine at {url} refused a sweep request: {(await resp.text())[:200]}")

                await asyncio.gather(*(one(p, n) for p, n in zip(prompts, outputs)))

            async def collect(before: list[int], phase: dict) -> None:
                nonlocal wall, cpu
                for k, (e, since) in enumerate(zip(procs, before)):
                    for it in await fetch_iterations(session, e.url, since):
                        raw.append({**phase, "engine": k, "batch": it["batch"], "wall_s": it["end_s"] - it["start_s"],
                                    "cpu_s": it["cpu_s"], "start_s": it["start_s"], "end_s": it["end_s"],
                                    "taken": it.get("taken", 0), "answered": it.get("answered", 0),
                                    "others_cpu_s": it.get("others_cpu_s", 0.0)})
                        timed[tuple(sorted(tuple(b) for b in it["batch"]))].append(it["cpu_s"])
                        wall += it["end_s"] - it["start_s"]
                        cpu += it["cpu_s"]

            warm = [prompt_ids(1, 32, vocab)] * 2
            await asyncio.gather(*(run(e.url, warm, [4, 4]) for e in procs))  # first calls allocate
            loads = SERVING[quick]["loads"]
            total = len(plan) * repeats + len(loads) + 1
            for rep in range(repeats):
                for k, (name, lengths, outputs) in enumerate(plan):
                    if progress is not None:
                        progress(rep * len(plan) + k, total, name)
                    prompts = [prompt_ids(1000 * rep + i, n, vocab) for i, n in enumerate(lengths)]
                    before = [await iteration_count(session, e.url) for e in procs]
                    await asyncio.gather(*(run(e.url, prompts, outputs) for e in procs))
                    await collect(before, {"phase": "sweep", "scenario": name})
            share = cpu / wall if wall > 0 else 1.0  # of a core, so far: the loads are of what the engines get
            served, admission, host = await _serve(cfg, quick, procs, session, vocab, max_position, timed, collect,
                                             lambda k, what: progress and progress(len(plan) * repeats + k, total,
                                                                                   what), min(share, 1.0), raw)
            if progress is not None:
                progress(total, total, "fit")
    finally:
        await stop_engines(procs)
    return dict(timed), [s[0] for s in plan], cpu / wall if wall > 0 else 1.0, served, admission, host


async def _serve(cfg: EngineConfig, quick: bool, procs, session, vocab: int, max_position: int,
                 timed: dict[tuple, list[float]], collect, progress, share: float,
                 raw: list[dict]) -> tuple[list[dict], list[float], list[tuple[int, int, int, float]]]:
    """The serving phase and the admissions (module doc), through flexmesh's router over the engines ``procs``,
    which had ``share`` of a core each in the sweep (the loads are of that): the serving phase's samples go into
    ``timed`` and ``raw`` (by ``collect(before, phase)``); returns each load's rate, the admissions' seconds
    (the single requests' and the serving requests' that found their engine idle) and the CPU time of this process
    (the router and the client) per replay: ``(requests, prompt and output tokens, seconds)``, each load's and a
    replay of short requests', its background taken out."""
    from flexmesh.data.requests import Request, Workload, with_arrivals
    from flexmesh.serve.engine.processes import fetch_iterations, iteration_count, router_on
    from flexmesh.serve.engine.replay import replay

    # a request's seconds alone by the sweep's fit: the rates that load each engine as asked
    timing = ProfiledIterationTiming(EngineProfile({}, {}, fit_iterations(_medians(timed))))
    lengths = serving_lengths(cfg, quick, max_position)
    budget = cfg.max_batch_tokens
    alone = statistics.mean(
        sum(timing.iteration_s([(c, min(budget, p - c))]) for c in range(0, p, budget))
        + timing.decode_run_s(1, p, o - 1) for p, o in lengths)
    base = Workload(tuple(Request(i, 0.0, p, o) for i, (p, o) in enumerate(lengths)), "profile-serving", 0,
                    "log-uniform lengths (flexmesh.profile.engine.serving_lengths)")
    served: list[dict] = []
    waits: list[float] = []  # serving requests that reached an idle engine: router -> its iteration (idle_admissions)
    urls = [e.url for e in procs]
    host: list[tuple[int, int, int, float]] = []  # the router's process: (requests, prompt tokens, output tokens,
    # CPU seconds) per replay
    async with router_on(urls, max_running=[cfg.max_requests_per_batch] * len(urls),
                         kv_tokens=[cfg.kv_tokens] * len(urls)) as url:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(HOST_IDLE_S)  # the router's background (health checks), taken out of what follows
        background = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        for k, load in enumerate(SERVING[quick]["loads"]):
            rate = load * len(urls) * share / alone
            progress(k, f"serving at load {load:g}")
            before = [await iteration_count(session, u) for u in urls]
            cpu0, wall0 = time.process_time(), time.perf_counter()
            out = await replay(url, list(with_arrivals(base, rate, seed=k).requests), vocab,
                               request_timeout_s=SCENARIO_TIMEOUT_S, drain_timeout_s=SCENARIO_TIMEOUT_S)
            cpu = time.process_time() - cpu0 - background * (time.perf_counter() - wall0)
            if out.failed:
                raise ProfileError(f"{len(out.failed)} serving requests failed, e.g. {next(iter(out.failed.values()))}")
            host.append((*carried(out.records), cpu))
            await collect(before, {"phase": "serving", "load": load})
            served.append({"load": load, "rate": round(rate, 3), "requests": len(out.records),
                           "host_cpu_s": round(cpu, 6)})
            logged = [[it for it in raw if it["phase"] == "serving" and it["load"] == load and it["engine"] == e]
                      for e in range(len(urls))]
            waits += idle_admissions(out.records, out.origin_s, logged, budget)
        progress(len(SERVING[quick]["loads"]), "admissions")
        admission: list[float] = []
        prompt = prompt_ids(7, 16, vocab)
        # short requests, long answers and long prompts replayed as the serving loads were (the same client): the
        # router's process's cost of a request apart from its tokens, and of each kind of token
        host += await host_rows(url, vocab, len(urls), min(max_position, cfg.kv_tokens), background=background)
        for i in range(ADMISSIONS * len(urls)):
            before = [await iteration_count(session, u) for u in urls]
            async with session.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                                    headers={"X-Request-Id": str(i)}) as resp:
                body = await resp.json()
                if resp.status != 200:
                    raise ProfileError(f"the router refused an admission request: {str(body)[:200]}")
            k = int(body["replica"])
            its = await fetch_iterations(session, urls[k], before[k])
            if its:  # the engine was idle: its first iteration since holds the request
                admission.append(max(its[0]["start_s"] - body["metrics"]["arrival_s"], 0.0))
    if not admission:
        raise ProfileError("no admission was timed: the engines logged no iteration for a request")
    return served, admission + waits, host


def idle_admissions(records, origin_s: float, iterations: list[list[dict]], budget: int) -> list[float]:
    """Seconds from the router receiving each request (``records``: ``replica``, ``arrival_s`` from ``origin_s``,
    ``prompt_tokens``) that reached an idle engine to the start of the iteration holding it, from each engine's
    iterations in the order it ran them (``start_s``, ``end_s``, ``batch``): the first iteration that starts after
    the arrival, if the engine's previous one had ended before the arrival, :data:`IDLE_GAP_S` or more before it
    started (the loop slept), and it computes the request's first chunk (``(0, min(prompt, budget))``).

    >>> its = [[{"start_s": 10.0012, "end_s": 10.011, "batch": [[0, 40]]},
    ...         {"start_s": 10.011, "end_s": 10.02, "batch": [[40, 1], [0, 8]]}]]
    >>> class Rec:
    ...     def __init__(self, arrival_s, prompt_tokens):
    ...         self.replica, self.arrival_s, self.prompt_tokens = 0, arrival_s, prompt_tokens
    >>> [round(s * 1e3, 2) for s in idle_admissions([Rec(0.0, 40), Rec(0.0105, 8)], 10.0, its, 256)]  # 2nd: busy
    [1.2]
    """
    import bisect

    out = []
    starts = [[it["start_s"] for it in per] for per in iterations]
    for rec in records:
        per = iterations[rec.replica]
        arrival = origin_s + rec.arrival_s
        j = bisect.bisect_left(starts[rec.replica], arrival)
        if j >= len(per):
            continue
        it, before = per[j], per[j - 1]["end_s"] if j else -math.inf
        if (before <= arrival and it["start_s"] - before >= IDLE_GAP_S
                and [0, min(rec.prompt_tokens, budget)] in [list(b) for b in it["batch"]]):
            out.append(it["start_s"] - arrival)
    return out


def _engine_dict(cfg: EngineConfig) -> dict:
    return json.loads(cfg.to_json())
