"""A workload as a serving plan sees it: length buckets, each with its share of the requests and its lengths.

A bucket is one class of :class:`~flexmesh.serve.layout.classes.LengthClasses` (an interval of prompt lengths
crossed with an interval of output lengths: Mélange's request-size buckets) with the statistics the planner
prices it by: its share of the requests, its mean prompt and output (its throughput), the prompt and output at
the attainment quantile (its latency) and its longest request (what a replica's KV cache must hold).
:mod:`flexmesh.serve.plan.workload` makes them from a trace or by hand.

>>> b = RequestBuckets((1024,), (), (Bucket((0, 1024), (0, None), 0.75, 400.0, 200.0, 900, 420, 1700),
...                                  Bucket((1024, None), (0, None), 0.25, 2500.0, 250.0, 3800, 500, 4800)))
>>> b.of(300, 20), b.longest, b.buckets[1].label
(0, 4800, '1024+')
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flexmesh.errors import SpecError
from flexmesh.serve.layout.classes import LengthClasses


@dataclass(frozen=True)
class Bucket:
    """Requests of prompt lengths in ``prompt`` and outputs in ``output`` (``[lo, hi)``; hi None: unbounded)."""

    prompt: tuple[int, int | None]
    output: tuple[int, int | None]
    share: float  # of the workload's requests
    prompt_mean: float
    output_mean: float
    prompt_high: int  # the prompt length at the attainment quantile: latency is judged there
    output_high: int
    longest: int  # the most tokens (prompt + output) one of its requests holds
    context_rms: float = 0.0  # root mean square of prompt + output / 2 (a request's mean KV): 0 for its mean

    @property
    def context(self) -> float:
        """A request's mean context while it decodes: its prompt and half its output."""
        return self.prompt_mean + self.output_mean / 2

    @property
    def context_spread(self) -> float:
        """The root mean square of the contexts (what a sum of a random number of them varies with)."""
        return max(self.context_rms, self.context)

    @property
    def label(self) -> str:
        def span(lo: int, hi: int | None) -> str:
            return f"{lo}+" if hi is None else f"{lo}-{hi}"
        out = "" if self.output == (0, None) else f" x {span(*self.output)} out"
        return f"{span(*self.prompt)}{out}"


@dataclass(frozen=True)
class RequestBuckets(LengthClasses):
    """The buckets of a workload: one per length class, in class order."""

    buckets: tuple[Bucket, ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.buckets) != self.classes:
            raise SpecError(f"{len(self.buckets)} buckets for {len(self.prompt_edges)} prompt edges and "
                            f"{len(self.output_edges)} output edges; give one per class")
        total = sum(b.share for b in self.buckets)
        if not math.isclose(total, 1.0, rel_tol=1e-6):
            raise SpecError(f"bucket shares sum to {total:g}; they are fractions of the requests and sum to 1")

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def longest(self) -> int:
        return max(b.longest for b in self.buckets if b.share > 0)
