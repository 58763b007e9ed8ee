"""Replica schedulers: what an engine runs each iteration beside its decodes, one registered class each.

A scheduler hands out the batched-token budget an iteration has left once the running requests that decode have
their token (:meth:`flexmesh.serve.replica.SimulatedReplica.start`): chunks for the requests part way through their
prefill, admissions from the queue. It decides; the replica does it (KV blocks, preemption, prefix-cache hits:
:meth:`~flexmesh.serve.replica.SimulatedReplica.grow`, :meth:`~flexmesh.serve.replica.SimulatedReplica.admit`,
:meth:`~flexmesh.serve.replica.SimulatedReplica.take`). Another engine's admission rule is one class registered
here (:func:`register`), as Vidur registers vLLM's, Orca's and Sarathi's.

- ``vllm``: vLLM V1's (``vllm/v1/core/sched/scheduler.py``): the running requests in prefill first, in admission
  order, each a chunk of what the budget leaves (chunked prefill), then waiting requests in queue order while the
  budget, ``max_num_seqs`` and the KV cache allow, the last one admitted chunked to the budget left.

>>> sorted(SCHEDULERS)
['vllm']
>>> scheduler("orca")
Traceback (most recent call last):
flexmesh.errors.SpecError: unknown replica scheduler 'orca'; schedulers: vllm
"""

from __future__ import annotations

from collections.abc import Callable

from flexmesh.errors import SpecError
from flexmesh.serve.replica import ReplicaScheduler, SimulatedReplica

SCHEDULERS: dict[str, Callable[[], ReplicaScheduler]] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator: the scheduler class is made (with no arguments) by :func:`scheduler` under ``name``."""

    def add(cls: type) -> type:
        SCHEDULERS[name] = cls
        return cls

    return add


def scheduler(name: str) -> ReplicaScheduler:
    """A new scheduler of the registered kind ``name``."""
    make = SCHEDULERS.get(name)
    if make is None:
        raise SpecError(f"unknown replica scheduler {name!r}; schedulers: {', '.join(sorted(SCHEDULERS))}")
    return make()


@register("vllm")
class VLLMScheduler:
    """vLLM V1's continuous batching with chunked prefill (see the module doc)."""

    def fill(self, rep: SimulatedReplica, budget: int, chunks: list[tuple[int, int]], now: float) -> int:
        for q in list(rep.prefilling.values()):
            if budget <= 0:
                break
            if q.uid not in rep.prefilling:  # preempted by one scheduled before it
                continue
            n = min(q.tokens - q.computed, budget)
            if not rep.grow(q, n):
                continue
            rep.take(q, n, chunks)
            budget -= n
        while budget > 0 and rep.has_seat():
            head = rep.waiting.peek()
            if head is None or not rep.admit(head, budget, now):
                break
            if not head.remote:  # a handed-off request computes nothing here until its KV lands
                n = min(head.tokens - head.computed, budget)
                rep.take(head, n, chunks)
                budget -= n
        return budget
