"""Queue policies: the order in which a replica admits its waiting requests -- the same objects in the simulator
(each simulated replica's queue) and in flexmesh's router (the requests it holds for each engine until the engine
has room: :mod:`flexmesh.serve.engine.router`).

A queue holds items that carry their request (``item.r``, a :class:`~flexmesh.data.requests.Request`). The
replica admits from its head while the batch and the KV cache have room (head-of-line: a head that does not fit
blocks the rest, as vLLM's scheduler does). New arrivals are pushed; a preempted request is pushed back to the
front, to resume first (vLLM v1); a request no longer wanted (a branch of a test-time-scaling request once enough
have finished) is removed.

- ``fcfs``: first come, first served.
- ``sjf``: shortest job first on a point prediction: the predicted output length (its mean; the oracle's is the
  true length).
- ``tie``: TIE's score (Zheng et al., arXiv 2604.00499, Eq. 11-12; constants from its public code):
  ``E[L] + beta * CVaR_0.9[L]`` of the predicted log-t length censored at the request's cap, with
  ``beta = min(0.5, max(0.1, 0.1 * waiting / max_seqs))`` taken when the request joins: the longer the queue,
  the more a long tail costs.

Aging (TIE's starvation guard, shared by ``sjf`` and ``tie``): a request that has waited ``w`` seconds is ranked by
``score * gamma ** (w / tau)`` (gamma 0.9, tau 30 s). Every waiting request ages at the same rate, so the order is
that of ``log score - (arrival_s / tau) * log gamma``, a key fixed when the request joins: a heap, no re-sorting.
Nothing starves: a score is at most ``(1 + 0.5) * cap``, so a request that has waited long enough ranks before
every later arrival.

>>> from flexmesh.data.requests import Request
>>> from flexmesh.serve.lengths import Oracle
>>> class Item:
...     def __init__(self, r): self.r = r
>>> q = make_queue("sjf", Oracle(), max_seqs=8, context=4096)
>>> for i, (t, n) in enumerate([(0.0, 500), (0.1, 20), (0.2, 80)]):
...     q.push(Item(Request(i, t, 10, n)))
>>> [q.pop().r.output_tokens for _ in range(3)]
[20, 80, 500]
>>> old, new = Item(Request(0, 0.0, 10, 500)), Item(Request(1, 1000.0, 10, 20))  # 1000 s of waiting outranks
>>> q.push(new); q.push(old); q.peek() is old
True
>>> f = FCFS(); f.push("a"); f.push("b"); f.push_front("x")
>>> f.pop(), f.peek(), len(f)
('x', 'a', 2)
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from flexmesh.errors import SpecError
from flexmesh.serve.lengths import ALPHA, LengthPredictor, OutputLength

T = TypeVar("T")

# TIE's starvation guard (its public code: STARVATION_GAMMA, STARVATION_TAU): score x gamma ** (waited / tau).
AGING_GAMMA = 0.9
AGING_TAU_S = 30.0
# TIE's beta: min(BETA_MAX, max(BETA_MIN, BETA_SLOPE * waiting / max_seqs)) (its paper's Eq. 12).
BETA_MIN, BETA_MAX, BETA_SLOPE = 0.1, 0.5, 0.1


class QueuePolicy(Protocol[T]):
    def push(self, item: T) -> None: ...  # an arrival

    def push_front(self, item: T) -> None: ...  # a preempted request: resumes first

    def peek(self) -> T | None: ...  # the next to admit, None when empty

    def pop(self) -> T: ...

    def remove(self, item: T) -> bool: ...  # no longer wanted: False when it was not queued

    def __len__(self) -> int: ...


class FCFS(Generic[T]):
    """First come, first served."""

    def __init__(self) -> None:
        self._q: deque[T] = deque()

    def push(self, item: T) -> None:
        self._q.append(item)

    def push_front(self, item: T) -> None:
        self._q.appendleft(item)

    def peek(self) -> T | None:
        return self._q[0] if self._q else None

    def pop(self) -> T:
        return self._q.popleft()

    def remove(self, item: T) -> bool:
        try:
            self._q.remove(item)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._q)


class Scored(Generic[T]):
    """A queue ordered by a key each item gets when it joins (lowest first; ties by joining order); items pushed
    to the front come first, in the order pushed there. Removal is lazy (a removed item's heap entry is skipped)."""

    def __init__(self, key: Callable[[T, int], float]):
        self.key = key  # (item, items waiting before it joins) -> its rank
        self._heap: list[tuple[float, int, Any]] = []
        self._front: deque[T] = deque()
        self._live: dict[int, T] = {}  # id(item) -> item, for the items in the heap
        self._count = itertools.count()

    def push(self, item: T) -> None:
        k = self.key(item, len(self))
        self._live[id(item)] = item
        heapq.heappush(self._heap, (k, next(self._count), item))

    def push_front(self, item: T) -> None:
        self._front.appendleft(item)

    def _clean(self) -> None:
        while self._heap and id(self._heap[0][2]) not in self._live:
            heapq.heappop(self._heap)

    def peek(self) -> T | None:
        if self._front:
            return self._front[0]
        self._clean()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> T:
        if self._front:
            return self._front.popleft()
        self._clean()
        item = heapq.heappop(self._heap)[2]
        del self._live[id(item)]
        return item

    def remove(self, item: T) -> bool:
        if self._live.pop(id(item), None) is not None:
            return True
        try:
            self._front.remove(item)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._front) + len(self._live)


def aged(score: float, arrival_s: float) -> float:
    """The fixed rank of a request of ``score`` that arrived at ``arrival_s``: ordering by it is ordering by
    ``score * AGING_GAMMA ** (waited / AGING_TAU_S)`` at any one moment."""
    return math.log(max(score, 1e-9)) - arrival_s / AGING_TAU_S * math.log(AGING_GAMMA)


def tie_beta(waiting: int, max_seqs: int) -> float:
    """TIE's weight of the tail, from the queue's length and the engine's running batch (``max_seqs``).

    >>> tie_beta(0, 32), tie_beta(64, 32), tie_beta(1000, 32)
    (0.1, 0.2, 0.5)
    """
    return min(BETA_MAX, max(BETA_MIN, BETA_SLOPE * waiting / max(max_seqs, 1)))


def tie_score(length: OutputLength, waiting: int, max_seqs: int) -> float:
    """``E[L] + beta * CVaR_0.9[L]``."""
    return length.mean() + tie_beta(waiting, max_seqs) * length.cvar(ALPHA)


def _sjf(length: Callable[[Any], OutputLength], max_seqs: int, aging: bool) -> Callable[[Any, int], float]:
    def key(item: Any, waiting: int) -> float:
        score = length(item).mean()
        return aged(score, item.r.arrival_s) if aging else score
    return key


def _tie(length: Callable[[Any], OutputLength], max_seqs: int, aging: bool) -> Callable[[Any, int], float]:
    def key(item: Any, waiting: int) -> float:
        score = tie_score(length(item), waiting, max_seqs)
        return aged(score, item.r.arrival_s) if aging else score
    return key


# The queue policies: FCFS, and the length-aware ones by the key that ranks a request (its predicted length, the
# queue's length, the engine's max_seqs, aging).
RANKED: dict[str, Callable[[Callable[[Any], OutputLength], int, bool], Callable[[Any, int], float]]] = {
    "sjf": _sjf, "tie": _tie}
QUEUES = ("fcfs", *RANKED)


def make_queue(name: str, predictor: LengthPredictor | None = None, max_seqs: int = 256,
               context: int = 2**31 - 1, aging: bool = True) -> QueuePolicy:
    """The queue policy ``name``; ``sjf`` and ``tie`` rank by ``predictor``'s lengths, each censored at
    ``context`` less its prompt (the most a request can generate), ``tie`` with the engine's ``max_seqs``."""
    if name == "fcfs":
        return FCFS()
    ranked = RANKED.get(name)
    if ranked is None:
        raise SpecError(f"unknown queue policy {name!r}; policies: {', '.join(QUEUES)}")
    if predictor is None:
        raise SpecError(f"the {name} queue ranks requests by a predicted output length; give a length predictor "
                        "(oracle, noisy, prompt)")
    p = predictor

    def length(item: Any) -> OutputLength:
        r = item.r
        return p.predict(r, max(context - r.prompt_tokens, 1))

    return Scored(ranked(length, max_seqs, aging))
