"""An engine profile of a production engine (vLLM, SGLang) measured through its streamed completions
(``flexmesh profile engine --engine vllm``): the same six-term fit as flexmesh's own engine's profile
(:mod:`flexmesh.profile.iteration`), from what a client sees, since such an engine logs no iterations.

An engine streams each token as the iteration that made it ends, so the time between two tokens of a request is
one iteration, and a batch whose requests all decode together is known exactly. The sweep runs on every engine at
once (their contention is in the profile, as in :mod:`flexmesh.profile.engine`):

- **lone prompts**: one request of ``p`` prompt tokens on an idle engine. Its first token came after the request's
  way in (the client's HTTP hop, the engine's parsing and queue hand-off: ``admission_s``) and the iterations of
  its prefill: ``[(0, p)]`` where ``p`` fits the token budget ``B``, else chunks of ``B`` (``[(0, B)]``,
  ``[(B, B)]``, ... and the rest: vLLM's and SGLang's chunked prefill), so chunks deep in a long prompt, whose
  attention reads everything before them, are measured and not extrapolated. Each next token ``k`` came after one
  iteration of ``[(p + k - 1, 1)]``.
- **decode batches**: ``b`` requests of ``c`` prompt tokens sent at once. Once every one of them has its first
  token, each iteration computes one token of each: the gap between tokens ``k - 1`` and ``k`` (the median over
  the ``b`` requests) is one iteration of ``[(c + k - 1, 1)] * b``.
- **mixed**: ``b`` requests of :data:`MIXED_CONTEXT` prompt tokens decoding when a prompt of ``p <= B - b`` tokens
  arrives. The engine schedules the decodes first and the whole prompt beside them, so the decodes' token that
  comes with the prompt's first token ends one iteration of ``[(c_i, 1)] * b + [(0, p)]``: what a decode pays
  for sharing its iteration with a prefill, which is where a serving tail is made.

Each distinct sample's times give their median, and one non-negative least-squares fit (relative error,
:func:`flexmesh.profile.fit.least_squares`) takes the six terms and, on the first-token samples only, a seventh
column: ``admission_s``. A first-token sample is a sequence of iterations (a chunked prefill's), priced as the sum
of theirs: every term is linear. Tokens that arrive in one chunk share its time (an engine that falls behind sends
several at once); their gaps are zero and the medians ride over them.

The engines' iterations share the host's cores with flexmesh's router and the client, and, where an engine is not held
to cores of its own, with its API server (which streams every token; a pinned engine's runs on its cores, inside the
gaps measured): after the sweep, :func:`flexmesh.profile.host.host_rows` replays short requests, long answers and long
prompts through the router and measures the CPU time of these processes over each, their idle background taken out,
and :func:`flexmesh.profile.host.host_costs_from` splits it into ``host_request_s``, ``host_token_s`` and
``host_output_s`` on ``host_cores`` (the twin charges them to the engines while they fill every core, as for
flexmesh's own engine). What this cannot see, and the profile leaves at 0: the first iteration after idling (inside
the samples' times).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from flexmesh.errors import ProfileError
from flexmesh.profile.fit import least_squares
from flexmesh.profile.iteration import TERMS, EngineProfile, iteration_features

OUTPUT_TOKENS = 12  # tokens each sweep request generates: enough gaps to take a median of
REPEATS = 3  # each sample's median over them: one slow first meeting of a batch shape does not move it
MIXED_CONTEXT = 32  # prompt tokens of the requests decoding when a mixed scenario's prompt arrives
# A gap between two tokens below this fraction of the request's mean gap is no iteration: an engine (or its API
# server) that fell behind sent the two together, microseconds apart, in separate chunks (the mean, not the median:
# a request whose tokens mostly came in bursts has a median gap of microseconds). Left in, one such sample of 20 us
# drives a relative-error fit to zero everywhere; the fit also drops any iteration sample below this fraction of the
# sweep's median one.
DELIVERY_FLOOR = 0.25


def _typical_gap(r) -> float:  # noqa: ANN001 - a Streamed
    return (r.token_s[-1] - r.token_s[0]) / (len(r.token_s) - 1) if len(r.token_s) > 1 else 0.0


def chunks(prompt: int, budget: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The prefill iterations of a lone prompt under a token budget (chunked prefill: whole chunks of ``budget``,
    then the rest), each a batch of one ``(context, new tokens)``.

    >>> chunks(100, 256), chunks(600, 256)
    ((((0, 100),),), (((0, 256),), ((256, 256),), ((512, 88),)))
    """
    return tuple((((c, min(budget, prompt - c)),) for c in range(0, prompt, budget)))


def scenarios(budget: int, max_seqs: int, context: int, quick: bool) -> list[tuple[str, int, int]]:
    """The sweep: ``(kind, requests at once, prompt tokens)``: lone prompts (past the token budget: chunked, up to
    the context), decode batches, then decodes joined by a prompt (``mixed``: ``requests`` decoding, one prompt of
    ``prompt tokens``), within the engine's token budget, request cap and context.

    >>> plan = scenarios(256, 4, 2016, quick=True)
    >>> [s for s in plan if s[0] == "lone"], len(plan)
    ([('lone', 1, 16), ('lone', 1, 64), ('lone', 1, 128), ('lone', 1, 256), ('lone', 1, 1024)], 12)
    >>> [s for s in plan if s[0] == "mixed"]  # 4 decoding and one more would pass the cap of 4
    [('mixed', 2, 128)]
    """
    room = context - OUTPUT_TOKENS - 1
    prompts = [p for p in ((16, 64, 128, 256) if quick else (8, 16, 32, 64, 96, 128, 192, 256, 384, 512))
               if p <= min(budget, room)]
    long = sorted({min(room, k * budget) for k in ((4,) if quick else (2, 4, 8))} - {0}) if room > budget else []
    sizes = sorted({b for b in ((1, 2, 4, 8) if quick else (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)) if b <= max_seqs}
                   | {max_seqs})
    contexts = [c for c in ((32, 512) if quick else (32, 256, 1024)) if c <= room] or [min(32, room)]
    joined = [b for b in ((2, 4) if quick else (1, 2, 4, 8)) if b < max_seqs and MIXED_CONTEXT + OUTPUT_TOKENS <= room]
    mixed = [("mixed", b, p) for b in joined
             for p in sorted({min(room, budget - b, x) for x in ((budget // 2,) if quick else (budget // 4, budget))})
             if p > 0]
    return ([("lone", 1, p) for p in prompts + long]
            + [("batch", b, c) for b in sizes for c in contexts if b * c <= 64 * budget] + mixed)


async def _stream(session, url: str, body: dict, got=None):  # noqa: ANN001 - a Streamed to fill, or None
    from flexmesh.serve.engine.openai import Streamed, stream_body

    got = Streamed(time.perf_counter()) if got is None else got
    got.sent_s = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=stream_body(body, body["max_tokens"], None)) as r:
        if r.status != 200:
            raise ProfileError(f"the engine at {url} refused a sweep request (HTTP {r.status}): "
                               f"{(await r.text())[:200]}")
        async for line in r.content:
            got.add(line)
    if len(got.tokens) != body["max_tokens"]:
        raise ProfileError(f"the engine at {url} gave {len(got.tokens)} tokens for {body['max_tokens']} asked (is "
                           "ignore_eos honoured?)")
    return got


def samples_of(kind: str, prompt: int, runs: Sequence,
               budget: int) -> tuple[list[tuple[tuple, float]], list[tuple[tuple, float]]]:
    """(iteration samples ``(batch, seconds)``, first-token samples ``(iterations, seconds)``) of one scenario's
    streamed requests (see the module doc); ``budget``: the engine's token budget.

    >>> from types import SimpleNamespace as S
    >>> lone = S(sent_s=0.0, token_s=[0.5, 0.75, 1.0])
    >>> samples_of("lone", 8, [lone], 256)
    ([(((8, 1),), 0.25), (((9, 1),), 0.25)], [((((0, 8),),), 0.5)])
    >>> decoding = [S(sent_s=0.0, token_s=[0.125, 0.25, 0.375, 0.5, 0.625]) for _ in range(2)]
    >>> samples_of("mixed", 64, [*decoding, S(sent_s=0.3, token_s=[0.5, 0.625])], 256)
    ([(((34, 1), (34, 1), (0, 64)), 0.125)], [])
    >>> its, _ = samples_of("lone", 8, [S(sent_s=0.0, token_s=[0.5, 0.75, 1.0, 1.00002, 1.25])], 256)
    >>> [(b, round(g, 3)) for b, g in its]  # the two tokens sent together are no iteration
    [(((8, 1),), 0.25), (((9, 1),), 0.25), (((11, 1),), 0.25)]
    """
    its: list[tuple[tuple, float]] = []
    if kind == "lone":
        (r,) = runs
        first = [(chunks(prompt, budget), r.token_s[0] - r.sent_s)]
        floor = DELIVERY_FLOOR * _typical_gap(r)
        its = [(((prompt + k - 1, 1),), r.token_s[k] - r.token_s[k - 1]) for k in range(1, len(r.token_s))
               if r.token_s[k] - r.token_s[k - 1] > floor]
        return its, first
    if kind == "mixed":  # the decodes' token that came with the prompt's first ended their shared iteration
        *decoding, joined = runs
        t1 = joined.token_s[0]
        batch, gaps = [], []
        for r in decoding:
            k = min(range(1, len(r.token_s)), key=lambda j: abs(r.token_s[j] - t1))
            gap = r.token_s[k] - r.token_s[k - 1]
            if gap <= DELIVERY_FLOOR * _typical_gap(r) or abs(r.token_s[k] - t1) > max(2e-3, 0.25 * gap):
                return [], []  # the decodes had ended, or came in another chunk: no iteration to read
            batch.append((MIXED_CONTEXT + k - 1, 1))
            gaps.append(gap)
        return [((*sorted(batch), (0, prompt)), statistics.median(gaps))], []
    started = max(r.token_s[0] for r in runs)
    floor = DELIVERY_FLOOR * statistics.median(_typical_gap(r) for r in runs)
    for k in range(1, min(len(r.token_s) for r in runs)):
        if min(r.token_s[k - 1] for r in runs) >= started:  # every request decoding: one token each per iteration
            gap = statistics.median(r.token_s[k] - r.token_s[k - 1] for r in runs)
            if gap > floor:
                its.append((((prompt + k - 1, 1),) * len(runs), gap))
    return its, []


def cpu_s(pids: Sequence[int] = ()) -> float:
    """CPU seconds this process and the processes ``pids`` have had (Linux's ``/proc/PID/stat``; a process gone, or
    a platform without it, counts 0)."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


async def sweep(urls: Sequence[str], model: str | None, vocab: int, budget: int, max_seqs: int, context: int,
                quick: bool, progress: Callable[[int, int, str], None] | None = None):
    """Every engine at ``urls`` runs the sweep at once: (iteration samples, first-token samples), raw."""
    from aiohttp import ClientSession, ClientTimeout, TCPConnector

    from flexmesh.serve.engine.http import KEEPALIVE_S

    plan = scenarios(budget, max_seqs, context, quick) * REPEATS
    rng = random.Random(0)
    its: list = []
    firsts: list = []
    async with ClientSession(timeout=ClientTimeout(total=600),
                             connector=TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)) as s:
        for i, (kind, n, prompt) in enumerate(plan):
            if progress is not None:
                progress(i, len(plan), f"{kind} {n}x{prompt}")

            def body(tokens: int) -> dict:
                return {"prompt": [rng.randrange(vocab) for _ in range(tokens)], "max_tokens": OUTPUT_TOKENS,
                        "temperature": 0, "ignore_eos": True, **({"model": model} if model else {})}

            async def one(url: str):
                if kind != "mixed":
                    return await asyncio.gather(*(_stream(s, url, body(prompt)) for _ in range(n)))
                return await _mixed(s, url, [body(MIXED_CONTEXT) for _ in range(n)], body(prompt))

            for runs in await asyncio.gather(*(one(u) for u in urls)):
                a, b = samples_of(kind, prompt, runs, budget)
                its += a
                firsts += b
            await asyncio.sleep(0.05)  # the engines idle between scenarios, as a lone request finds them
        if progress is not None:
            progress(len(plan), len(plan), "fitted")
    return its, firsts


async def _mixed(session, url: str, decoding: Sequence[dict], joined: dict) -> list:  # noqa: ANN001
    """The streams of a mixed scenario: ``decoding`` sent at once, ``joined`` once each of them has two tokens (all
    decoding), the joined one last."""
    from flexmesh.serve.engine.openai import Streamed

    gots = [Streamed(time.perf_counter()) for _ in decoding]
    tasks = [asyncio.ensure_future(_stream(session, url, b, g)) for b, g in zip(decoding, gots)]
    while min(len(g.token_s) for g in gots) < 2 and not any(t.done() for t in tasks):
        await asyncio.sleep(1e-3)
    try:
        last = await _stream(session, url, joined)
    finally:
        runs = await asyncio.gather(*tasks)
    return [*runs, last]


def fit_streamed(its: Sequence[tuple[tuple, float]], firsts: Sequence[tuple[tuple, float]]):
    """(the six-term fit, admission_s, the median samples) of a sweep (see the module doc).

    >>> true = dict(zip(TERMS, (2e-3, 1e-4, 3e-5, 1e-7, 0.0, 1e-8)))
    >>> def s(b):
    ...     return sum(true[t] * f for t, f in zip(TERMS, iteration_features(b)))
    >>> its = [(((c, 1),) * b, s(((c, 1),) * b)) for b in (1, 2, 4, 8) for c in (40, 500)]
    >>> firsts = [(chunks(p, 256), sum(s(b) for b in chunks(p, 256)) + 0.004) for p in (16, 64, 128, 256, 1000)]
    >>> its.append((((40, 1),) * 3, 2e-5))  # two tokens sent together, 20 us apart: no iteration, dropped
    >>> fit, admission, _ = fit_streamed(its, firsts)
    >>> round(admission * 1e3, 2), round(fit["per_token_s"] / true["per_token_s"], 2)
    (4.0, 1.0)
    """
    grouped: dict[tuple[bool, tuple], list[float]] = defaultdict(list)
    for b, sec in its:
        grouped[(False, b)].append(sec)
    for b, sec in firsts:
        grouped[(True, b)].append(sec)
    rows = [(first, b, statistics.median(v)) for (first, b), v in grouped.items()]
    its_floor = DELIVERY_FLOOR * statistics.median([sec for first, _, sec in rows if not first] or [0.0])
    rows = [(first, b, sec) for first, b, sec in rows if sec > (0.0 if first else its_floor)]
    if len(rows) < len(TERMS) + 1 or not any(first for first, _, _ in rows):
        raise ProfileError(f"{len(rows)} distinct batches cannot fit {len(TERMS) + 1} terms; run the full sweep")
    a = np.array([(*(np.sum([iteration_features(i) for i in b], axis=0) if first else iteration_features(b)),
                   1.0 if first else 0.0) for first, b, _ in rows])
    c = least_squares(a, np.array([sec for _, _, sec in rows]))
    fit = {t: float(v) for t, v in zip(TERMS, c)}
    samples = [(list(b), sec) for first, b, sec in rows if not first]
    return fit, float(c[-1]), samples


def streamed_profile(its, firsts, engine: dict, model: dict, engines: int,
                     host: Sequence[tuple[int, int, int, float]] = ()) -> EngineProfile:
    """The engine profile of a sweep (see the module doc; ``host``: the host's rows,
    :func:`flexmesh.profile.host.host_rows`)."""
    from flexmesh.profile.host import host_cores, host_costs_from

    fit, admission, samples = fit_streamed(its, firsts)
    request_s, token_s, output_s = host_costs_from(host)
    return EngineProfile(model=model, engine=engine, fit=fit, samples=samples, admission_s=admission,
                         host_cores=host_cores() if host else 0, host_request_s=request_s, host_token_s=token_s,
                         host_output_s=output_s,
                         produced_by={"command": "flexmesh profile engine", "measured": "streamed tokens",
                                      "processes": engines,
                                      "sweep": {"iterations": len(its), "first_tokens": len(firsts),
                                                "admissions": len(firsts), "host_rows": len(host)}})


async def sweep_and_host(url: str, engines, cfgs, model: str | None, card: dict, base, quick: bool,  # noqa: ANN001
                         progress: Callable[[int, int, str], None] | None = None):
    """The sweep of the running production ``engines`` (started from ``cfgs``), then the host's replays through the
    router at ``url`` in front of them (module doc): (iteration samples, first-token samples, host rows)."""
    from flexmesh.profile.host import host_rows
    from flexmesh.serve.engine.external import sharing_pids

    its, firsts = await sweep([e.url for e in engines], model, card["vocab_size"], base.max_batch_tokens,
                              base.max_requests_per_batch, card["max_model_len"], quick, progress)
    pids = sharing_pids(engines, cfgs)
    host = await host_rows(url, card["vocab_size"], len(engines), min(card["max_model_len"], base.kv_tokens),
                           cpu=lambda: cpu_s(pids))
    return its, firsts, host


async def profile_external(cfgs, card: dict, model: str, base, quick: bool, log_dir,
                           progress: Callable[[int, int, str], None] | None = None) -> EngineProfile:
    """Start the production engines ``cfgs`` (:class:`~flexmesh.serve.engine.external.ExternalEngine`) behind
    flexmesh's router, sweep them all at once, replay the host's requests, stop them, and fit (see the module doc);
    ``base``: the EngineConfig of their knobs."""
    import json

    from flexmesh.profile.format import produced_by, spec_hash
    from flexmesh.serve.engine.external import fronting
    from flexmesh.serve.engine.processes import running_fleet
    from flexmesh.spec.model import parse_model

    async with running_fleet(list(cfgs), len(cfgs), Path(log_dir), **fronting(card, Path(model))) as (url, engines):
        its, firsts, host = await sweep_and_host(url, engines, cfgs, model, card, base, quick, progress)
    spec = parse_model(base.model).to_dict()
    prof = streamed_profile(its, firsts, {**json.loads(base.to_json()), "kind": cfgs[0].kind},
                            {**spec, "hash": spec_hash(spec)}, len(cfgs), host)
    prof.produced_by = {**produced_by(len(cfgs), device_type="cpu"), "measured": "streamed tokens",
                        "sweep": {**prof.produced_by["sweep"], "quick": quick}}
    return prof
