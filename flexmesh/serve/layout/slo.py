"""Service-level objectives: the latency bounds a request should meet.

>>> parse_slo("ttft=0.5, tpot=50ms")
SLO(ttft_s=0.5, tpot_s=0.05, e2e_s=None)
>>> str(SLO(ttft_s=0.25, tpot_s=0.05))
'ttft <= 250 ms, tpot <= 50 ms'
"""

from __future__ import annotations

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


def parse_slo(text: str) -> SLO:
    """``ttft=0.5,tpot=50ms,e2e=20s``: bounds in seconds, or with ``ms`` / ``s``.

    >>> parse_slo("ttft=0.5, tpot=50ms")
    SLO(ttft_s=0.5, tpot_s=0.05, e2e_s=None)
    """
    bounds: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip().lower()
        m = _DURATION.match(value)
        if not eq or key not in ("ttft", "tpot", "e2e") or m is None:
            raise FlexmeshError(f"SLO {part!r} is not METRIC=TIME; write e.g. ttft=0.5,tpot=50ms (metrics ttft, tpot, "
                                "e2e; times in s or ms)")
        seconds = float(m.group(1)) * (1e-3 if m.group(2) == "ms" else 1.0)
        if not seconds > 0:
            raise FlexmeshError(f"SLO {part!r}: a bound must be above 0")
        if key in bounds:
            raise FlexmeshError(f"SLO names {key} twice")
        bounds[f"{key}_s"] = seconds
    if not bounds:
        raise FlexmeshError(f"SLO {text!r} names no bound; write e.g. ttft=0.5,tpot=50ms")
    return SLO(**bounds)
