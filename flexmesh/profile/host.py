"""The host an engine profile's engines run on: its CPU cores, which they share with the process of flexmesh's router
and the client that sends them requests, and what that process costs them.

The engines share the machine's cores (``host_cores``: those the profiling process may run on, :func:`host_cores`)
with flexmesh's router and the client that sends the requests, one Python process whose CPU time neither the fit nor
an engine's ``intake_s`` and ``answer_s`` hold. :mod:`flexmesh.profile.engine` measures that process's CPU time
(``time.process_time``) over each serving load's replay and over a replay of short requests through the same client,
its background (health checks, timed while idle) taken out, and :func:`host_costs_from` splits it into
``host_request_s`` per request and ``host_token_s`` per token carried (the prompt sent, the outputs answered; on this
2-core machine about 2 ms a request and 6 us a token). While as many engines iterate as the host has cores, that CPU
comes out of theirs: the request simulator charges it to the replica the request is on
(:class:`flexmesh.serve.engine.twin.SharedHost`). A GPU engine's iterations do not run on the host's cores: only an
engine profile's timing names them. 0 in a profile written before they were measured.

:func:`saturated_starts` tells which logged iterations started with every core taken (the iteration figure of
``python -m bench.serve_engine`` prices them as the simulator does: :func:`flexmesh.profile.iteration.price_runs`).
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence

import numpy as np

from flexmesh.profile.fit import least_squares


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


def host_costs_from(rows: Sequence[tuple[int, int, float]]) -> tuple[float, float]:
    """The profile's ``host_request_s`` and ``host_token_s`` (module doc) from ``(requests, tokens, CPU seconds)`` of
    the router's process over each of several replays (tokens: the prompts sent and the outputs answered; its
    background, health checks, taken out): the non-negative least-squares fit of each replay's seconds per request
    to ``host_request_s + host_token_s * tokens per request``. A replay of short requests beside ones of longer
    requests tells the two apart; where every replay has the same tokens per request the token cost is 0 and the
    request's cost holds them all.

    >>> rows = [(1, 1, 2.01e-3)] * 6 + [(60, 1000, 60 * 2e-3 + 1000 * 1e-5), (24, 300, 24 * 2e-3 + 300 * 1e-5)]
    >>> [round(x * 1e3, 4) for x in host_costs_from(rows)]
    [2.0, 0.01]
    >>> [round(x * 1e3, 4) for x in host_costs_from([(10, 50, 0.03)])]  # one kind of replay: per request only
    [3.0, 0.0]
    """
    rows = [r for r in rows if r[0] > 0]
    if not rows:
        return 0.0, 0.0
    per = np.array([r[1] / r[0] for r in rows])
    y = np.array([max(r[2], 0.0) / r[0] for r in rows])
    if np.ptp(per) <= 0:
        return float(np.mean(y)), 0.0
    c = least_squares(np.column_stack([np.ones_like(per), per]), y, relative=False, robust=False)
    return float(c[0]), float(c[1])


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
