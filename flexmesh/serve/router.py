"""Routers: which replica of a pool a request goes to (new requests over the replicas that take them,
handed-off requests over the decode replicas). Deterministic: ties go to the lower replica index.

- ``round-robin``: in turn.
- ``least-work``: the least outstanding work, each replica's own estimate in seconds (tokens still to prefill
  and to decode, each at that replica's priced rate: a fast replica takes more).
- ``least-kv``: the lowest KV load (blocks in use plus those its queue will need, over its blocks).
- ``weights``: in proportion to given weights, spread evenly (smooth weighted round robin, as nginx's
  upstream balancing does).
- ``plan``: by the request's length class (:class:`~flexmesh.serve.layout.routing.RoutingTable`: prompt and
  output length edges, and per class a weight per replica, as a serving plan routes its buckets): in proportion
  to the class's weights (smooth weighted round robin per class), or, with the table's ``least-work`` policy, to
  the replica of positive weight whose work would finish first (flexmesh.schedule.dispatch, one request at a
  time).
- ``long-to-kv``: a request predicted long (its predicted mean output above the ``long_quantile`` of the
  predictions the router has seen before it) goes where KV is most plentiful (the lowest KV load), the others by
  least work: a long answer grows its KV for long, and a replica already full of it would preempt.

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
>>> from flexmesh.serve.layout.routing import RoutingTable
>>> table = RoutingTable(prompt_edges=(1000,), entry=((1, 1, 0), (0, 0, 1)))  # short: 0 and 1; long: 2
>>> by = make_router("plan", pool, table=table)
>>> [by.choose(Request(0, 0.0, p, 10)).index for p in (10, 5000, 10, 10)]
[0, 2, 1, 0]
>>> from flexmesh.serve.lengths import Oracle
>>> class K(R):
...     def __init__(self, index, work, kv): super().__init__(index, work); self.kv = kv
...     def kv_load(self): return self.kv
>>> lk = make_router("long-to-kv", [K(0, 1.0, 0.9), K(1, 2.0, 0.1)], predictor=Oracle())
>>> [lk.choose(Request(i, 0.0, 10, n)).index for i, n in enumerate([50, 40, 45, 900])]  # 900 is long
[0, 0, 0, 1]
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from flexmesh.data.requests import Request
from flexmesh.errors import SpecError
from flexmesh.schedule.dispatch import dispatch
from flexmesh.serve.layout.routing import RoutingPolicy, RoutingTable
from flexmesh.serve.lengths import LengthPredictor


class Routable(Protocol):
    index: int

    def outstanding_s(self) -> float: ...

    def kv_load(self) -> float: ...


R = TypeVar("R", bound=Routable)


class Router(Generic[R]):
    """Chooses one replica of its pool for each request (``request``: the request, for routers that read it)."""

    def __init__(self, pool: Sequence[R]):
        if not pool:
            raise SpecError("a router needs at least one replica to send requests to")
        self.pool = list(pool)

    def choose(self, request: Request | None = None) -> R:
        raise NotImplementedError


class RoundRobin(Router[R]):
    def __init__(self, pool: Sequence[R]):
        super().__init__(pool)
        self._next = 0

    def choose(self, request: Request | None = None) -> R:
        r = self.pool[self._next]
        self._next = (self._next + 1) % len(self.pool)
        return r


class LeastWork(Router[R]):
    def choose(self, request: Request | None = None) -> R:
        return min(self.pool, key=lambda r: (r.outstanding_s(), r.index))


class LeastKV(Router[R]):
    def choose(self, request: Request | None = None) -> R:
        return min(self.pool, key=lambda r: (r.kv_load(), r.index))


class Weighted(Router[R]):
    def __init__(self, pool: Sequence[R], weights: Sequence[float]):
        super().__init__(pool)
        if len(weights) != len(self.pool) or not all(w >= 0 for w in weights) or not any(w > 0 for w in weights):
            raise SpecError(f"router weights: give one weight >= 0 per replica of the pool ({len(self.pool)}), not all "
                            f"0; got {len(weights)}")
        self.weights = [float(w) for w in weights]
        self._current = [0.0] * len(self.pool)

    def choose(self, request: Request | None = None) -> R:
        return self.pool[_smooth_step(self._current, self.weights)]


def _smooth_step(current: list[float], weights: Sequence[float]) -> int:
    """One step of smooth weighted round robin: the index chosen (``current`` updated in place)."""
    total = 0.0
    for i, w in enumerate(weights):
        current[i] += w
        total += w
    best = max(range(len(weights)), key=lambda i: (current[i], -i))
    current[best] -= total
    return best


class ByLength(Router[R]):
    """The ``plan`` router: by the request's length class (:class:`RoutingTable`), over ``decode`` weights for a
    pool of decode replicas, else ``entry`` weights; a class with no replica of positive weight in the pool (or
    a table without rows for it) goes by least work."""

    def __init__(self, pool: Sequence[R], table: RoutingTable, decode: bool = False):
        super().__init__(pool)
        self.table = table
        rows = table.decode if decode else table.entry
        self.fallback: Router[R] | None = LeastWork(pool) if not rows else None
        self.members: list[list[int]] = []  # per class: positions in the pool of positive weight
        self.weights: list[list[float]] = []
        for row in rows:
            pos = [i for i, r in enumerate(self.pool) if r.index < len(row) and row[r.index] > 0]
            self.members.append(pos)
            self.weights.append([float(row[self.pool[i].index]) for i in pos])
        self._current = [[0.0] * len(m) for m in self.members]

    def choose(self, request: Request | None = None) -> R:
        if self.fallback is not None or request is None:
            return (self.fallback or LeastWork(self.pool)).choose(request)
        k = self.table.of(request.prompt_tokens, request.output_tokens)
        pos = self.members[k]
        if not pos:  # a class the table sends nowhere in this pool (none was expected): by least work
            return LeastWork(self.pool).choose(request)
        if len(pos) == 1:
            return self.pool[pos[0]]
        if self.table.policy is RoutingPolicy.WEIGHTS:
            return self.pool[pos[_smooth_step(self._current[k], self.weights[k])]]
        # The seconds this request adds to each one's finish: its work left, and this request's own where the
        # replica prices it (request_s); the one dispatch places the one item.
        costs = np.array([[self.pool[i].outstanding_s() + _request_s(self.pool[i], request)] for i in pos])
        return self.pool[pos[int(dispatch(costs)[0])]]


def _request_s(replica: object, request: Request) -> float:
    price = getattr(replica, "request_s", None)
    return float(price(request.prompt_tokens, request.output_tokens)) if price is not None else 0.0


class LongToKV(Router[R]):
    """``long-to-kv``: long requests (by ``predictor``) to the lowest KV load, the others by least work."""

    def __init__(self, pool: Sequence[R], predictor: LengthPredictor, context: int = 2**31 - 1,
                 long_quantile: float = 0.75):
        super().__init__(pool)
        if not 0 < long_quantile < 1:
            raise SpecError(f"the long-to-kv router's quantile is in (0, 1), got {long_quantile}")
        self.predictor, self.context, self.q = predictor, context, long_quantile
        self.seen: list[float] = []  # predicted means so far, sorted

    def is_long(self, request: Request) -> bool:
        mean = self.predictor.predict(request, max(self.context - request.prompt_tokens, 1)).mean()
        seen = self.seen
        long = bool(seen) and mean > seen[min(int(self.q * len(seen)), len(seen) - 1)]
        bisect.insort(seen, mean)
        return long

    def choose(self, request: Request | None = None) -> R:
        if request is not None and self.is_long(request):
            return min(self.pool, key=lambda r: (r.kv_load(), r.index))
        return min(self.pool, key=lambda r: (r.outstanding_s(), r.index))


@dataclass(frozen=True)
class RouterArgs:
    """What a router may read beside its pool: the weights router's ``weights``, the plan router's ``table`` (over
    its ``decode`` rows for a pool of decode replicas), the length predictor and the model's context."""

    weights: Sequence[float] | None = None
    table: RoutingTable | None = None
    decode: bool = False
    predictor: LengthPredictor | None = None
    context: int = 2**31 - 1


def _weighted(pool: Sequence[R], a: RouterArgs) -> Router[R]:
    if a.weights is None:
        raise SpecError("the weights router needs weights, one per replica (--weights 2,1,1)")
    return Weighted(pool, a.weights)


def _by_length(pool: Sequence[R], a: RouterArgs) -> Router[R]:
    if a.table is None:
        raise SpecError("the plan router needs a routing table (a serving plan's buckets and weights)")
    return ByLength(pool, a.table, a.decode)


def _long_to_kv(pool: Sequence[R], a: RouterArgs) -> Router[R]:
    if a.predictor is None:
        raise SpecError("the long-to-kv router reads predicted lengths; give a length predictor (--predictor)")
    return LongToKV(pool, a.predictor, a.context)


# The routers (module doc), each made from its pool and what it may read.
ROUTERS: dict[str, Callable[[Sequence[Any], RouterArgs], Router[Any]]] = {
    "round-robin": lambda pool, a: RoundRobin(pool),
    "least-work": lambda pool, a: LeastWork(pool),
    "least-kv": lambda pool, a: LeastKV(pool),
    "weights": _weighted,
    "plan": _by_length,
    "long-to-kv": _long_to_kv,
}


def make_router(name: str, pool: Sequence[R], weights: Sequence[float] | None = None,
                table: RoutingTable | None = None, decode: bool = False, predictor: LengthPredictor | None = None,
                context: int = 2**31 - 1) -> Router[R]:
    make = ROUTERS.get(name)
    if make is None:
        raise SpecError(f"unknown router {name!r}; routers: {', '.join(ROUTERS)}")
    return make(pool, RouterArgs(weights, table, decode, predictor, context))
