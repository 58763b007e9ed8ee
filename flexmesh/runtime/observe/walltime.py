"""Where a run's wall time went: named phases summed, and one line that lists them with the rest.

>>> w = WallTime(start=0.0)
>>> w.add("model build", 2.0); w.add("steps", 5.0); w.add("steps", 1.0)
>>> w.line(total=10.0)
'wall time 10.0 s: model build 2.0 s, steps 6.0 s, other 2.0 s'
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def since_process_start() -> float:
    """Seconds since this process started (Linux's /proc: the interpreter's start-up and imports
    included); 0.0 where /proc does not say."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: start time in ticks
    except (OSError, ValueError, IndexError):
        return 0.0


class WallTime:
    """Seconds per named phase since ``start`` (a ``time.perf_counter()`` reading; default: when this
    process started)."""

    def __init__(self, start: float | None = None) -> None:
        self.start = time.perf_counter() - since_process_start() if start is None else start
        self.phases: dict[str, float] = {}
        self.finished = False  # set by whoever runs the phases to their end (a stopped run prints no summary)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def line(self, total: float | None = None) -> str:
        """``wall time T s: phase s, ..., other s`` (``total``: default, the time since ``start``)."""
        total = time.perf_counter() - self.start if total is None else total
        parts = [f"{name} {s:.1f} s" for name, s in self.phases.items()]
        return f"wall time {total:.1f} s: " + ", ".join([*parts, f"other {total - sum(self.phases.values()):.1f} s"])
