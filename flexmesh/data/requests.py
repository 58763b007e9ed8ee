"""Requests over time: the :class:`Request` type, trace readers, synthetic arrivals and workload transforms.

A request arrives at ``arrival_s`` (seconds from the trace's start) with a prompt of ``prompt_tokens`` and
asks for ``output_tokens`` tokens; ``prefix_blocks`` are ids of its prompt's blocks of ``block_tokens``
tokens each (equal ids: equal prompt prefixes, as Mooncake's ``hash_ids``), which a prefix cache reuses.
A :class:`Workload` is the requests in arrival order with the block size their reader states.

Readers (each refuses bad input with one line naming the file, the row and the field):

- Azure LLM inference trace 2023 (CSV: ``TIMESTAMP, ContextTokens, GeneratedTokens``): :func:`read_azure_csv`;
- Mooncake traces (JSONL: ``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``, one id per
  512-token block): :func:`read_mooncake_jsonl`;
- a plain CSV or JSONL of one's own (``arrival_s, prompt_tokens, output_tokens`` and optionally ``id``,
  ``prefix_blocks``, ``tier``, ``branches``, ``needed``; other columns, such as latencies measured beside them,
  are left out and named in the workload's notes): :func:`read_plain`;
- ShareGPT conversations (what vLLM's serving benchmark samples first): lengths, no arrival times:
  :func:`read_sharegpt`;
- the shipped traces by name (``azure-conv``, ``azure-code``, ``mooncake``; files and licences under
  ``flexmesh/data/traces/``, see its README) and any of the above by path: :func:`load_trace`.

Transforms return new workloads: :func:`with_arrivals` (Poisson or gamma-burst arrivals at a rate over the
workload's lengths), :func:`at_rate` (arrival times scaled to a mean rate), :func:`window` (a bounded window
of arrivals, re-based to 0), :func:`scale_to_context` (lengths scaled to fit a model's context).

>>> w = load_trace("azure-conv")
>>> len(w), w.requests[0].prompt_tokens, w.requests[0].output_tokens, round(w.rate, 2)
(19366, 374, 44, 5.53)
>>> short = window(w, 60.0, 120.0)
>>> short.requests[0].arrival_s >= 0.0 and short.duration_s <= 60.0
True
>>> fast = at_rate(short, 20.0)
>>> round(fast.rate, 6)
20.0
"""

from __future__ import annotations

import csv
import gzip
import io
import math
import re
import zlib
from dataclasses import dataclass, replace
from datetime import date
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from flexmesh.errors import DataError
from flexmesh.inputs import decode_text, parse_json, read_bytes

# Mooncake's traces hash each prompt in blocks of 512 tokens (kvcache-ai/Mooncake FAST25-release/traces
# README: "hash_ids ... the block size is 512").
MOONCAKE_BLOCK_TOKENS = 512
# Shipped traces: file under flexmesh/data/traces/ and its reader.
SHIPPED = {"azure-conv": "azure2023_conv.csv.gz", "azure-code": "azure2023_code.csv.gz",
           "mooncake": "mooncake_conversation.jsonl.gz"}
# The most bytes a trace file may expand to: 1 GiB is tens of millions of requests.
MAX_TRACE_BYTES = 1 << 30
# The most rows one trace may hold: the most requests one simulation runs (serve simulate's MAX_REQUESTS); each
# row becomes a request object of a few hundred bytes, so a 4 MB gzip of 179 M short rows is refused before it
# fills memory
MAX_TRACE_ROWS = 10_000_000
# The longest prompt or output a trace may give (tokens): the int32 range, as for lengths.
MAX_TOKENS = 2**31 - 1
PLAIN_FIELDS = ("id", "arrival_s", "prompt_tokens", "output_tokens", "prefix_blocks", "tier", "branches", "needed",
                "branch_tokens")
# ShareGPT as vLLM's serving benchmark samples it (vllm benchmarks/benchmark_dataset.py, ShareGPTDataset and
# is_valid_sequence): a conversation's first turn the prompt, its second the output; a turn under 4 tokens, a prompt
# over 1,024 or a total over 2,048 left out. Its tokens counted at 4 characters a token (OpenAI's rule of thumb for
# English text; nothing downloads the model's tokenizer).
SHAREGPT_MIN_TOKENS, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class Request:
    """One request of a trace (the serving contract: keep these names and meanings)."""

    id: int
    arrival_s: float  # seconds from the trace's start
    prompt_tokens: int
    output_tokens: int  # tokens to generate (the trace's; a predictor may estimate it)
    prefix_blocks: tuple[int, ...] = ()  # prompt block hash ids (Mooncake hash_ids); block size stated by the reader
    tier: int = 0  # which model (cascades / several models)
    branches: int = 1  # N branches sampled (test-time scaling) ...
    needed: int = 1  # ... of which M are needed
    branch_tokens: tuple[int, ...] = ()  # each branch's output length where they differ (else output_tokens each)

    def branch_lengths(self) -> tuple[int, ...]:
        """The output length of each of the request's branches."""
        return self.branch_tokens or (self.output_tokens,) * self.branches


# The latest arrival a workload may hold, in seconds: epoch seconds (~1.7e9) fit; epoch milliseconds or nanoseconds
# read as seconds do not (at 1e18 s one float step is 128 s, and every latency rounds to 0).
MAX_ARRIVAL_S = 1e10


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order and what their reader says of them.

    ``block_tokens``: tokens per prefix block id (0 when no request carries ids).
    """

    requests: tuple[Request, ...]
    name: str
    block_tokens: int = 0
    source: str = ""  # the file or generator it came from
    timed: bool = True  # False: the file gave no arrival times (every request at 0): draw them at a rate
    notes: tuple[str, ...] = ()  # what its reader left out or assumed, to be said where it is used

    def __post_init__(self) -> None:
        last = self.requests[-1].arrival_s if self.requests else 0.0
        if last > MAX_ARRIVAL_S:  # past it a float's resolution reaches a latency's size
            raise DataError(f"{self.source or self.name}: a request arrives at {last:.4g} s, past {MAX_ARRIVAL_S:g} s "
                            "(317 years): give arrival times in seconds from the trace's start (these look like ms or "
                            "ns), or a higher rate")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration_s(self) -> float:
        """From the first arrival to the last (0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def rate(self) -> float:
        """Mean arrival rate, requests per second: ``(n - 1) / duration`` (0 when it has no duration)."""
        d = self.duration_s
        return (len(self.requests) - 1) / d if d > 0 else 0.0

    @property
    def max_total_tokens(self) -> int:
        """The most tokens one request holds at its end (prompt + output)."""
        return max((r.prompt_tokens + max((r.output_tokens, *r.branch_tokens)) for r in self.requests), default=0)


def _ordered(requests: list[Request], name: str, block_tokens: int, source: str, timed: bool = True,
             notes: tuple[str, ...] = ()) -> Workload:
    if not requests:
        raise DataError(f"{source}: holds no requests; a trace needs at least one row")
    requests.sort(key=lambda r: (r.arrival_s, r.id))
    return Workload(tuple(requests), name, block_tokens, source, timed, notes)


# ---- reading files --------------------------------------------------------------------------------
def _text(path: Path) -> str:
    """The file's text (gunzipped for ``.gz``), bounded by :data:`MAX_TRACE_BYTES`."""
    raw = read_bytes(path, DataError, missing=f"{path}: no such trace file; give a shipped trace "
                     f"({', '.join(SHIPPED)}) or the path of a CSV or JSONL file", limit=MAX_TRACE_BYTES)
    if path.suffix == ".gz":
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as unpacked:
                raw = unpacked.read(MAX_TRACE_BYTES + 1)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: not a readable gzip file ({e}); re-compress it or give the plain file") from None
    if len(raw) > MAX_TRACE_BYTES:
        raise DataError(f"{path}: more than {MAX_TRACE_BYTES:,} bytes; give a window of the trace")
    rows = raw.count(b"\n")  # counted before a row is parsed: each costs a request object in memory
    if rows > MAX_TRACE_ROWS:
        raise DataError(f"{path}: {rows:,} lines, more than the {MAX_TRACE_ROWS:,} requests flexmesh reads from one "
                        "trace; cut a window of it into a file of its own")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if path.name.removesuffix(".gz").endswith((".jsonl", ".json")):
            return decode_text(raw)  # each line's reader names the field that holds the bytes
        raise DataError(f"{path}: not a UTF-8 text file (byte {e.start}); give a CSV or JSONL trace") from None


def _count(value: Any, where: str, field: str, minimum: int = 1) -> int:
    """A whole number of tokens (or ids) >= ``minimum`` from a CSV string or a JSON value."""
    v = value
    if isinstance(v, str):
        try:
            v = int(v.strip())
        except ValueError:
            raise DataError(f"{where}: field {field!r} is {value[:40]!r}, not a whole number") from None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise DataError(f"{where}: field {field!r} is {str(value)[:40]!r}, not a whole number")
    if v < minimum or v > MAX_TOKENS:
        raise DataError(f"{where}: field {field!r} is {v}, outside {minimum}..{MAX_TOKENS:,}")
    return v


def _seconds(value: Any, where: str, field: str, scale: float = 1.0) -> float:
    """A finite time >= 0 (``scale``: seconds per unit of the file)."""
    v = value
    if isinstance(v, str):
        try:
            v = float(v.strip())
        except ValueError:
            raise DataError(f"{where}: field {field!r} is {value[:40]!r}, not a number of seconds") from None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise DataError(f"{where}: field {field!r} is {str(value)[:40]!r}; give a finite time >= 0")
    return float(v) * scale


_STAMP = re.compile(r"^\s*(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2}(?:\.\d+)?)\s*$")


def _stamp(value: str, where: str) -> float:
    """Seconds since day 1 of an ISO date-time ``YYYY-MM-DD HH:MM:SS[.fraction]`` (any number of fraction
    digits: the Azure traces give seven, more than ``datetime.fromisoformat`` reads before Python 3.11)."""
    m = _STAMP.match(value)
    if m is None:
        raise DataError(f"{where}: field 'TIMESTAMP' is {value[:40]!r}, not a date-time like 2023-11-16 18:15:46.68")
    y, mo, d, h, mi = (int(x) for x in m.groups()[:5])
    try:
        day = date(y, mo, d).toordinal()
    except ValueError:
        raise DataError(f"{where}: field 'TIMESTAMP' is {value[:40]!r}, not a valid date") from None
    return day * 86400.0 + h * 3600.0 + mi * 60.0 + float(m.group(6))


def _csv_rows(path: Path, text: str) -> tuple[list[str], Iterator[tuple[int, dict[str, str]]]]:
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    reader.fieldnames = header
    twice = sorted({h for h in header if header.count(h) > 1})
    if twice:
        raise DataError(f"{path}: the header names {', '.join(map(repr, twice))} twice; give each column once")

    def rows() -> Iterator[tuple[int, dict[str, str]]]:
        for i, row in enumerate(reader, start=2):  # row 1 is the header
            extra = row.pop(None, None)
            if extra is not None or any(v is None for v in row.values()):
                given = sum(v is not None for v in row.values()) + len(extra or ())
                raise DataError(f"{path} row {i}: has {given} fields where the header names {len(header)}; check "
                                "the commas")
            yield i, row

    return header, rows()


def read_azure_csv(path: str | Path, name: str | None = None) -> Workload:
    """The Azure LLM inference trace 2023 (``TIMESTAMP, ContextTokens, GeneratedTokens``): arrivals from the
    first row's time stamp; no prefix ids (the trace has none)."""
    path = Path(path)
    header, rows = _csv_rows(path, _text(path))
    need = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
    missing = [f for f in need if f not in header]
    if missing:
        raise DataError(f"{path} row 1: the header lacks {', '.join(missing)}; an Azure trace has "
                        f"{', '.join(need)}")
    rows_read = []
    for i, row in rows:
        where = f"{path} row {i}"
        rows_read.append((_stamp(row["TIMESTAMP"], where), _count(row["ContextTokens"], where, "ContextTokens"),
                          _count(row["GeneratedTokens"], where, "GeneratedTokens")))
    start = min((s for s, _, _ in rows_read), default=0.0)
    requests = [Request(k, s - start, p, o) for k, (s, p, o) in enumerate(rows_read)]
    return _ordered(requests, name or path.name, 0, str(path))


def _json_lines(path: Path, text: str) -> Iterator[tuple[int, dict]]:
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        record = parse_json(line, DataError, f"{path} row {i}", invalid="not a JSON object")
        if not isinstance(record, dict):
            kind = {"list": "a list", "str": "a string", "NoneType": "null", "bool": "a boolean"}.get(
                type(record).__name__, "a number")
            raise DataError(f"{path} row {i}: {kind}, not a JSON object")
        yield i, record


def _field(record: dict, key: str, where: str) -> Any:
    if key not in record:
        raise DataError(f"{where}: field {key!r} is missing")
    return record[key]


def _ids(value: Any, where: str, field: str) -> tuple[int, ...]:
    if isinstance(value, str):  # CSV: ids separated by spaces
        value = value.split()
    if not isinstance(value, list):
        raise DataError(f"{where}: field {field!r} must be a list of whole numbers, got {str(value)[:40]!r}")
    return tuple(_count(v, where, field, minimum=0) for v in value)


def read_mooncake_jsonl(path: str | Path, name: str | None = None) -> Workload:
    """A Mooncake trace: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (one id per
    512-token prompt block, so at most ``ceil(input_length / 512)`` of them)."""
    path = Path(path)
    requests: list[Request] = []
    for i, rec in _json_lines(path, _text(path)):
        where = f"{path} row {i}"
        prompt = _count(_field(rec, "input_length", where), where, "input_length")
        ids = _ids(_field(rec, "hash_ids", where), where, "hash_ids")
        if len(ids) > -(-prompt // MOONCAKE_BLOCK_TOKENS):
            raise DataError(f"{where}: field 'hash_ids' has {len(ids)} ids for {prompt} prompt tokens, more than its "
                            f"{-(-prompt // MOONCAKE_BLOCK_TOKENS)} blocks of {MOONCAKE_BLOCK_TOKENS}")
        requests.append(Request(len(requests), _seconds(_field(rec, "timestamp", where), where, "timestamp", 1e-3),
                                prompt, _count(_field(rec, "output_length", where), where, "output_length"), ids))
    return _ordered(requests, name or path.name, MOONCAKE_BLOCK_TOKENS, str(path))


def _given(rec: dict, field: str, default: int) -> Any:
    """``rec``'s ``field``, or ``default`` where it is absent or an empty CSV cell (0 is a value, and judged)."""
    v = rec.get(field)
    return default if v is None or v == "" else v


def _plain_request(rec: dict, where: str, index: int) -> Request:
    r = Request(
        id=_count(rec["id"], where, "id", minimum=0) if rec.get("id") not in (None, "") else index,
        arrival_s=_seconds(_field(rec, "arrival_s", where), where, "arrival_s"),
        prompt_tokens=_count(_field(rec, "prompt_tokens", where), where, "prompt_tokens"),
        output_tokens=_count(_field(rec, "output_tokens", where), where, "output_tokens"),
        prefix_blocks=_ids(rec["prefix_blocks"], where, "prefix_blocks") if rec.get("prefix_blocks") else (),
        tier=_count(_given(rec, "tier", 0), where, "tier", minimum=0),
        branches=_count(_given(rec, "branches", 1), where, "branches"),
        needed=_count(_given(rec, "needed", 1), where, "needed"),
        branch_tokens=_ids(rec["branch_tokens"], where, "branch_tokens") if rec.get("branch_tokens") else (),
    )
    if r.needed > r.branches:
        raise DataError(f"{where}: field 'needed' is {r.needed}, more than its {r.branches} branches")
    if r.branch_tokens and (len(r.branch_tokens) != r.branches or min(r.branch_tokens) < 1):
        raise DataError(f"{where}: field 'branch_tokens' gives {len(r.branch_tokens)} lengths for {r.branches} "
                        "branches; give one length >= 1 per branch")
    return r


def read_plain(path: str | Path, block_tokens: int = 0, name: str | None = None) -> Workload:
    """A CSV (header row) or JSONL (one object per line) of requests: ``arrival_s, prompt_tokens,
    output_tokens`` and optionally ``id``, ``prefix_blocks`` (ids separated by spaces in a CSV, a list in
    JSONL; their block size is ``block_tokens``), ``tier``, ``branches``, ``needed``, ``branch_tokens`` (each
    branch's output length, as ``prefix_blocks`` is written)."""
    path = Path(path)
    text = _text(path)
    jsonl = path.name.removesuffix(".gz").endswith((".jsonl", ".json"))
    records = _json_lines(path, text) if jsonl else _csv_rows(path, text)[1]
    requests: list[Request] = []
    seen: set[int] = set()
    other: dict[str, None] = {}  # the fields no request has, in the order met
    for i, rec in records:
        where = f"{path} row {i}"
        other.update((k, None) for k in rec if k not in PLAIN_FIELDS)
        r = _plain_request(rec, where, len(requests))
        if r.id in seen:
            raise DataError(f"{where}: field 'id' {r.id} is given twice; ids name one request each")
        seen.add(r.id)
        requests.append(r)
    if any(r.prefix_blocks for r in requests) and block_tokens < 1:
        raise DataError(f"{path}: requests carry prefix_blocks but no block size is given; state how many tokens "
                        "one block id covers (--block-tokens)")
    notes = (f"{path.name}: columns left out: {', '.join(map(str, other))} (a request has "
             f"{', '.join(PLAIN_FIELDS)})",) if other else ()
    return _ordered(requests, name or path.name, block_tokens if any(r.prefix_blocks for r in requests) else 0,
                    str(path), notes=notes)


def _turn_text(turn: Any, where: str) -> str:
    if isinstance(turn, dict):
        turn = turn.get("value", turn.get("content"))
    if not isinstance(turn, str):
        raise DataError(f"{where}: a turn is an object with its text in 'value' (ShareGPT) or 'content'")
    return turn


def read_sharegpt(path: str | Path, name: str | None = None) -> Workload:
    """ShareGPT conversations (a JSON list of objects with ``conversations``, each turn ``{"from", "value"}``),
    sampled as vLLM's serving benchmark samples them (:data:`SHAREGPT_MIN_TOKENS` and the limits beside it):
    the first turn the prompt, the second the output, their tokens counted at :data:`CHARS_PER_TOKEN`
    characters a token. No arrival times: every request at 0 (``timed`` False; give them arrivals at a rate)."""
    path = Path(path)
    data = parse_json(_text(path), DataError, str(path))
    if not isinstance(data, list):
        raise DataError(f"{path}: a ShareGPT file is a JSON list of conversations, got a {type(data).__name__}")
    requests: list[Request] = []
    left_out = 0
    for i, conv in enumerate(data):
        where = f"{path} conversation {i}"
        turns = conv.get("conversations", conv.get("messages")) if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            raise DataError(f"{where}: holds no 'conversations' list; a ShareGPT file lists conversations, each "
                            "its turns")
        if len(turns) < 2:
            left_out += 1
            continue
        prompt, output = (max(1, math.ceil(len(_turn_text(t, where)) / CHARS_PER_TOKEN)) for t in turns[:2])
        if (min(prompt, output) < SHAREGPT_MIN_TOKENS or prompt > SHAREGPT_MAX_PROMPT
                or prompt + output > SHAREGPT_MAX_TOTAL):
            left_out += 1
            continue
        requests.append(Request(len(requests), 0.0, prompt, output))
    notes = (f"{path.name}: ShareGPT conversations have no arrival times: they are drawn at the rate given; "
             f"{len(requests):,} of {len(data):,} conversations kept as vLLM's benchmark keeps them (a first and "
             f"second turn of {SHAREGPT_MIN_TOKENS}+ tokens, a prompt of at most {SHAREGPT_MAX_PROMPT:,} and a total "
             f"of at most {SHAREGPT_MAX_TOTAL:,}; {CHARS_PER_TOKEN} characters a token)",)
    return _ordered(requests, name or path.name, 0, str(path), timed=False, notes=notes)


@lru_cache(maxsize=None)
def _shipped(name: str) -> Workload:
    """A shipped trace, read once (a Workload is immutable)."""
    f = resources.files("flexmesh.data").joinpath("traces").joinpath(SHIPPED[name])
    with resources.as_file(f) as p:
        w = read_mooncake_jsonl(p, name) if p.name.endswith(".jsonl.gz") else read_azure_csv(p, name)
    return replace(w, source=f"shipped:{SHIPPED[name]}")


def load_trace(name_or_path: str, block_tokens: int = 0) -> Workload:
    """A shipped trace by name (``azure-conv``, ``azure-code``, ``mooncake``) or a file by path: a CSV whose
    header starts with ``TIMESTAMP`` is Azure's, a JSON file holding one list ShareGPT's, a JSONL whose first
    record has ``hash_ids`` Mooncake's, any other CSV or JSONL the plain form (``block_tokens``: the plain form's
    prefix block size)."""
    if name_or_path in SHIPPED:
        return _shipped(name_or_path)
    path = Path(name_or_path)
    if not path.exists():
        what = "no such file" if path.suffix or path.parent != Path(".") else "no shipped trace or file of that name"
        raise DataError(f"unknown trace {name_or_path!r} ({what}): give one of {', '.join(SHIPPED)} or the path of a "
                        "CSV or JSONL file")
    base = path.name.removesuffix(".gz")
    if base.endswith((".jsonl", ".json")):
        if _text(path).lstrip().startswith("["):  # one JSON list: ShareGPT's conversations
            return read_sharegpt(path)
        first = next(_json_lines(path, _text(path)), (0, {}))[1]
        return read_mooncake_jsonl(path) if "hash_ids" in first else read_plain(path, block_tokens)
    if not base.endswith(".csv"):
        raise DataError(f"{path}: a trace is a .csv or .jsonl file (optionally .gz); rename it or convert it")
    head = _text(path).split("\n", 1)[0]
    return read_azure_csv(path) if head.strip().startswith("TIMESTAMP") else read_plain(path, block_tokens)


# ---- synthetic arrivals and transforms ------------------------------------------------------------
def arrival_gaps(n: int, rate: float, seed: int, burstiness: float = 1.0) -> np.ndarray:
    """``n`` gaps between arrivals at a mean ``rate`` (per second): gamma-distributed with shape
    ``burstiness`` and scale ``1 / (rate x burstiness)``, as vLLM's serving benchmark draws them
    (``benchmarks/benchmark_serving.py --burstiness``): 1 is a Poisson process, below 1 burstier.

    >>> gaps = arrival_gaps(100_000, 10.0, seed=0)
    >>> round(float(gaps.mean()), 2), round(float(gaps.std() / gaps.mean()), 1)
    (0.1, 1.0)
    >>> round(float(arrival_gaps(100_000, 10.0, seed=0, burstiness=0.25).std() * 10), 1)  # cv = 1 / sqrt(shape)
    2.0
    """
    if not (rate > 0 and math.isfinite(rate)) or not (burstiness > 0 and math.isfinite(burstiness)):
        raise DataError(f"arrivals need a positive rate and burstiness, got rate {rate} and burstiness {burstiness}")
    rng = np.random.default_rng(seed)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)


def with_arrivals(workload: Workload, rate: float, seed: int = 0, burstiness: float = 1.0,
                  n: int | None = None) -> Workload:
    """``n`` requests (default: as many as the workload has) at a mean ``rate`` with gamma-burst arrivals
    (:func:`arrival_gaps`; the first at 0), their lengths and prefix ids the workload's in order, cycled when
    ``n`` is larger (ids renumbered 0..n-1).

    >>> w = with_arrivals(load_trace("azure-code"), rate=4.0, seed=1, n=20_000)
    >>> len(w), w.requests[8819].prompt_tokens == load_trace("azure-code").requests[0].prompt_tokens
    (20000, True)
    """
    n = len(workload) if n is None else n
    if n < 1:
        raise DataError(f"synthetic arrivals need at least one request, got {n}")
    gaps = arrival_gaps(n, rate, seed, burstiness)
    times = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    src = workload.requests
    out = tuple(replace(src[i % len(src)], id=i, arrival_s=float(t)) for i, t in enumerate(times))
    kind = "poisson" if burstiness == 1.0 else f"gamma(burstiness {burstiness:g})"
    return Workload(out, f"{workload.name}@{kind} {rate:g}/s", workload.block_tokens,
                    f"{workload.source}; {kind} arrivals at {rate:g}/s, seed {seed}")


def constant_lengths(prompt_tokens: int, output_tokens: int, n: int = 1) -> Workload:
    """``n`` requests of one length, all arriving at 0 (give them arrivals with :func:`with_arrivals`)."""
    for what, v in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens), ("requests", n)):
        if not isinstance(v, int) or v < 1:
            raise DataError(f"constant lengths need whole {what} >= 1, got {v!r}")
    reqs = tuple(Request(i, 0.0, prompt_tokens, output_tokens) for i in range(n))
    return Workload(reqs, f"const:{prompt_tokens}:{output_tokens}", 0, "constant lengths")


def at_rate(workload: Workload, rate: float) -> Workload:
    """The workload with its arrival times scaled so that its mean rate is ``rate`` (same order, same gaps'
    shape: a burst stays a burst)."""
    if not (rate > 0 and math.isfinite(rate)):
        raise DataError(f"a request rate must be a positive number per second, got {rate}")
    if workload.rate <= 0:
        raise DataError(f"workload {workload.name!r} has no duration to scale (all its requests arrive at once); "
                        "give it arrivals first (synthetic arrivals at a rate)")
    factor = workload.rate / rate
    reqs = tuple(replace(r, arrival_s=r.arrival_s * factor) for r in workload.requests)
    return replace(workload, requests=reqs, name=f"{workload.name.split('@x')[0]}@x{rate / workload.rate:.4g}")


def window(workload: Workload, start_s: float = 0.0, end_s: float = math.inf, first: int | None = None) -> Workload:
    """The requests arriving in ``[start_s, end_s)`` (then at most the ``first`` of them), their arrivals
    re-based so that ``start_s`` is 0."""
    if not (start_s >= 0 and end_s > start_s):
        raise DataError(f"a window needs 0 <= start < end, got {start_s} and {end_s}")
    reqs = [r for r in workload.requests if start_s <= r.arrival_s < end_s][:first]
    if not reqs:
        raise DataError(f"no request of {workload.name!r} arrives in [{start_s:g}, {end_s:g}) s; its arrivals span "
                        f"0..{workload.requests[-1].arrival_s:.1f} s")
    out = tuple(replace(r, arrival_s=r.arrival_s - start_s) for r in reqs)
    return replace(workload, requests=out, name=f"{workload.name}[{start_s:g}:{end_s:g}]")


def scale_to_context(workload: Workload, context: int) -> Workload:
    """Prompt and output lengths scaled by one factor so that the longest request (prompt + output) fits in
    ``context`` tokens (each at least 1; the workload as it is when everything fits). Prefix block sizes
    scale with the prompts.

    >>> w = scale_to_context(load_trace("azure-conv"), 4096)
    >>> w.max_total_tokens <= 4096, w.requests[0].prompt_tokens
    (True, 108)
    """
    if context < 2:
        raise DataError(f"a context of {context} tokens holds no prompt and output; give at least 2")
    longest = workload.max_total_tokens
    if longest <= context:
        return workload
    f = context / longest

    def scaled(r: Request) -> Request:
        p = max(1, int(r.prompt_tokens * f))
        o = max(1, min(int(r.output_tokens * f), context - p))
        b = tuple(max(1, min(int(x * f), context - p)) for x in r.branch_tokens)
        return replace(r, prompt_tokens=p, output_tokens=o, branch_tokens=b)

    blocks = max(1, round(workload.block_tokens * f)) if workload.block_tokens else 0
    return replace(workload, requests=tuple(scaled(r) for r in workload.requests), block_tokens=blocks,
                   name=f"{workload.name} scaled to {context}")


def with_branches(workload: Workload, branches: int, needed: int, seed: int = 0) -> Workload:
    """Every request sampling ``branches`` answers of which ``needed`` are wanted (test-time scaling), each
    branch's output length drawn from the workload's own output lengths (a generator seeded by ``seed`` and the
    request's id: every run draws the same); the request's ``output_tokens`` becomes the longest branch's.

    >>> w = with_branches(window(load_trace("azure-conv"), first=10), branches=8, needed=2)
    >>> r = w.requests[0]
    >>> r.branches, r.needed, len(r.branch_tokens), r.output_tokens == max(r.branch_tokens)
    (8, 2, 8, True)
    """
    if not 1 <= needed <= branches:
        raise DataError(f"test-time scaling needs 1 <= needed <= branches, got {needed} of {branches}")
    pool = np.array([r.output_tokens for r in workload.requests])
    out = []
    for r in workload.requests:
        rng = np.random.default_rng([seed, r.id])
        lengths = tuple(int(x) for x in rng.choice(pool, size=branches))
        out.append(replace(r, output_tokens=max(lengths), branches=branches, needed=needed, branch_tokens=lengths))
    return replace(workload, requests=tuple(out), name=f"{workload.name} x{branches} need {needed}")
