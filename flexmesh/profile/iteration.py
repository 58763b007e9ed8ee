"""An engine profile (``flexmesh profile engine``) and the iteration timing it prices this machine by.

One engine iteration is a batch of ``(tokens already in the KV cache, tokens computed now)`` per request
(decode: ``(context, 1)``; a prefill chunk: ``(prefix, chunk)``). The profile holds the median measured
seconds of each batch the sweep ran (:mod:`flexmesh.profile.engine`; the engine thread's CPU time, which
that module says why) and a fit of them, linear in six terms of the batch, with non-negative coefficients
(:func:`flexmesh.profile.fit.least_squares`, relative error, robust to the outliers of a shared machine)::

    seconds = c0 + c_req * n + c_tok * T + c_kv * K + c_batch_attn * T * K + c_attn * sum(new * (cached + new))

    n = requests in the batch, T = sum of new tokens, K = sum of (cached + new) tokens

``c0`` is the per-iteration engine overhead (scheduling, building the batch's index tensors, handing
tokens out, the model's per-call fixed costs), ``c_req`` what each request adds (its bookkeeping, its
row of logits), ``c_tok`` the weights' GEMMs per new token, ``c_kv`` gathering the paged KV cache into
one tensor per layer (and SDPA's copy of it for every query head) per token. Attention has two terms:
transformers' paged SDPA path (the attention a CPU runs under continuous batching) attends every new
token of the batch to every key the batch read, under a block-diagonal mask (transformers
``continuous_batching.utils.build_attention_mask``), so its products grow as ``T x K`` -- a decode
batch of ``b`` requests at context ``c`` as ``b * (b * c)``, quadratic in the batch -- while a kernel
that skips the masked blocks (flash varlen) grows as each request's ``new x (cached + new)``. The fit
keeps whichever the measurements show.

:class:`ProfiledIterationTiming` is the ``IterationTiming`` of flexmesh.cost.inference from this fit.

Beside the fit, a profile holds ``admission_s``: what a request spends between flexmesh's router receiving it and
the engine's first iteration that holds it (the router's HTTP hop, the engine's parsing and checks, its queue
hand-off, the loop waking), measured on idle engines (:mod:`flexmesh.profile.engine`). The twin
(:mod:`flexmesh.serve.engine.twin`) delays every arrival by it; 0 in a profile written before it was measured.

And ``after_idle``: what the first iteration after the engine's loop idled costs beyond the fit, as a fraction
of the fit's price. An engine whose queue is empty sleeps; the iteration that wakes it runs on caches other
work has since used, and takes more CPU time for the same batch (on this 2-core machine about a fifth more for
the first, a few percent for the next few). :func:`after_idle_from` measures it from the iterations in the order
each engine ran them (the serving phase's alone where it has enough: there an engine wakes for one request, as
it does when it serves): the median of measured / fit over the iterations that started at least
:data:`IDLE_GAP_S` after the engine's previous one ended, over that median for the iterations that followed
another at once, minus 1 (a ratio of medians, so the fit's own bias cancels where both hold alike batches).
The request simulator prices every iteration that starts a replica's busy period so (the replica's
``after_idle`` and ``idle_gap_s``: :mod:`flexmesh.serve.replica`); 0 in a profile written before it was measured.

And ``intake_s`` and ``answer_s``: what a request costs a busy engine outside its loop's thread. The engine's HTTP
thread parses, checks and submits each request it takes in, and answers each finished one, beside the loop, holding
the interpreter meanwhile (pure Python: the loop's thread waits for it, and on a machine whose cores the engines
fill it has no core of its own either), so an iteration during which it does so ends that much later than the
loop's own CPU time (the fit's seconds) says. An engine logs, per iteration, the requests it took in and answered
while it ran and the CPU time its other threads had meanwhile; :func:`request_costs_from` fits that CPU time,
least squares over the serving phase's iterations (requests one at a time through the router, as served; a
sweep's bursts cost less a request), as a constant (what those threads do besides: health checks) plus
``intake_s`` per request taken in and ``answer_s`` per request answered. CPU time, like the fit's samples: other
work on the machine does not stretch it. On this 2-core machine about 0.6-0.7 ms each. The request
simulator charges each to the iteration its replica starts next (:mod:`flexmesh.serve.replica`); a request that
reaches an idle engine costs its ``admission_s`` instead. 0 in a profile written before they were measured.

And the host's cores, which the engines share with the router's and the client's process: ``host_cores``,
``host_request_s``, ``host_token_s`` (per prompt token) and ``host_output_s`` (per output token)
(:mod:`flexmesh.profile.host`). 0 in a profile written before they were measured; a profile written before output
tokens were told apart has one cost per token carried, which ``host_output_s`` takes too.

>>> true = dict(zip(TERMS, (1e-3, 1e-4, 2e-5, 1e-7, 1e-8, 2e-8)))
>>> def seconds(batch):
...     return sum(true[t] * f for t, f in zip(TERMS, iteration_features(batch)))
>>> batches = ([[(0, t)] for t in (16, 64, 256)] + [[(c, 1)] * b for b in (1, 8, 32) for c in (64, 512)]
...            + [[(0, 200), (300, 1)], [(256, 256)] * 2, [(256, 128)]])
>>> fit = fit_iterations([(b, seconds(b)) for b in batches])
>>> [round(fit[t] / true[t], 3) for t in TERMS]  # the terms come back
[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
>>> timing = ProfiledIterationTiming(EngineProfile(model={}, engine={}, fit=fit))
>>> round(timing.iteration_s([(0, 128)]) * 1e3, 3), round(timing.iteration_s([(100, 1)] * 4) * 1e3, 3)
(4.164, 1.545)
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flexmesh.cost.inference.timing import EngineLoop, IterationTiming
from flexmesh.errors import ProfileError
from flexmesh.files import read_json, write_atomic
from flexmesh.profile.fit import least_squares
from flexmesh.profile.host import saturated_starts

VERSION = 1
KIND = "engine"
REQUEST_GROUP = 20  # iterations that took in (or answered) requests before what one costs is measured, and
# serving iterations after idling before the serving phase alone measures after_idle
IDLE_GAP_S = 0.002  # an engine's loop that ran on at once starts its next iteration within 0.1 ms; after a gap
# this long it had slept on its empty queue (after_idle_from)
TERMS = ("c0_s", "per_request_s", "per_token_s", "per_kv_token_s", "per_batch_token_x_kv_token_s",
         "per_request_token_x_kv_token_s")


def iteration_features(batch: Sequence[tuple[int, int]]) -> tuple[float, ...]:
    """The six terms of a batch (see the module doc): 1, n, T, K, T * K, sum(new * (cached + new)).

    >>> iteration_features([(10, 1), (0, 5)])
    (1.0, 2.0, 6.0, 16.0, 96.0, 36.0)
    """
    n = float(len(batch))
    t = float(sum(q for _, q in batch))
    k = float(sum(c + q for c, q in batch))
    own = float(sum(q * (c + q) for c, q in batch))
    return (1.0, n, t, k, t * k, own)


def fit_iterations(samples: Sequence[tuple[Sequence[tuple[int, int]], float]]) -> dict[str, float]:
    """The five non-negative coefficients fitted to ``(batch, seconds)`` samples, by name (:data:`TERMS`)."""
    if len(samples) < len(TERMS):
        raise ProfileError(f"{len(samples)} measured batches cannot fit {len(TERMS)} terms; run a wider sweep")
    a = np.array([iteration_features(b) for b, _ in samples])
    y = np.array([s for _, s in samples], dtype=float)
    c = least_squares(a, y)
    return {name: float(v) for name, v in zip(TERMS, c)}


def errors(fit: dict[str, float], samples: Sequence[tuple[Sequence[tuple[int, int]], float]]) -> dict[str, float]:
    """In-sample relative error of ``fit`` over ``samples``: median, p90 and max of |predicted / measured - 1|."""
    c = np.array([fit[t] for t in TERMS])
    rel = np.array([abs(float(np.dot(iteration_features(b), c)) / s - 1.0) for b, s in samples])
    return {"median": float(np.median(rel)), "p90": float(np.percentile(rel, 90)), "max": float(rel.max())}


@dataclass
class EngineProfile:
    """A measured engine: its model (ModelSpec dict), its :class:`~flexmesh.serve.engine.config.EngineConfig`
    (dict), the fit, and the samples ``(batch, median seconds)`` it came from."""

    model: dict
    engine: dict
    fit: dict[str, float]
    samples: list = field(default_factory=list)
    produced_by: dict = field(default_factory=dict)
    name: str = ""
    admission_s: float = 0.0  # router receipt -> the engine's first iteration holding the request (module doc)
    after_idle: float = 0.0  # the first iteration after the engine idled costs 1 + this times the fit (module doc)
    intake_s: float = 0.0  # a busy engine's wall seconds per request it takes in, beyond its loop's (module doc)
    answer_s: float = 0.0  # the same per request it answers
    host_cores: int = 0  # CPU cores of the machine the engines share with the router's process (module doc)
    host_request_s: float = 0.0  # CPU seconds of the router's (and client's) process per request routed
    host_token_s: float = 0.0  # the same per prompt token sent
    host_output_s: float = 0.0  # the same per output token streamed back

    kind = KIND

    @property
    def error(self) -> dict[str, float]:
        """In-sample relative error of the fit (:func:`errors`)."""
        return errors(self.fit, self.samples) if self.samples else {}

    def to_dict(self) -> dict:
        return {"version": VERSION, "kind": KIND, "produced_by": self.produced_by, "model": self.model,
                "engine": self.engine, "fit": self.fit, "error": self.error, "admission_s": self.admission_s,
                "after_idle": self.after_idle, "intake_s": self.intake_s, "answer_s": self.answer_s,
                "host_cores": self.host_cores, "host_request_s": self.host_request_s,
                "host_token_s": self.host_token_s, "host_output_s": self.host_output_s,
                "samples": [{"batch": [list(x) for x in b], "seconds": s} for b, s in self.samples]}

    def save(self, path: str | Path) -> None:
        write_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict, name: str = "") -> EngineProfile:
        where = name or "engine profile"
        if not isinstance(d, dict) or d.get("kind") != KIND:
            found = d.get("kind") if isinstance(d, dict) else type(d).__name__
            raise ProfileError(f"{where} is not an engine profile (kind {found!r}); write one with "
                               "`flexmesh profile engine`")
        if d.get("version") != VERSION:
            raise ProfileError(f"{where} has version {d.get('version')!r}, this flexmesh reads {VERSION}; "
                               "measure again with `flexmesh profile engine`")
        fit = d.get("fit")
        if not isinstance(fit, dict) or any(not isinstance(fit.get(t), (int, float)) or fit[t] < 0 for t in TERMS):
            raise ProfileError(f"{where}: fit must hold {', '.join(TERMS)} as non-negative numbers")
        def bounded(key: str, top: float, what: str, closed: bool = False, whole: bool = False) -> float:
            v = d.get(key, 0)
            kinds = int if whole else (int, float)
            if isinstance(v, bool) or not isinstance(v, kinds) or not (0 <= v <= top if closed else 0 <= v < top):
                raise ProfileError(f"{where}: {key} must be {what}, got {v!r}")
            return v

        admission = bounded("admission_s", 60, "a number of seconds from 0 to 60")
        after_idle = bounded("after_idle", 10, "a fraction from 0 to 10 (the first iteration after idling over the "
                             "fit, minus 1)", closed=True)
        costs = {key: bounded(key, 1, "a number of seconds from 0 to 1 (what a request costs a busy engine beside "
                              "its loop)") for key in ("intake_s", "answer_s")}
        cores = bounded("host_cores", 4096, "the machine's CPU cores, a whole number from 0 to 4096", closed=True,
                        whole=True)
        host = {key: bounded(key, 1, "a number of seconds from 0 to 1 (the router's process's CPU time per request "
                             "or token)") for key in ("host_request_s", "host_token_s", "host_output_s") if key in d}
        host.setdefault("host_output_s", host.get("host_token_s", 0.0))  # written before the two were told apart
        try:
            samples = [([(int(c), int(q)) for c, q in s["batch"]], float(s["seconds"])) for s in d.get("samples", [])]
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"{where}: malformed samples ({e}); each is {{batch: [[cached, new], ...], "
                               "seconds}}") from None
        return cls(model=d.get("model", {}), engine=d.get("engine", {}), fit={t: float(fit[t]) for t in TERMS},
                   samples=samples, produced_by=d.get("produced_by", {}), name=name, admission_s=float(admission),
                   after_idle=float(after_idle), **{k: float(v) for k, v in costs.items()}, host_cores=int(cores),
                   **{k: float(v) for k, v in host.items()})


def load_engine_profile(path: str | Path) -> EngineProfile:
    """Read an engine profile; ProfileError (one line) when missing or malformed."""
    path = Path(path)
    d = read_json(path, ProfileError, invalid="not a JSON profile",
                  missing=f"engine profile {str(path)!r} does not exist; write one with "
                          f"`flexmesh profile engine --out {path}`")
    return EngineProfile.from_dict(d, name=path.name)


class ProfiledIterationTiming:
    """``IterationTiming`` (flexmesh.cost.inference) priced by an engine profile's fit (module doc)."""

    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        self._c = tuple(profile.fit[t] for t in TERMS)
        self.source = f"profile:{profile.name or 'engine'}"
        # the host's cores and the router's process's CPU on them (flexmesh.profile.host)
        self.host_cores, self.host_request_s = profile.host_cores, profile.host_request_s
        self.host_token_s, self.host_output_s = profile.host_token_s, profile.host_output_s

    @property
    def overhead_s(self) -> float:
        """The per-iteration engine overhead (``c0``)."""
        return self._c[0]

    @property
    def loop(self) -> EngineLoop:
        """What the engine's loop costs beyond the fit (the profile's ``after_idle``, ``intake_s``, ``answer_s`` and
        ``admission_s``, after an idle gap of :data:`IDLE_GAP_S`: module doc)."""
        p = self.profile
        return EngineLoop(after_idle=p.after_idle, idle_gap_s=IDLE_GAP_S, intake_s=p.intake_s, answer_s=p.answer_s,
                          admission_s=p.admission_s)

    def iteration_s(self, batch: Sequence[tuple[int, int]]) -> float:
        if not batch:
            return 0.0
        return float(sum(c * f for c, f in zip(self._c, iteration_features(batch))))

    def split_s(self, decodes: int, decode_context: int, chunks: Sequence[tuple[int, int]]) -> float:
        """:meth:`iteration_s` of ``decodes`` one-token steps over ``decode_context`` cached tokens in all beside
        ``chunks``, in constant time in the decodes (every term is linear in their contexts: exact).

        >>> t = ProfiledIterationTiming(EngineProfile({}, {}, dict(zip(TERMS, (1e-3, 1e-4, 2e-5, 1e-7, 1e-8, 2e-8)))))
        >>> batch = [(100, 1), (250, 1), (0, 64)]
        >>> abs(t.split_s(2, 350, [(0, 64)]) - t.iteration_s(batch)) < 1e-15
        True
        """
        if decodes == 0 and not chunks:
            return 0.0
        n = decodes + len(chunks)
        t = decodes + sum(q for _, q in chunks)
        k = decode_context + decodes + sum(c + q for c, q in chunks)
        own = decode_context + decodes + sum(q * (c + q) for c, q in chunks)
        return float(sum(c * f for c, f in zip(self._c, (1.0, n, t, k, t * k, own))))

    def decode_run_s(self, decodes: int, decode_context: int, steps: int, growth: float | None = None) -> float:
        """Seconds of ``steps`` decode-only iterations in a row from ``decode_context`` (each adds ``growth``
        tokens to it, ``decodes`` when not given), in closed form: each iteration is affine in the context.

        >>> t = ProfiledIterationTiming(EngineProfile({}, {}, dict(zip(TERMS, (1e-3, 1e-4, 2e-5, 1e-7, 1e-8, 2e-8)))))
        >>> one_by_one = sum(t.split_s(4, 400 + 4 * j, ()) for j in range(7))
        >>> abs(t.decode_run_s(4, 400, 7) - one_by_one) < 1e-15
        True
        """
        first = self.split_s(decodes, decode_context, ())
        c0, c_req, c_tok, c_kv, c_batch, c_own = self._c
        per_context = c_kv + c_batch * decodes + c_own  # d(seconds) / d(decode_context) at fixed decodes
        return steps * first + per_context * (decodes if growth is None else growth) * (steps * (steps - 1) / 2)


def price_runs(runs: Sequence[Sequence[dict]], timing: ProfiledIterationTiming) -> list[float]:
    """Seconds ``timing`` prices each engine's iterations at (``batch``, ``start_s``, ``end_s``, in the order it ran
    them; the lists one after another), each first one after idling :data:`IDLE_GAP_S` or more at ``1 + after_idle``
    times its batch's price, as the request simulator prices it, and each with ``intake_s`` per request it took in
    and ``answer_s`` per request it answered (its ``taken`` and ``answered``, where the engine counted them), and
    ``host_request_s`` per request it took in where as many engines as the host has cores were iterating as it
    started (the router's process then takes a core from them: module doc; its token cost is left out, the log
    counting no request's tokens).

    >>> t = ProfiledIterationTiming(EngineProfile({}, {}, dict(zip(TERMS, (1e-2, 0, 0, 0, 0, 0))), after_idle=0.5,
    ...                                           intake_s=2e-3))
    >>> its = [{"batch": [[0, 8]], "start_s": s, "end_s": s + 0.01} for s in (0.0, 0.01, 0.5)]
    >>> its[1]["taken"] = 1
    >>> [round(x * 1e3, 1) for x in price_runs([its], t)]
    [15.0, 12.0, 15.0]
    """
    cores, per_request = timing.host_cores, timing.host_request_s
    saturated = saturated_starts(runs, cores) if cores and per_request else None
    loop = timing.loop
    out = []
    for k, (it, after_idle) in enumerate(_after_idle_flags(runs)):
        price = timing.iteration_s([tuple(b) for b in it["batch"]])
        price = price * (1.0 + loop.after_idle) if after_idle else price
        price += loop.intake_s * it.get("taken", 0) + loop.answer_s * it.get("answered", 0)
        if saturated is not None and saturated[k]:
            price += per_request * it.get("taken", 0)
        out.append(price)
    return out


def request_costs_from(iterations: Sequence[dict]) -> tuple[float, float]:
    """The profile's ``intake_s`` and ``answer_s`` (module doc) from iterations as an engine logged them (``taken``,
    ``answered``, ``others_cpu_s``; ``phase`` as a profile's samples name it): the non-negative least-squares fit
    ``others_cpu_s = c + intake_s * taken + answer_s * answered``; a cost is 0 where fewer than
    :data:`REQUEST_GROUP` iterations counted its kind (an older engine's log counts none).

    Fitted on the serving phase's iterations alone where they count as many kinds of request cost as all do: there
    requests reach an engine one at a time through the router, as they reach a replica that serves. A sweep's
    scenario sends all its requests at once; the engine's HTTP thread takes a burst in for less a request (one
    wake-up, one pass of its event loop for many), and one iteration that took in a batch's tens of requests would
    outweigh the serving phase's ones and twos in the fit (on this 2-core machine the sweep alone gives about
    0.2 ms a request, the serving phase 0.6-0.7 ms, as the engines' own replays behind the router do).

    >>> def it(taken, answered, background=2e-5, phase="serving"):
    ...     return {"taken": taken, "answered": answered, "phase": phase,
    ...             "others_cpu_s": background + 1e-3 * taken + 5e-4 * answered}
    >>> its = [it(0, 0)] * 200 + [it(1, 0)] * 30 + [it(0, 1)] * 30 + [it(2, 1)] * 5
    >>> [round(x * 1e3, 3) for x in request_costs_from(its)]
    [1.0, 0.5]
    >>> burst = {"taken": 40, "answered": 0, "phase": "sweep", "others_cpu_s": 40 * 2e-4}  # 0.2 ms each
    >>> [round(x * 1e3, 3) for x in request_costs_from(its + [burst] * 20)]  # the serving phase's costs
    [1.0, 0.5]
    """
    rows = _request_rows([it for it in iterations if it.get("phase") == "serving"])
    every = _request_rows(iterations)
    if len(_kinds(rows)) < len(_kinds(every)):
        rows = every
    kinds = _kinds(rows)
    if not kinds:
        return 0.0, 0.0
    features = np.array([[1.0] + [float(r[k]) for k in kinds] for r in rows])
    c = least_squares(features, np.array([r[2] for r in rows]), relative=False, robust=False)
    costs = [0.0, 0.0]
    for k, v in zip(kinds, c[1:]):
        costs[k] = float(v)
    return costs[0], costs[1]


def _request_rows(iterations: Sequence[dict]) -> list[tuple[int, int, float]]:
    """(taken, answered, others_cpu_s) of the iterations that logged their other threads' CPU time."""
    return [(int(it.get("taken", 0)), int(it.get("answered", 0)), float(it["others_cpu_s"]))
            for it in iterations if "others_cpu_s" in it]


def _kinds(rows: Sequence[tuple[int, int, float]]) -> list[int]:
    """The request costs (0: taken in, 1: answered) that at least :data:`REQUEST_GROUP` of ``rows`` counted."""
    return [k for k in (0, 1) if sum(1 for r in rows if r[k] > 0) >= REQUEST_GROUP]


def _after_idle_flags(runs: Sequence[Sequence[dict]]) -> Iterator[tuple[dict, bool]]:
    """Each engine's iterations (``start_s``, ``end_s``; the lists one after another) with whether it started at
    least :data:`IDLE_GAP_S` after the one before it on that engine ended (the first of a run always does)."""
    for its in runs:
        ended = -math.inf
        for it in its:
            yield it, it["start_s"] - ended >= IDLE_GAP_S
            ended = it["end_s"]


def after_idle_from(runs: Sequence[Sequence[dict]], timing: IterationTiming) -> float:
    """The profile's ``after_idle`` (module doc) from each engine's iterations in the order it ran them (``batch``,
    ``start_s``, ``end_s``, ``cpu_s``; ``phase`` as a profile's samples name it), priced by ``timing``; 0 when either
    kind of iteration is missing or the first ones are no slower.

    From the serving phase's iterations alone where at least :data:`REQUEST_GROUP` of them came first after idling:
    there an engine wakes for a request that reached it alone, as a replica that serves does. A sweep's scenario
    wakes every engine at once with all its requests, its first iteration a batch of prompts whose fit leans
    otherwise than the decodes after it (on this 2-core machine a profile's sweep and serving iterations together
    gave 0 where replays behind the router show 0.14-0.16, and the serving phase alone 0.11 under load).

    >>> class Flat:
    ...     def iteration_s(self, batch):
    ...         return 0.01
    >>> def it(start, cpu):
    ...     return {"batch": [[0, 8]], "start_s": start, "end_s": start + cpu, "cpu_s": cpu}
    >>> run = [it(0.0, 0.013), it(0.013, 0.010), it(0.023, 0.011), it(0.5, 0.012), it(0.512, 0.010)]
    >>> round(after_idle_from([run], Flat()), 3)  # medians 12.5 ms after idling, 10 ms at once
    0.25
    """
    seen: list[tuple[bool, bool, float]] = []  # (after idle, served, measured / priced)
    for it, after_idle in _after_idle_flags(runs):
        if it["batch"] and it["cpu_s"] > 0:
            ratio = it["cpu_s"] / timing.iteration_s([tuple(b) for b in it["batch"]])
            seen.append((after_idle, it.get("phase") == "serving", ratio))
    served = [x for x in seen if x[1]]
    if sum(1 for x in served if x[0]) >= REQUEST_GROUP and any(not x[0] for x in served):
        seen = served
    first = [r for f, _, r in seen if f]
    rest = [r for f, _, r in seen if not f]
    if not first or not rest:
        return 0.0
    return max(0.0, float(np.median(first) / np.median(rest)) - 1.0)


def replay_profile(iterations: Sequence[Sequence[dict]]) -> EngineProfile:
    """A profile of the engines as they served a replay: a fit to their own iterations (``GET /iterations``:
    ``batch``, ``start_s``, ``end_s``), by wall time, so the waits for a core on a shared machine are in it, then
    every coefficient scaled by one factor so that the fit's busy time is theirs (the relative-error fit leans
    low where a few iterations are stretched by such waits).

    >>> its = [[{"batch": [[c, 1]] * b, "start_s": 0.0, "end_s": 2e-3 + 1e-4 * b} for b in range(1, 9)
    ...         for c in (10, 200)]]
    >>> t = ProfiledIterationTiming(replay_profile(its))
    >>> round(t.iteration_s([(10, 1)] * 4) * 1e3, 2)
    2.4
    """
    samples = [(tuple((int(c), int(q)) for c, q in it["batch"]), float(it["end_s"]) - float(it["start_s"]))
               for per in iterations for it in per if it["batch"]]
    if len(samples) < len(TERMS):
        raise ProfileError(f"{len(samples)} engine iterations are too few to fit the {len(TERMS)} terms; replay more "
                           "requests")
    fit = fit_iterations(samples)
    timing = ProfiledIterationTiming(EngineProfile(model={}, engine={}, fit=fit))
    factor = sum(s for _, s in samples) / max(sum(timing.iteration_s(b) for b, _ in samples), 1e-12)
    scaled = {t: v * factor for t, v in fit.items()}
    return EngineProfile(model={}, engine={}, fit=scaled, name="replay",
                         produced_by={"samples": len(samples), "busy_scale": factor})
