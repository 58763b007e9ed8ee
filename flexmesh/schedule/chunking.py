"""``chunked``: InfiniPipe-style chunking of long sequences into slices run in order on one group.

With a pipeline a group's time is the sum of its micro-batches plus ``(pp - 1)`` times the largest
one (fill and drain), so one long sequence in one micro-batch makes a long bubble. Here sequences
are first placed on groups as in ``hdp``; then within each group every sequence longer than the
chunk budget ``tau`` (seconds) is cut into ``k = ceil(t / tau)`` slices of equal *time*. A slice
``[a, b)`` attends to its whole prefix, so it costs ``ctx.microbatch_time(d, b - a, b^2 - a^2)``: later
slices hold fewer tokens. Short sequences then fill the room beside the tail slices (the last,
shortest slice of each sequence; never two tails together) and new micro-batches of about ``tau``.

Equal-time cut points: with ``F(x)`` the cost of the prefix ``[0, x)`` less the fixed micro-batch
cost, by the cost model's lower envelope (linear in tokens and squared tokens, so a slice costs
``F(b) - F(a)``), cut ``j`` of ``k`` solves ``F(a_j) = j / k * F(L)``; ``F`` is increasing, so a
vectorised bisection finds all cuts at once.

Example: a 64K-token sequence whose attention dominates, in 4 slices, gets cuts near
``64K * sqrt(j / 4)``: 32K, 45K, 55K tokens, i.e. slices of 32K, 13K, 10K and 9K tokens.

Order: each sequence's slices run in order and back to back on their group (a slice needs the
previous slices' keys and values). Under a pipeline the micro-batches a cut sequence links form a
unit that runs its forwards in order and its backwards in reverse (flexmesh.layout.pipeline_order),
so a unit holds all its activations like GPipe; every micro-batch of a pipelined step also takes the
longest one's shape. Both are priced (flexmesh.schedule.assemble.group_time), and the slice time is
chosen per step among a few candidates, whole sequences included, by that price.

Where it runs. The runtime trains slices exactly as the whole sequence by carrying the earlier
slices' keys and values (flexmesh.runtime.model.carry), with or without a pipeline, not with dynamic RoPE
scaling (flexmesh.layout.step.carries_pieces; ``ctx.cut_documents`` off: whole sequences packed into
micro-batches of about ``tau``). With ``pp = 1`` there is no bubble to shrink: the slices bound the
tokens of each micro-batch, while the whole chain's activations stay held until its one backward.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.errors import ScheduleError
from flexmesh.layout.step import Piece, StepSchedule
from flexmesh.schedule.assemble import aligned_layout, build_step_schedule
from flexmesh.schedule.assign import place
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.hdp import hdp_layout
from flexmesh.schedule.lower_bound import lower_bound, seq_times
from flexmesh.schedule.placement import Batch


def fixed_time(ctx: ScheduleContext, d: int) -> float:
    """A micro-batch's fixed cost on ``d`` ranks, taken at one token: a cost model may charge any
    non-empty micro-batch costs (kernel launches) that an empty one lacks, so the time at zero tokens
    is not the limit from above, and cuts measured from it would put all of a slice's fixed cost in
    its first token."""
    return float(ctx.microbatch_time(d, 1.0, float(ctx.cost.attention_sq(0.0, 1.0))))


def equal_time_cuts(ctx: ScheduleContext, d: int, length: int, k: int) -> list[int]:
    """Cut points ``0 = a_0 < a_1 < ... < a_k = length`` giving ``k`` slices of equal time on ``d`` ranks.

    Equal by the cost model's lower envelope (:meth:`ScheduleContext.envelope`), whose times are linear
    in tokens and squared tokens, so a slice ``[a, b)`` costs exactly ``F(b) - F(a)`` and the bisection
    is exact; the model's own times differ from it by kernel tile and wave steps, which no cut can
    even out.
    """
    if k <= 1 or length <= 1:
        return [0, length]
    ctx = ctx.envelope()
    c = fixed_time(ctx, d)

    def prefix(x: np.ndarray) -> np.ndarray:
        return np.asarray(ctx.microbatch_time(d, x, ctx.cost.attention_sq(0.0, x)), dtype=float) - c

    goal = prefix(np.array([float(length)]))[0] * np.arange(1, k) / k
    lo, hi = np.zeros(k - 1), np.full(k - 1, float(length))
    for _ in range(60):  # bisection to well below one token
        mid = 0.5 * (lo + hi)
        below = prefix(mid) < goal
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
        if (hi - lo).max() < 0.25:
            break
    cuts = np.clip(np.rint(hi).astype(np.int64), 1, length - 1)
    cuts = np.maximum.accumulate(cuts)
    return [0, *sorted(set(int(x) for x in cuts)), length]


def _slices(ctx: ScheduleContext, d: int, length: int, t_alone: float, tau: float, cap: int) -> list[tuple[int, int]]:
    """Equal-time slices of about ``tau`` seconds, more of them while one would exceed ``cap`` tokens."""
    k = max(1, math.ceil(t_alone / tau))
    while True:
        cuts = equal_time_cuts(ctx, d, length, k)
        spans = list(zip(cuts[:-1], cuts[1:], strict=True))
        if max(b - a for a, b in spans) <= cap or k >= length:
            return spans
        k += 1


def chunked_schedule(lengths: ArrayLike, ctx: ScheduleContext, *, seed: int = 0,
                     chunk_time: float | None = None, slice_tokens: int | None = None,
                     cp: int | None = None) -> StepSchedule:
    """Place as ``hdp``, then cut long sequences into equal-time slices of about ``chunk_time`` seconds
    (whole sequences unless ``ctx.cut_documents``).

    ``chunk_time`` by default is chosen per step: the lower bound divided by ``2 * pp`` (enough
    micro-batches per group that the ``(pp - 1)`` fill and drain cost at most about half a
    micro-batch per stage); under a pipeline also twice and four times that, each with sequences cut
    and whole, priced as they run (group_time: the unit order of cut documents, every micro-batch of
    the step padded to the longest; by ``ctx.price``, the step simulator, where set), the fastest
    kept: cutting only where it pays.

    ``slice_tokens``: fixed-size slicing instead (Seq1F1B, 2406.03488, the baseline InfiniPipe
    compares with): every sequence longer than that cut into slices of equal *tokens*, short ones
    packed as above into micro-batches of about the default chunk time.

    Groups: ``hdp``'s sizes; under a pipeline (cutting on, nothing fixed) also every static size
    over all data ranks, priced alike, and on those each group's sequences streamed into full
    micro-batches of 1, 1/2, 1/4 and 1/8 of what a group holds (:func:`stream_pack`): a pipelined
    step runs one shape, and cutting is what lets small micro-batches (a short fill and drain) go
    unpadded. ``cp``: one static size only.
    """
    t0 = time.perf_counter()
    batch = Batch.of(lengths, ctx)
    lens = batch.lens
    if chunk_time is not None and chunk_time <= 0:
        raise ScheduleError(f"chunk_time must be > 0 seconds, got {chunk_time}")
    if slice_tokens is not None and slice_tokens < 1:
        raise ScheduleError(f"slice_tokens must be a positive number of tokens, got {slice_tokens}")
    if cp is not None and (cp not in ctx.group_sizes or not ctx.cut_documents and batch.need.max() > cp):
        raise ScheduleError(f"a static group of {cp} ranks is not one of {list(ctx.group_sizes)} or holds not "
                            "every sequence whole; choose another --cp")
    lb = lower_bound(lens, ctx)
    tau = lb / (2 * ctx.pp)
    # Candidates only under a pipeline with cutting on: without one, slices bound memory, which a
    # price in time cannot see, so the first candidate stands.
    explore = ctx.pp > 1 and ctx.cut_documents
    free = explore and chunk_time is None and slice_tokens is None and cp is None
    layouts = [_layout(batch, ctx, cp)] + ([_layout(batch, ctx, d) for d in ctx.group_sizes] if free else [])
    options = [(float(chunk_time) if chunk_time is not None else tau, ctx.cut_documents)]
    if explore and chunk_time is None and slice_tokens is None:
        options += [(x, cut) for x in (tau, 2 * tau, 4 * tau) for cut in (True, False)][1:]
    times = seq_times(lens, ctx)
    made = [_chunked(batch, ctx, times, slots, placement, x, cut, t0, slice_tokens)
            for d, slots, placement in layouts for x, cut in options if cut or d is None or batch.need.max() <= d]
    if free:  # full micro-batches of one shape, of a few sizes
        made += [_streamed(batch, ctx, slots, placement, share, t0)
                 for d, slots, placement in layouts if d is not None for share in (1, 2, 4, 8)]
    price = ctx.price
    best = min(made, key=(lambda s: price(ctx, s)) if price is not None else (lambda s: s.predicted_step_time))
    return replace(best, scheduler_seconds=time.perf_counter() - t0)


def stream_pack(ids: list[int], lens: np.ndarray, tokens: int) -> list[list[Piece]]:
    """Micro-batches of ``tokens`` tokens from the sequences ``ids``, a sequence cut where it crosses
    a boundary, so that micro-batches of one shape need almost no padding.

    A pipeline runs every micro-batch of a step at one shape, so whole sequences of mixed lengths
    either pad small micro-batches up to the longest sequence or need large ones (a long fill and
    drain); cutting lets small micro-batches pack full. Longest first; the longest that does not fit
    runs on into the next micro-batch, which is then filled with whole sequences (the shortest once
    the longest does not fit) and closed without a cut, so a unit of linked micro-batches spans two
    (more only where one sequence is longer than a micro-batch).

    >>> lens = np.array([10, 7, 3, 2, 2])
    >>> [[(p.seq_id, p.start, p.end) for p in mb] for mb in stream_pack([0, 1, 2, 3, 4], lens, 8)]
    [[(0, 0, 8)], [(0, 8, 10), (4, 0, 2), (3, 0, 2)], [(1, 0, 7), (2, 0, 1)], [(2, 1, 3)]]
    """
    order = sorted(ids, key=lambda i: (-int(lens[i]), i))
    front, back = 0, len(order) - 1
    mbs: list[list[Piece]] = []
    carry: tuple[int, int] | None = None  # (sequence, start) running on into the next micro-batch
    while front <= back or carry is not None:
        mb: list[Piece] = []
        room, cut_in = tokens, carry is not None
        if carry is not None:
            i, a = carry
            b = min(int(lens[i]), a + room)
            mb.append(Piece(i, a, b))
            room -= b - a
            carry = (i, b) if b < int(lens[i]) else None
        while carry is None and room > 0 and front <= back:
            i = order[front]
            if int(lens[i]) <= room:  # the longest left fits whole
                mb.append(Piece(i, 0, int(lens[i])))
                room -= int(lens[i])
                front += 1
            elif not cut_in:  # it runs on into the next micro-batch
                mb.append(Piece(i, 0, room))
                carry, room = (i, room), 0
                front += 1
            elif int(lens[order[back]]) <= room:  # after a cut: the shortest left, whole
                mb.append(Piece(order[back], 0, int(lens[order[back]])))
                room -= int(lens[order[back]])
                back -= 1
            else:
                break
        mbs.append(mb)
    return mbs


def _streamed(batch: Batch, ctx: ScheduleContext, slots: list, placement, share: int, t0: float) -> StepSchedule:
    """Every group's sequences streamed into micro-batches of ``1 / share`` of what the smallest
    group holds (:func:`stream_pack`): one size on every group, as a pipelined step runs one shape."""
    size = max(1, min(ctx.max_tokens(slot.size) for slot in slots) // share)
    mbs_all = [stream_pack(list(mem), batch.lens, size) for mem in placement.members]
    return build_step_schedule("chunked", batch.lens, ctx, slots, mbs_all, t0,
                               extra={"cut": True, "packed_tokens": size})


def _layout(batch: Batch, ctx: ScheduleContext, cp: int | None) -> tuple[int | None, list, object]:
    """(static size or None, slots, placement): hdp's group sizes, or groups of ``cp`` ranks each
    (slices bound a cut sequence's micro-batches to what such a group holds)."""
    if cp is None:
        sizes, target = hdp_layout(batch, ctx)
    else:
        sizes, target = [cp] * (ctx.num_ranks // cp), np.full(batch.lens.size, cp)
    slots = aligned_layout(sizes, ctx.num_ranks)
    return cp, slots, place(batch, ctx, slots, target)


def _chunked(batch: Batch, ctx: ScheduleContext, times: dict, slots: list, placement, tau: float, cut: bool,
             t0: float, slice_tokens: int | None = None) -> StepSchedule:
    """:func:`chunked_schedule` with slice time ``tau`` on a placement, cutting sequences or not
    (into equal-time slices, or of ``slice_tokens`` tokens each); ``times``: seq_times of the batch
    alone (what a slice and its tail cost; placement uses the packed loads)."""
    lens = batch.lens
    mbs_all = []
    for slot, mem in zip(slots, placement.members, strict=True):
        d, cap = slot.size, ctx.max_tokens(slot.size)
        t = times[d]
        c = fixed_time(ctx, d)
        ordered = sorted(mem, key=lambda i: (-t[i], i))
        is_long = ((t > tau) if slice_tokens is None else (lens > slice_tokens)) | (cut & (lens > cap))
        long_ids = [i for i in ordered if is_long[i]]
        short_ids = [i for i in ordered if not is_long[i]]
        mbs: list[list[Piece]] = []
        room: list[tuple[float, int, int]] = []  # (time left, tokens left, micro-batch index) beside a tail
        for i in long_ids:
            if not cut:
                spans = [(0, int(lens[i]))]
            elif slice_tokens is not None:
                k = max(-(-int(lens[i]) // slice_tokens), -(-int(lens[i]) // cap))
                edges = [int(lens[i]) * j // k for j in range(k + 1)]
                spans = list(zip(edges[:-1], edges[1:]))
            else:
                spans = _slices(ctx, d, int(lens[i]), float(t[i]), tau, cap)
            for a, b in spans:
                mbs.append([Piece(int(i), a, b)])
            a, b = spans[-1]
            t_tail = float(ctx.microbatch_time(d, b - a, ctx.cost.attention_sq(float(a), float(b))))
            room.append((tau - t_tail, cap - (b - a), len(mbs) - 1))
        # Short sequences, longest first, beside a tail with room, else into ~tau micro-batches.
        fresh: list[tuple[float, int, int]] = []
        for i in short_ids:
            ti, li = float(t[i]) - c, int(lens[i])
            placed = False
            for pool in (room, fresh):
                for q, (tl, kl, m) in enumerate(pool):
                    if ti <= tl and li <= kl:
                        mbs[m].append(Piece(int(i), 0, li))
                        pool[q] = (tl - ti, kl - li, m)
                        placed = True
                        break
                if placed:
                    break
            if not placed:
                mbs.append([Piece(int(i), 0, li)])
                fresh.append((tau - float(t[i]), cap - li, len(mbs) - 1))
        mbs_all.append(mbs)
    return build_step_schedule("chunked", lens, ctx, slots, mbs_all, t0,
                               extra={"chunk_time": tau, "cut": cut,
                                      **({"slice_tokens": slice_tokens} if slice_tokens is not None else {})})
