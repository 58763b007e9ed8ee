"""Queue policies: the order in which a replica admits its waiting requests.

A replica keeps its waiting requests in a :class:`QueuePolicy` and admits from its head while the batch and
the KV cache have room (head-of-line: a head that does not fit blocks the rest, as vLLM's FCFS does). New
arrivals are pushed; a preempted request is pushed back to the front, to resume first (vLLM v1). A
length-aware policy (shortest job first, TIE's expected length plus tail) is another implementation of the
same four methods, ordering by what it predicts of each request, and registers in :data:`QUEUES`.

>>> q = FCFS(); q.push("a"); q.push("b"); q.push_front("x")
>>> q.pop(), q.peek(), len(q)
('x', 'a', 2)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class QueuePolicy(Protocol[T]):
    def push(self, item: T) -> None: ...  # an arrival

    def push_front(self, item: T) -> None: ...  # a preempted request: resumes first

    def peek(self) -> T | None: ...  # the next to admit, None when empty

    def pop(self) -> T: ...

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

    def __len__(self) -> int:
        return len(self._q)


# Queue policies by name (the command line's --queue).
QUEUES: dict[str, Callable[[], QueuePolicy]] = {"fcfs": FCFS}
