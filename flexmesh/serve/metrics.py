"""Serving metrics, defined once: per-request latencies, percentiles, SLO attainment, goodput and cost.

One record per request, simulated or measured (one JSON object per line in ``requests.jsonl``):
``{"id", "replica", "arrival_s", "first_token_s", "finish_s", "prompt_tokens", "output_tokens"}`` plus
optional ``"token_s"`` (each output token's time) and the simulator's ``"decode_replica"``,
``"preemptions"`` and ``"cached_tokens"``; a request that sampled several branches (test-time scaling) has
``"branches"`` and ``"decode_tokens"`` (tokens generated over all its branches), and its ``output_tokens`` are
the branch's that completed it.

- TTFT (time to first token) = ``first_token_s - arrival_s``.
- TPOT (time per output token) = ``(finish_s - first_token_s) / (output_tokens - 1)``: the first token is
  excluded (it is TTFT's), so TPOT is undefined for one-token outputs, and such a request meets any TPOT
  SLO (it has no second token to be late).
- E2E = ``finish_s - arrival_s``.
- Per-token latency = ``E2E / output_tokens`` (the normalized latency of Orca, vLLM and TIE: a request's
  latency spread over what it generated; its mean over requests is what length-aware queues lower).
- Attainment: the fraction of requests that meet every SLO given (TTFT, TPOT, E2E bounds).
- Goodput: the highest request rate at which at least a target fraction of requests meet every SLO, over
  the whole fleet, found by bisection on the rate (:func:`goodput`).
- Throughput and cost over the span from the first arrival to the last finish: requests and tokens per
  second; $/h of the GPUs serving; $ per million tokens = $/h x span / tokens.

Percentiles are numpy's linear interpolation between order statistics.

>>> r = RequestRecord(0, 0, arrival_s=1.0, first_token_s=1.2, finish_s=2.2, prompt_tokens=100, output_tokens=11)
>>> round(r.ttft_s, 3), round(r.tpot_s, 3), round(r.e2e_s, 3)
(0.2, 0.1, 1.2)
>>> from flexmesh.serve.layout.slo import parse_slo
>>> meets(r, SLO(ttft_s=0.25, tpot_s=0.05)), meets(r, parse_slo("ttft=250ms,tpot=0.11s"))
(False, True)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from flexmesh.errors import DataError, FlexmeshError
from flexmesh.files import write_atomic
from flexmesh.inputs import iter_jsonl
from flexmesh.serve.layout.slo import SLO

PERCENTILES = (50, 90, 99)
_RECORD_FIELDS = ("id", "replica", "arrival_s", "first_token_s", "finish_s", "prompt_tokens", "output_tokens")
_OPTIONAL = ("token_s", "decode_replica", "preemptions", "cached_tokens", "decode_tokens", "branches")


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request (times in seconds from the trace's start)."""

    id: int
    replica: int  # the replica that produced its first token
    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int
    token_s: tuple[float, ...] | None = None  # each output token's time, where measured
    decode_replica: int | None = None  # prefill/decode disaggregation: the replica that decoded it
    preemptions: int = 0  # times its KV was dropped and recomputed
    cached_tokens: int = 0  # prompt tokens found in a prefix cache
    decode_tokens: int | None = None  # test-time scaling: output tokens generated over all its branches
    branches: int = 1  # branches sampled (output_tokens is then the length of the branch that completed it)

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """None for a one-token output (the first token is not counted)."""
        if self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def per_token_s(self) -> float:
        return self.e2e_s / max(self.output_tokens, 1)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in _RECORD_FIELDS}
        if self.token_s is not None:
            d["token_s"] = list(self.token_s)
        if self.decode_replica is not None:
            d["decode_replica"] = self.decode_replica
        if self.preemptions:
            d["preemptions"] = self.preemptions
        if self.cached_tokens:
            d["cached_tokens"] = self.cached_tokens
        if self.decode_tokens is not None:
            d["decode_tokens"] = self.decode_tokens
        if self.branches != 1:
            d["branches"] = self.branches
        return d

    @classmethod
    def from_json(cls, d: object, where: str) -> RequestRecord:
        if not isinstance(d, dict):
            raise DataError(f"{where}: not a JSON object")
        missing = [k for k in _RECORD_FIELDS if k not in d]
        if missing:
            raise DataError(f"{where}: field {missing[0]!r} is missing; a record has {', '.join(_RECORD_FIELDS)}")
        unknown = [k for k in d if k not in _RECORD_FIELDS + _OPTIONAL]
        if unknown:
            raise DataError(f"{where}: unknown field {unknown[0]!r}")
        for k in _RECORD_FIELDS:
            v = d[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise DataError(f"{where}: field {k!r} is {str(v)[:40]!r}, not a finite number")
        token_s = d.get("token_s")
        if token_s is not None and (not isinstance(token_s, list)
                                    or not all(isinstance(t, (int, float)) for t in token_s)):
            raise DataError(f"{where}: field 'token_s' must be a list of times")
        return cls(int(d["id"]), int(d["replica"]), float(d["arrival_s"]), float(d["first_token_s"]),
                   float(d["finish_s"]), int(d["prompt_tokens"]), int(d["output_tokens"]),
                   tuple(token_s) if token_s is not None else None, d.get("decode_replica"),
                   int(d.get("preemptions", 0)), int(d.get("cached_tokens", 0)),
                   None if d.get("decode_tokens") is None else int(d["decode_tokens"]), int(d.get("branches", 1)))


def write_records(path: str | Path, records: Iterable[RequestRecord]) -> None:
    """``requests.jsonl``: one record per line."""
    write_atomic(path, "".join(json.dumps(r.to_json()) + "\n" for r in records))


def read_records(path: str | Path) -> list[RequestRecord]:
    """The records of a ``requests.jsonl`` (simulated or measured)."""
    p = Path(path)
    return [RequestRecord.from_json(d, f"{p} row {i}") for i, d in iter_jsonl(p, DataError, invalid="not JSON")]


# ---- SLOs and attainment ---------------------------------------------------------------------------
def meets(record: RequestRecord, slo: SLO) -> bool:
    """Whether ``record`` meets every bound of ``slo`` (a one-token output meets any TPOT bound)."""
    if slo.ttft_s is not None and record.ttft_s > slo.ttft_s:
        return False
    if slo.tpot_s is not None:
        tpot = record.tpot_s
        if tpot is not None and tpot > slo.tpot_s:
            return False
    return slo.e2e_s is None or record.e2e_s <= slo.e2e_s


def attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """The fraction of ``records`` that meet every bound of ``slo`` (1 for no records)."""
    if not records:
        return 1.0
    return sum(meets(r, slo) for r in records) / len(records)


# ---- summaries -------------------------------------------------------------------------------------
def percentiles(values: Sequence[float], qs: Sequence[float] = PERCENTILES) -> dict[str, float]:
    """``{"p50": ..., ...}`` and ``"mean"`` of ``values`` (NaN for none)."""
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return {**{f"p{q:g}": math.nan for q in qs}, "mean": math.nan}
    return {**{f"p{q:g}": float(v) for q, v in zip(qs, np.percentile(a, qs))}, "mean": float(a.mean())}


@dataclass(frozen=True)
class Summary:
    """Latency percentiles, throughput, attainment and cost of a run (times in seconds)."""

    requests: int
    span_s: float  # first arrival to last finish
    ttft: dict[str, float]
    tpot: dict[str, float]
    e2e: dict[str, float]
    requests_per_s: float
    output_tokens_per_s: float
    tokens_per_s: float  # prompt + output
    attainment: float | None = None  # under the SLO given, None without one
    slo: str = ""
    dollars_per_hour: float | None = None
    dollars_per_m_output: float | None = None  # $ per million output tokens
    dollars_per_m_tokens: float | None = None  # $ per million tokens, prompt + output
    extra: dict = field(default_factory=dict)
    per_token: dict = field(default_factory=dict)  # per-token latency (E2E / output tokens): percentiles, mean
    decode_tokens: int = 0  # output tokens generated, every branch of a test-time-scaling request counted

    def to_json(self) -> dict:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], slo: SLO | None = None,
              dollars_per_hour: float | None = None) -> Summary:
    """The :class:`Summary` of ``records`` (under ``slo`` where given; priced at ``dollars_per_hour``)."""
    if not records:
        raise FlexmeshError("no requests to summarize")
    span = max(r.finish_s for r in records) - min(r.arrival_s for r in records)
    out_tokens = sum(r.output_tokens for r in records)
    all_tokens = out_tokens + sum(r.prompt_tokens for r in records)
    tpots = [t for t in (r.tpot_s for r in records) if t is not None]
    per_s = (lambda x: x / span) if span > 0 else (lambda x: math.nan)
    return Summary(
        requests=len(records), span_s=span, ttft=percentiles([r.ttft_s for r in records]),
        tpot=percentiles(tpots), e2e=percentiles([r.e2e_s for r in records]),
        requests_per_s=per_s(len(records)), output_tokens_per_s=per_s(out_tokens), tokens_per_s=per_s(all_tokens),
        attainment=attainment(records, slo) if slo is not None else None, slo=str(slo) if slo is not None else "",
        dollars_per_hour=dollars_per_hour,
        dollars_per_m_output=dollars_per_million(dollars_per_hour, span, out_tokens),
        dollars_per_m_tokens=dollars_per_million(dollars_per_hour, span, all_tokens),
        per_token=percentiles([r.per_token_s for r in records]),
        decode_tokens=sum(r.output_tokens if r.decode_tokens is None else r.decode_tokens for r in records),
    )


def dollars_per_million(dollars_per_hour: float | None, span_s: float, tokens: int) -> float | None:
    """$ per million ``tokens`` served in ``span_s`` by GPUs costing ``dollars_per_hour``.

    >>> dollars_per_million(10.0, 3600.0, 2_000_000)
    5.0
    """
    if dollars_per_hour is None or tokens <= 0:
        return None
    return dollars_per_hour * span_s / 3600.0 / (tokens / 1e6)


# ---- goodput -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Goodput:
    """The highest rate found at ``target`` attainment (0 when even the lowest rate tried misses it; the
    highest rate tried when none missed: ``bounded`` False) and every (rate, attainment) evaluated."""

    rate: float
    target: float
    points: tuple[tuple[float, float], ...]
    bounded: bool  # a rate that misses the target was found above ``rate``


def goodput(attainment_at: Callable[[float], float], target: float, start_rate: float, rel_tol: float = 0.02,
            max_steps: int = 12, step: float = 2.0, saturated: Callable[[float], bool] | None = None) -> Goodput:
    """Bisection on the request rate for the highest one whose attainment (``attainment_at(rate)``, which is
    assumed not to rise with the rate) is at least ``target``: from ``start_rate`` multiply (or divide) by
    ``step`` until the target is bracketed, at most ``max_steps`` times (a step under 2 squared after each try, up
    to 2: a ``step`` nearer 1 takes fewer runs from a start already near the answer, a prediction's, and still
    reaches a far one), then halve the bracket in log-rate until its ends are within ``rel_tol`` of each other.
    ``saturated(rate)``, asked of a rate that met the target: whether a higher rate could change nothing (a finite
    workload that arrived whole before its first answer); the search stops there, unbounded, rather than multiply
    a rate that means nothing further.

    >>> g = goodput(lambda r: 1.0 if r <= 7.3 else 0.5, target=0.9, start_rate=1.0)
    >>> 7.3 / 1.02 <= g.rate <= 7.3, g.bounded, len(g.points)
    (True, True, 10)
    >>> near = goodput(lambda r: 1.0 if r <= 7.3 else 0.5, target=0.9, start_rate=6.5, step=1.25)
    >>> 7.3 / 1.02 <= near.rate <= 7.3, len(near.points)
    (True, 6)
    >>> whole = goodput(lambda r: 1.0, target=0.9, start_rate=1.0, saturated=lambda r: r >= 8)  # a finite workload
    >>> whole.rate, whole.bounded, len(whole.points)
    (8.0, False, 4)
    """
    if not 0 < target <= 1:
        raise FlexmeshError(f"the attainment target is a fraction in (0, 1], got {target}")
    if not (start_rate > 0 and math.isfinite(start_rate)):
        raise FlexmeshError(f"goodput's search starts at a positive rate, got {start_rate}")
    if not step > 1:
        raise FlexmeshError(f"goodput's bracketing step is a factor above 1, got {step}")
    points: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        a = attainment_at(rate)
        points.append((rate, a))
        return a >= target

    lo, hi = None, None
    if ok(start_rate):
        lo = start_rate
        f = step
        for _ in range(max_steps):
            if saturated is not None and saturated(lo):
                break
            if not ok(lo * f):
                hi = lo * f
                break
            lo *= f
            f = max(f, min(f * f, 2.0))
        if hi is None:
            return Goodput(lo, target, tuple(points), bounded=False)
    else:
        hi = start_rate
        f = step
        for _ in range(max_steps):
            if ok(hi / f):
                lo = hi / f
                break
            hi /= f
            f = max(f, min(f * f, 2.0))
        if lo is None:
            return Goodput(0.0, target, tuple(points), bounded=True)
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return Goodput(lo, target, tuple(points), bounded=True)
