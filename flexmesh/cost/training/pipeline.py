"""Closed forms of a pipeline: step time of equal micro-batches and micro-batches in flight.

Sources (Narayanan et al., Megatron-LM, 2104.04473):

- step time: sum of stage times + (m - 1) x the slowest stage for 1F1B and GPipe; the interleaved
  schedule divides the fill and drain by the number of chunks ``v``;
- in-flight micro-batches on pipeline rank r: 1F1B ``pp - r``, GPipe all ``m``, interleaved
  Megatron's warm-up count ``(pp - r - 1) * 2 + (v - 1) * pp + 1`` chunks.

>>> [in_flight("1f1b", 4, r, m=8) for r in range(4)]
[4.0, 3.0, 2.0, 1.0]
"""

from __future__ import annotations

import numpy as np


def in_flight(pipeline_schedule: str, pp: int, rank: int, m: int, v: int = 1) -> float:
    """Micro-batches (in units of a whole stage's activations) held at the peak on pipeline rank ``rank``.

    >>> in_flight("interleaved", 4, 0, m=8, v=2)  # 11 chunks of half a stage
    5.5
    """
    if pipeline_schedule == "gpipe":
        return float(m)
    if pipeline_schedule == "1f1b":
        return float(min(pp - rank, m))
    if pipeline_schedule == "interleaved":
        chunks = min(m * v, (pp - rank - 1) * 2 + (v - 1) * pp + 1)
        return chunks / v
    raise ValueError(f"unknown pipeline schedule {pipeline_schedule!r}")


def pipeline_time(pipeline_schedule: str, rank_times, m: int, v: int = 1) -> float:
    """Step time of ``m`` equal micro-batches through ranks taking ``rank_times`` each (fwd + bwd).

    >>> pipeline_time("1f1b", [1.0, 1.0, 1.0, 1.0], m=8)  # 8 + 3 bubbles
    11.0
    >>> pipeline_time("interleaved", [1.0, 1.0, 1.0, 1.0], m=8, v=2)
    9.5
    """
    return float(pipeline_times(pipeline_schedule, rank_times, m, v))


def pipeline_times(pipeline_schedule: str, rank_times, m: int, v: int = 1) -> np.ndarray:
    """:func:`pipeline_time` for many candidates at once: ``rank_times`` has shape (candidates, ranks).

    >>> pipeline_times("1f1b", [[1.0, 1.0], [1.0, 2.0]], m=4).tolist()
    [5.0, 9.0]
    """
    t = np.asarray(rank_times, dtype=float)
    if pipeline_schedule in ("1f1b", "gpipe"):
        return t.sum(axis=-1) + (m - 1) * t.max(axis=-1)
    if pipeline_schedule == "interleaved":
        mx = t.max(axis=-1)
        return m * mx + (t.sum(axis=-1) - mx) / v
    raise ValueError(f"unknown pipeline schedule {pipeline_schedule!r}")
