"""What one engine iteration costs: the interface every inference pricing implements.

An iteration (one forward pass of a continuous-batching engine, as vLLM v1 schedules it) computes, for each
request in its batch, some new tokens on top of the tokens already in that request's KV cache. A decode
step is ``(context, 1)``, a prefill chunk ``(prefix, chunk)``: prefix hits, chunked prefill and decoding are
one thing, and the iteration is priced as a whole (weights are read once per iteration, not per request).

:class:`IterationTiming` is the contract (``flexmesh.cost.inference.analytic.AnalyticIteration`` prices it
from the device layer; an engine profile prices it from measurements). A simulator that runs millions of
decode steps asks the equivalent :meth:`SplitTiming.split_s` with the decoding requests summed, which an
implementation may answer in constant time; :func:`split_s` falls back on ``iteration_s`` for one that does
not, giving every decode the mean context (exact for any timing linear in the decodes' contexts, as reading
their KV is). A timing may also offer ``decode_run_s(decodes, decode_context, steps)``, the seconds of that
many decode-only iterations in a row (each adding ``decodes`` to the context), which the simulator then uses
to run such stretches at once (``AnalyticIteration`` has it in closed form): :class:`RunTiming`. A timing of a
real engine measured (an engine profile) may also name what the engine's loop costs beyond its batches'
prices: :class:`LoopTiming` (a GPU engine's price has none).

>>> class PerToken:
...     def iteration_s(self, batch):
...         return 1e-3 + sum(1e-6 * ctx + 1e-5 * new for ctx, new in batch)
>>> round(split_s(PerToken(), 4, 4000, [(0, 100)]) * 1e3, 3)  # 1 ms + 4 decodes + a 100-token chunk
6.04
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class IterationTiming(Protocol):
    """Seconds of one engine iteration over ``batch``: ``(tokens already in the KV cache, tokens computed now)``
    per request, everything the iteration does included (GEMMs, attention, collectives, engine overhead)."""

    def iteration_s(self, batch: Sequence[tuple[int, int]]) -> float: ...


@runtime_checkable
class SplitTiming(Protocol):
    """:meth:`IterationTiming.iteration_s` with the batch given as ``decodes`` requests computing one token each
    over ``decode_context`` KV tokens in all, beside ``chunks`` that compute more than one."""

    def split_s(self, decodes: int, decode_context: int, chunks: Sequence[tuple[int, int]]) -> float: ...


@runtime_checkable
class RunTiming(Protocol):
    """Seconds of ``steps`` decode-only iterations in a row from ``decode_context`` (each adds ``growth`` to it,
    ``decodes`` when not given)."""

    def decode_run_s(self, decodes: int, decode_context: int, steps: int, growth: float | None = None) -> float: ...


@dataclass(frozen=True)
class EngineLoop:
    """What a real engine's loop costs beyond the price of its batches, as an engine profile measures it
    (flexmesh.profile.iteration): the first iteration after the loop idled ``idle_gap_s`` or more costs ``1 +
    after_idle`` times its price (cold caches); a busy engine's HTTP thread takes ``intake_s`` per request it takes
    in and ``answer_s`` per request it answers from the loop, which waits for it; a request reaches the engine's
    batch ``admission_s`` after the router received it (the hop, the parsing, the queue hand-off)."""

    after_idle: float = 0.0
    idle_gap_s: float = 0.0
    intake_s: float = 0.0
    answer_s: float = 0.0
    admission_s: float = 0.0


@runtime_checkable
class LoopTiming(Protocol):
    """A timing that names its engine's loop costs."""

    @property
    def loop(self) -> EngineLoop: ...


def split_s(timing: IterationTiming, decodes: int, decode_context: int, chunks: Sequence[tuple[int, int]]) -> float:
    """The seconds of an iteration of ``decodes`` decode steps over ``decode_context`` KV tokens in all, and
    ``chunks``: the timing's own :meth:`SplitTiming.split_s` where it has one, else its ``iteration_s`` with
    every decode at the mean context."""
    if isinstance(timing, SplitTiming):
        return timing.split_s(decodes, decode_context, chunks)
    if decodes == 0:
        return timing.iteration_s(list(chunks))
    mean, extra = divmod(decode_context, decodes)
    batch = [(mean + 1, 1)] * extra + [(mean, 1)] * (decodes - extra)
    return timing.iteration_s(batch + list(chunks))
