"""Service-level objectives: the latency bounds a request should meet.

Every time carries its unit (``ms`` or ``s``): a bare number is refused, since vLLM's ``--goodput tpot:100`` reads
milliseconds where flexmesh once read seconds. A bound no engine's latency is near (:data:`PLAUSIBLE`) is
questioned (:func:`doubts`): ``tpot=100s`` is likely ``tpot=100ms``.

>>> parse_slo("ttft=0.5s, tpot=50ms")
SLO(ttft_s=0.5, tpot_s=0.05, e2e_s=None)
>>> parse_slo("tpot=100")  # doctest: +ELLIPSIS
Traceback (most recent call last):
flexmesh.errors.FlexmeshError: SLO 'tpot=100' gives no unit: write tpot=100ms or tpot=100s (vLLM's --goodput ...
>>> doubts(parse_slo("ttft=1s,tpot=100s"))
['tpot 100 s: a token every 100 s is not a serving target; did you mean tpot=100ms?']
>>> str(SLO(ttft_s=0.25, tpot_s=0.05))
'ttft <= 250 ms, tpot <= 50 ms'
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from flexmesh.errors import FlexmeshError


@dataclass(frozen=True)
class SLO:
    """Upper bounds (seconds) a request must meet; None: no bound on that metric."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __str__(self) -> str:
        parts = [f"{k.removesuffix('_s')} <= {v * 1e3:g} ms" for k, v in asdict(self).items() if v is not None]
        return ", ".join(parts) or "none"


_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*(ms|s)?\s*$")
# Bounds (seconds) beyond which a serving target is doubtful: the fastest TTFT and TPOT an engine reaches
# (sub-millisecond kernels are not whole iterations) and the slowest a person waits (a token a second is 60 words
# a minute, slower than reading; ten minutes for a first token, an hour for an answer).
PLAUSIBLE = {"ttft_s": (1e-3, 600.0), "tpot_s": (1e-3, 1.0), "e2e_s": (1e-3, 3600.0)}


def parse_slo(text: str) -> SLO:
    """``ttft=500ms,tpot=50ms,e2e=20s``: each bound with its unit, ``ms`` or ``s``."""
    bounds: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        m = _DURATION.match(value)
        if not eq or key not in ("ttft", "tpot", "e2e") or m is None:
            raise FlexmeshError(f"SLO {part!r} is not METRIC=TIME; write e.g. ttft=500ms,tpot=50ms (metrics ttft, "
                                "tpot, e2e; times in s or ms)")
        if m.group(2) is None:
            raise FlexmeshError(f"SLO {part!r} gives no unit: write {key}={m.group(1)}ms or {key}={m.group(1)}s "
                                "(vLLM's --goodput reads a bare number as milliseconds)")
        seconds = float(m.group(1)) * (1e-3 if m.group(2) == "ms" else 1.0)
        if not (seconds > 0 and math.isfinite(seconds)):
            raise FlexmeshError(f"SLO {part!r}: a bound must be a finite time above 0 (leave a metric out to bound "
                                "nothing)")
        if f"{key}_s" in bounds:
            raise FlexmeshError(f"SLO names {key} twice ({text!r}); give each metric once")
        bounds[f"{key}_s"] = seconds
    if not bounds:
        raise FlexmeshError(f"SLO {text!r} names no bound; write e.g. ttft=500ms,tpot=50ms")
    return SLO(**bounds)


def doubts(slo: SLO) -> list[str]:
    """What in ``slo`` no serving target is near (outside :data:`PLAUSIBLE`), each with the likely meant bound."""
    out = []
    for key, (lo, hi) in PLAUSIBLE.items():
        v = getattr(slo, key)
        if v is None or lo <= v <= hi:
            continue
        name = key.removesuffix("_s")
        if v > hi:
            what = {"ttft_s": f"a first token after {v:g} s", "tpot_s": f"a token every {v:g} s",
                    "e2e_s": f"an answer after {v:g} s"}[key]
            out.append(f"{name} {v:g} s: {what} is not a serving target; did you mean {name}={v:g}ms?")
        else:
            out.append(f"{name} {v * 1e3:g} ms: faster than any engine's iteration; did you mean {name}={v * 1e3:g}s?")
    return out
