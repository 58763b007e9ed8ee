"""Replica schedulers: what an engine runs each iteration beside its decodes, one registered class each.

A scheduler hands out the batched-token budget an iteration has left once the running requests that decode have
their token (:meth:`flexmesh.serve.replica.SimulatedReplica.start`): chunks for the requests part way through their
prefill, admissions from the queue. It decides; the replica does it (KV blocks, preemption, prefix-cache hits:
:meth:`~flexmesh.serve.replica.SimulatedReplica.grow`, :meth:`~flexmesh.serve.replica.SimulatedReplica.admit`,
:meth:`~flexmesh.serve.replica.SimulatedReplica.take`). Another engine's admission rule is one class registered
here (:func:`register`), as Vidur registers vLLM's, Orca's and Sarathi's.

Four built in, by what an engine does (:mod:`flexmesh.serve.layout.engine` names one for each preset):

- ``mixed-chunked``: vLLM V1's (``vllm/v1/core/sched/scheduler.py``): the decodes have their token, then the running
  requests in prefill, in admission order, each a chunk of what the budget leaves (chunked prefill), then waiting
  requests in queue order while the budget, ``max_num_seqs`` and the KV cache allow, the last one admitted chunked
  to the budget left;
- ``mixed-whole``: the same order with prompts never cut (TensorRT-LLM's in-flight batching without chunked
  context): a prompt is admitted when it fits the budget left, or alone when it is longer than the whole budget;
- ``prefill-first-whole``: vLLM V0's default: whenever a waiting request can be admitted the iteration runs prompts
  only, whole, the decodes waiting (``vllm/core/scheduler.py`` ``_schedule_default``);
- ``prefill-first-chunked``: SGLang's: a prefill batch whenever one can be formed, its prompts cut to the budget,
  the decodes waiting (``sglang/srt/managers/scheduler.py`` ``get_next_batch_to_run``).

A scheduler's ``prefill_first`` (False if absent) tells the replica to pause its decodes in an iteration the
scheduler gave prompts to.

>>> sorted(SCHEDULERS)
['mixed-chunked', 'mixed-whole', 'prefill-first-chunked', 'prefill-first-whole']
>>> scheduler("orca")  # doctest: +ELLIPSIS
Traceback (most recent call last):
flexmesh.errors.SpecError: unknown replica scheduler 'orca'; schedulers: mixed-chunked, mixed-whole, ...
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


class Batching:
    """Decodes first, then prompts in the budget left (see the module doc); ``chunked``: cut to fit."""

    chunked = True
    prefill_first = False

    def portion(self, need: int, budget: int, alone: bool) -> int:
        """Tokens a prompt with ``need`` left computes now in ``budget`` (0: it waits); ``alone``: nothing else of
        the iteration's prompts scheduled yet."""
        if self.chunked:
            return min(need, budget)
        return need if need <= budget or alone else 0

    def fill(self, rep: SimulatedReplica, budget: int, chunks: list[tuple[int, int]], now: float) -> int:
        for q in list(rep.prefilling.values()):
            if budget <= 0:
                break
            if q.uid not in rep.prefilling:  # preempted by one scheduled before it
                continue
            n = self.portion(q.tokens - q.computed, budget, not chunks)
            if n == 0:
                break
            if not rep.grow(q, n):
                continue
            rep.take(q, n, chunks)
            budget -= n
        while budget > 0 and rep.has_seat():
            head = rep.waiting.peek()
            if head is None:
                break
            n = head.tokens - head.computed if head.remote else self.portion(head.tokens - head.computed, budget,
                                                                               not chunks)
            room = max(n, budget)  # the budget, or a whole prompt longer than it that runs alone
            if n == 0 or not rep.admit(head, room, now):
                break
            if not head.remote:  # a handed-off request computes nothing here until its KV lands
                n = self.portion(head.tokens - head.computed, room, not chunks)  # after prefix hits
                rep.take(head, n, chunks)
                budget -= n
        return budget


@register("mixed-chunked")
class MixedChunked(Batching):
    """vLLM V1's continuous batching with chunked prefill."""


@register("mixed-whole")
class MixedWhole(Batching):
    """In-flight batching of whole prompts (TensorRT-LLM without chunked context)."""

    chunked = False


@register("prefill-first-whole")
class PrefillFirstWhole(Batching):
    """vLLM V0's default: whole prompts in iterations of their own."""

    chunked = False
    prefill_first = True


@register("prefill-first-chunked")
class PrefillFirstChunked(Batching):
    """SGLang's: chunked prompts in iterations of their own."""

    prefill_first = True
