"""Routers: which replica of a pool a request goes to (new requests over the replicas that take them,
handed-off requests over the decode replicas). Deterministic: ties go to the lower replica index.

- ``round-robin``: in turn.
- ``least-work``: the least outstanding work, each replica's own estimate in seconds (tokens still to prefill
  and to decode, each at that replica's priced rate: a fast replica takes more).
- ``least-kv``: the lowest KV load (blocks in use plus those its queue will need, over its blocks).
- ``weights``: in proportion to given weights, spread evenly (smooth weighted round robin, as nginx's
  upstream balancing does).

>>> class R:
...     def __init__(self, index, work): self.index, self.work = index, work
...     def outstanding_s(self): return self.work
...     def kv_load(self): return 0.0
>>> pool = [R(0, 3.0), R(1, 1.0), R(2, 1.0)]
>>> rr = make_router("round-robin", pool); [rr.choose().index for _ in range(4)]
[0, 1, 2, 0]
>>> make_router("least-work", pool).choose().index
1
>>> w = make_router("weights", pool, weights=(2, 1, 1)); [w.choose().index for _ in range(4)]
[0, 1, 2, 0]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from flexmesh.errors import SpecError


class Routable(Protocol):
    index: int

    def outstanding_s(self) -> float: ...

    def kv_load(self) -> float: ...


R = TypeVar("R", bound=Routable)


class Router(Generic[R]):
    """Chooses one replica of its pool for each request."""

    def __init__(self, pool: Sequence[R]):
        if not pool:
            raise SpecError("a router needs at least one replica to send requests to")
        self.pool = list(pool)

    def choose(self) -> R:
        raise NotImplementedError


class RoundRobin(Router[R]):
    def __init__(self, pool: Sequence[R]):
        super().__init__(pool)
        self._next = 0

    def choose(self) -> R:
        r = self.pool[self._next]
        self._next = (self._next + 1) % len(self.pool)
        return r


class LeastWork(Router[R]):
    def choose(self) -> R:
        return min(self.pool, key=lambda r: (r.outstanding_s(), r.index))


class LeastKV(Router[R]):
    def choose(self) -> R:
        return min(self.pool, key=lambda r: (r.kv_load(), r.index))


class Weighted(Router[R]):
    def __init__(self, pool: Sequence[R], weights: Sequence[float]):
        super().__init__(pool)
        if len(weights) != len(self.pool) or not all(w >= 0 for w in weights) or not any(w > 0 for w in weights):
            raise SpecError(f"router weights: give one weight >= 0 per replica of the pool ({len(self.pool)}), not all "
                            f"0; got {len(weights)}")
        self.weights = [float(w) for w in weights]
        self._current = [0.0] * len(self.pool)

    def choose(self) -> R:
        total = 0.0
        for i, w in enumerate(self.weights):
            self._current[i] += w
            total += w
        best = max(range(len(self.pool)), key=lambda i: (self._current[i], -i))
        self._current[best] -= total
        return self.pool[best]


ROUTERS = ("round-robin", "least-work", "least-kv", "weights")


def make_router(name: str, pool: Sequence[R], weights: Sequence[float] | None = None) -> Router[R]:
    if name == "round-robin":
        return RoundRobin(pool)
    if name == "least-work":
        return LeastWork(pool)
    if name == "least-kv":
        return LeastKV(pool)
    if name == "weights":
        if weights is None:
            raise SpecError("the weights router needs weights, one per replica (--weights 2,1,1)")
        return Weighted(pool, weights)
    raise SpecError(f"unknown router {name!r}; routers: {', '.join(ROUTERS)}")
