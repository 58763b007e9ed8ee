"""The host an engine profile's engines run on: its CPU cores, which they share with the process of flexmesh's router
and the client that sends them requests, and what that process costs them.

The engines share the machine's cores (``host_cores``: those the profiling process may run on, :func:`host_cores`)
with flexmesh's router and the client that sends the requests, one Python process whose CPU time neither the fit nor
an engine's ``intake_s`` and ``answer_s`` hold. :mod:`flexmesh.profile.engine` measures that process's CPU time
(``time.process_time``) over each serving load's replay and over the replays :data:`HOST_REPLAYS` (short prompts with
one or 32 output tokens, long prompts with one) through the same client, its background (health checks, timed while
idle) taken out, and :func:`host_costs_from` splits it into ``host_request_s`` per request, ``host_token_s`` per
prompt token sent and ``host_output_s`` per output token streamed back (an output token is an event the router reads
and writes again and the client parses; a prompt token is a number in one request's body). A production engine's
profile measures the same replays through the router (:func:`host_rows`), with the CPU of the engines' processes that
share the router's cores. While as many engines iterate as the host has cores, that CPU comes out of theirs: the
request simulator charges it to the replica the request is on (:class:`flexmesh.serve.engine.twin.SharedHost`). A GPU
engine's iterations do not run on the host's cores: only an engine profile's timing names them. 0 in a profile written
before they were measured.

:func:`saturated_starts` tells which logged iterations started with every core taken (the iteration figure of
``python -m bench.serve_engine`` prices them as the simulator does: :func:`flexmesh.profile.iteration.price_runs`).
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from flexmesh.errors import ProfileError
from flexmesh.profile.fit import least_squares

# The host's own replays through the router (:func:`host_rows`), ``(prompt tokens, output tokens)`` of each: short
# requests, long answers, long prompts, so that a request's, an output token's and a prompt token's costs come apart
HOST_REPLAYS = ((8, 1), (8, 32), (512, 1))
HOST_REQUESTS, HOST_GAP_S = 8, 0.05  # requests per engine in each, sent this far apart
HOST_IDLE_S = 1.0  # the router idles this long first: its background CPU per second (health checks)
HOST_TIMEOUT_S = 300.0


def host_cores() -> int:
    """The CPU cores this process may run on (the engines, the router and the client share them): its affinity
    where the platform says, else the machine's count.

    >>> host_cores() >= 1
    True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def host_costs_from(rows: Sequence[tuple[int, int, int, float]]) -> tuple[float, float, float]:
    """The profile's ``host_request_s``, ``host_token_s`` and ``host_output_s`` (module doc) from ``(requests, prompt
    tokens, output tokens, CPU seconds)`` of the router's process over each of several replays (its background,
    health checks, taken out): the non-negative least-squares fit of each replay's seconds per request to
    ``host_request_s + host_token_s * prompt tokens + host_output_s * output tokens`` (per request). Replays that
    differ in prompt and in output tokens per request tell the three apart; a kind of token whose count per request
    never varies costs 0 and the request's cost holds it.

    >>> rows = [(6, 48, 6, 6 * 2e-3 + 48 * 1e-6 + 6 * 2e-4), (8, 64, 256, 8 * 2e-3 + 64 * 1e-6 + 256 * 2e-4),
    ...         (8, 4096, 8, 8 * 2e-3 + 4096 * 1e-6 + 8 * 2e-4)]
    >>> [round(x * 1e3, 4) for x in host_costs_from(rows)]
    [2.0, 0.001, 0.2]
    >>> [round(x * 1e3, 4) for x in host_costs_from([(10, 50, 10, 0.03)])]  # one kind of replay: per request only
    [3.0, 0.0, 0.0]
    """
    rows = [r for r in rows if r[0] > 0]
    if not rows:
        return 0.0, 0.0, 0.0
    per = np.array([(1.0, r[1] / r[0], r[2] / r[0]) for r in rows])
    y = np.array([max(r[3], 0.0) / r[0] for r in rows])
    varies = [0] + [j for j in (1, 2) if np.ptp(per[:, j]) > 0]
    c = least_squares(per[:, varies], y, relative=False, robust=False) if len(rows) >= len(varies) else \
        np.array([float(np.mean(y))] + [0.0] * (len(varies) - 1))
    out = [0.0, 0.0, 0.0]
    for j, v in zip(varies, c):
        out[j] = float(v)
    return out[0], out[1], out[2]


async def host_rows(url: str, vocab: int, engines: int, context: int, cpu: Callable[[], float] = time.process_time,
                    background: float | None = None) -> list[tuple[int, int, int, float]]:
    """Host rows (:func:`host_costs_from`) of the replays :data:`HOST_REPLAYS` through the router at ``url`` in front
    of ``engines`` engines of a ``context``-token model: ``cpu`` (this process's CPU seconds by default, the router's
    and the client's; more processes where they share the cores) over each, its ``background`` per second taken out
    (measured over :data:`HOST_IDLE_S` first when not given)."""
    from flexmesh.data.requests import Request
    from flexmesh.serve.engine.replay import replay

    if background is None:
        cpu0, wall0 = cpu(), time.perf_counter()
        await asyncio.sleep(HOST_IDLE_S)
        background = (cpu() - cpu0) / (time.perf_counter() - wall0)
    rows = []
    for prompt, outputs in HOST_REPLAYS:
        prompt = max(1, min(prompt, context - outputs - 1))
        cpu0, wall0 = cpu(), time.perf_counter()
        out = await replay(url, [Request(i, HOST_GAP_S * i, prompt, outputs) for i in range(HOST_REQUESTS * engines)],
                           vocab, request_timeout_s=HOST_TIMEOUT_S, drain_timeout_s=HOST_TIMEOUT_S)
        if out.failed:
            raise ProfileError(f"{len(out.failed)} of the host's replay requests failed, e.g. "
                               f"{next(iter(out.failed.values()))}")
        rows.append((*carried(out.records), cpu() - cpu0 - background * (time.perf_counter() - wall0)))
    return rows


def carried(records) -> tuple[int, int, int]:  # noqa: ANN001 - a replay's RequestRecords
    """``(requests, prompt tokens, output tokens)`` of a replay's records: a host row's first three."""
    return len(records), sum(r.prompt_tokens for r in records), sum(r.output_tokens for r in records)


def saturated_starts(runs: Sequence[Sequence[dict]], cores: int) -> list[bool]:
    """Per iteration (the lists one after another), whether at least ``cores`` engines (itself among them) were
    iterating when it started: the host's cores all taken (module doc).

    >>> a = [{"start_s": 0.0, "end_s": 1.0}, {"start_s": 2.0, "end_s": 3.0}]
    >>> saturated_starts([a, [{"start_s": 0.5, "end_s": 1.5}]], 2)
    [False, False, True]
    """
    spans = [sorted((it["start_s"], it["end_s"]) for it in its) for its in runs]
    starts = [[a for a, _ in s] for s in spans]
    out = []
    for e, its in enumerate(runs):
        for it in its:
            t = it["start_s"]
            busy = 1
            for f, (s, st) in enumerate(zip(spans, starts)):
                j = bisect.bisect_right(st, t) - 1
                busy += f != e and j >= 0 and s[j][1] > t
            out.append(busy >= cores)
    return out
