"""Requests classed by length: the one classing that a plan's buckets and its router share.

A request's class is its prompt's interval among ``prompt_edges`` (ascending; ``k`` edges make ``k + 1``
intervals, the last unbounded) crossed with its output's among ``output_edges``: class ``i x (output intervals)
+ j``. Splitting by prompt only is what a router can do on arrival (it knows the prompt's length, not the
answer's); output edges route by the trace's output lengths, an oracle.

>>> c = LengthClasses(prompt_edges=(512, 4096), output_edges=(100,))
>>> c.classes, c.of(100, 50), c.of(100, 500), c.of(5000, 500)
(6, 0, 1, 5)
>>> c.of_each(np.array([100, 100, 5000]), np.array([50, 500, 500])).tolist()
[0, 1, 5]
>>> c.intervals()[1]
((0, 512), (100, None))
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from flexmesh.errors import SpecError


def _spans(edges: tuple[int, ...]) -> list[tuple[int, int | None]]:
    bounds: list[int | None] = [0, *edges, None]
    return [(int(bounds[i] or 0), bounds[i + 1]) for i in range(len(edges) + 1)]


@dataclass(frozen=True)
class LengthClasses:
    prompt_edges: tuple[int, ...] = ()
    output_edges: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("prompt_edges", "output_edges"):
            edges = getattr(self, name)
            if any(b <= a for a, b in zip(edges, edges[1:])) or any(e < 1 for e in edges):
                raise SpecError(f"{name.replace('_', ' ')} must rise from >= 1, got {list(edges)}")

    @property
    def classes(self) -> int:
        return (len(self.prompt_edges) + 1) * (len(self.output_edges) + 1)

    def of(self, prompt_tokens: int, output_tokens: int) -> int:
        """The class of a request of these lengths."""
        i = bisect.bisect_right(self.prompt_edges, prompt_tokens)
        j = bisect.bisect_right(self.output_edges, output_tokens)
        return i * (len(self.output_edges) + 1) + j

    def of_each(self, prompt_tokens: np.ndarray, output_tokens: np.ndarray) -> np.ndarray:
        """The class of each request (arrays of their lengths)."""
        i = np.searchsorted(self.prompt_edges, prompt_tokens, side="right")
        j = np.searchsorted(self.output_edges, output_tokens, side="right")
        return i * (len(self.output_edges) + 1) + j

    def intervals(self) -> list[tuple[tuple[int, int | None], tuple[int, int | None]]]:
        """Each class's ``(prompt [lo, hi), output [lo, hi))``, in class order (hi None: unbounded)."""
        return [(p, o) for p in _spans(self.prompt_edges) for o in _spans(self.output_edges)]
