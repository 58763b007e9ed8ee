"""Shares of a whole: a step's sequences over replica groups in proportion to weights (speeds, FLOP/s).

Largest remainder: every part gets one, the rest is split in proportion and the parts with the
largest fractions take what rounding leaves (lowest index first on ties). The one rule wherever a
batch is split by weight: the proportional baseline, a migration to a slower device, a plan given
another global batch.

>>> split_by_weight(8, [1.0, 0.25]), split_by_weight(4, [1.0, 1.0]), split_by_weight(3, [1.0, 0.01])
([6, 2], [2, 2], [2, 1])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from flexmesh.errors import PlanError


def split_by_weight(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` units over ``len(weights)`` parts, at least one each, the rest in proportion to the weights."""
    n = len(weights)
    if n < 1 or total < n:
        raise PlanError(f"{total} cannot be split over {n} parts of at least one each")
    spare = total - n
    exact = [spare * w / sum(weights) for w in weights]
    out = [1 + math.floor(x) for x in exact]
    for i in sorted(range(n), key=lambda i: exact[i] - math.floor(exact[i]), reverse=True)[:total - sum(out)]:
        out[i] += 1
    return out
