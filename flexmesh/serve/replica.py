"""One replica's engine, simulated iteration by iteration as vLLM's V1 engine schedules (continuous batching).

One state per request (:class:`Req`): the tokens known (prompt and outputs so far) and the tokens computed
into the KV cache. Chunked prefill, prefix hits and decoding are one thing: an iteration gives each request
some of its uncomputed tokens, and a request whose tokens are all computed samples one more. Each iteration
(:meth:`SimulatedReplica.start`):

1. the running requests that decode (one token each) get the KV blocks they need; where the cache has no
   room, the most recently admitted running request is preempted (its KV dropped, to be recomputed; it
   resumes first);
2. the replica's scheduler (:mod:`flexmesh.serve.schedulers`: vLLM's the first) hands out the batched-token
   budget left: chunks for the requests in prefill, admissions from the queue. The replica does what it asks
   (:meth:`SimulatedReplica.grow`, :meth:`~SimulatedReplica.admit`, :meth:`~SimulatedReplica.take`): KV blocks
   allocated, preempting where the cache has no room; a prefix-cache hit skips the whole cached blocks of a
   prompt (the last token always computed). An engine that reserves a request's whole prompt (``admit_whole``:
   vLLM's default since 2026) admits one only where the free blocks hold all its known tokens, not just the chunk
   it computes first, so a long prompt waits instead of being admitted, then preempted part-way.

The batch is priced by the replica's declared timing (:class:`ReplicaTiming`: its iteration price, decode-only
runs at once where the price offers them, its engine's loop costs) as a whole; an iteration that starts after the
replica idled at least ``idle_gap_s`` costs ``1 + after_idle`` times that (an engine profile's: a real engine's
loop that slept resumes on cold caches). Every request that reaches a busy replica and every request it finishes
adds the loop's ``intake_s`` and ``answer_s`` to the next iteration it starts (a real engine's HTTP thread takes
requests in and answers them beside its loop, which waits for it); once the replica idles, what was left to charge
lapses (the work was done while it idled). Work outside the engine that takes its CPU (:class:`Charges`: a local
fleet's router sharing the host's cores, :mod:`flexmesh.serve.engine.twin`) is charged the same way.
Decoding requests are kept summed (their count, their contexts' sum, their next KV block boundaries by
iteration modulo the block size, their finishing iterations in a heap), so an iteration costs the
simulator constant time in them: what makes a million requests a minute possible on one core.

A model whose layers slide (:class:`~flexmesh.cost.inference.memory.KVGroups`: vLLM's hybrid KV cache) is
counted in group blocks: a request holds blocks for its whole context in the full-attention groups and for at
most the window in the sliding ones (a chunk's transient ``window - 1 + chunk`` tokens are not modelled), and its
decodes read that much. The decoding requests still short of the window are summed apart (their count, their
contexts, their block boundaries), each leaving that set in the iteration its context reaches the window (a
second heap), so the iteration's price gets the KV its decodes read (a mean over the layers) and its block
count what they take, still in constant time.

Roles: an ``aggregated`` replica serves a request start to end; a ``prefill`` replica stops after the first
token and holds the KV until a decode replica has fetched it (:meth:`release_held`); a ``decode`` replica
admits a handed-off request once it has room for its KV, then waits for the transfer before decoding it.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from flexmesh.cost.inference.memory import FULL_ATTENTION, KVGroups
from flexmesh.cost.inference.timing import EngineLoop
from flexmesh.data.requests import Request
from flexmesh.serve.kv import KVBlocks
from flexmesh.serve.layout.knobs import EngineKnobs
from flexmesh.serve.layout.roles import Role
from flexmesh.serve.queues import QueuePolicy

Price = Callable[[int, int, Sequence[tuple[int, int]]], float]
RunPrice = Callable[..., float]  # (decodes, decode_context, steps[, growth])


@dataclass(frozen=True)
class ReplicaTiming:
    """What a replica's iterations cost: ``price(decodes, decode_context, chunks)`` of one iteration
    (:func:`flexmesh.cost.inference.timing.split_s`'s form), ``run_price(decodes, decode_context, steps, growth)`` of
    that many decode-only iterations in a row where the timing prices them at once (None: one by one; ``growth`` the
    context each adds, ``decodes`` when not given), and its engine's loop costs (none for a price of GPU kernels)."""

    price: Price
    run_price: RunPrice | None = None
    loop: EngineLoop = field(default_factory=EngineLoop)


class Charges(Protocol):
    """Seconds of work outside a replica's engine that its next iteration pays, when ``q`` reaches it and when
    ``q`` is answered (a local fleet's router taking the host's cores: flexmesh.serve.engine.twin)."""

    def arrival_s(self, rep: SimulatedReplica, q: Req, now: float) -> float: ...

    def answer_s(self, rep: SimulatedReplica, q: Req, now: float) -> float: ...


class ReplicaScheduler(Protocol):
    """What a replica runs each iteration beside its decodes (flexmesh.serve.schedulers): hands out ``budget``
    tokens (chunks appended to ``chunks``, through the replica's :meth:`~SimulatedReplica.grow`,
    :meth:`~SimulatedReplica.admit` and :meth:`~SimulatedReplica.take`) and returns what is left."""

    def fill(self, rep: SimulatedReplica, budget: int, chunks: list[tuple[int, int]], now: float) -> int: ...


class Req:
    """A request's state inside a replica (and across the hand-off of prefill/decode disaggregation)."""

    __slots__ = ("r", "tokens", "computed", "outputs", "target", "ids", "shared", "own", "remote", "first_token_s",
                 "replica", "decode_replica", "preemptions", "cached", "j", "c0", "o0", "key", "gen", "src",
                 "handed_s", "stage", "uid", "group", "branch", "cancelled", "low")

    def __init__(self, r: Request, target: int, ids: tuple[int, ...]):
        self.r = r
        self.tokens = r.prompt_tokens  # known: the prompt and the outputs so far
        self.computed = 0  # in the KV cache (for a decoding request: as of its joining, see c0)
        self.outputs = 0
        self.target = target  # outputs to produce on this replica
        self.ids = ids  # prefix block ids the replica may cache
        self.shared = 0  # of them, the leading ones it refers to in the prefix cache
        self.own = 0  # KV blocks of its own (outside the prefix cache)
        self.remote = False  # its KV is computed elsewhere (handed off to a decode replica)
        self.first_token_s: float | None = None
        self.replica = -1  # produced its first token
        self.decode_replica: int | None = None
        self.preemptions = 0
        self.cached = 0  # prompt tokens a prefix cache held at its first admission
        self.j = self.c0 = self.o0 = self.key = self.gen = 0  # decoding since iteration j with c0 computed, o0 out
        self.src: SimulatedReplica | None = None  # the prefill replica holding its KV until fetched
        self.handed_s = 0.0  # when it was handed to a decode replica
        self.stage = r.tier  # the model serving it here (a cascade's stage: 0 up to its tier)
        self.uid = r.id  # its key in the replica's tables (a branch has its own)
        self.group: object = None  # test-time scaling: the branches of its request (the simulator's)
        self.branch = 0
        self.cancelled = False  # dropped: no longer wanted
        self.low = False  # decoding with a context short of the model's sliding window (module doc)


class SimulatedReplica:
    """A replica's scheduler and KV cache; the simulator calls :meth:`start` and :meth:`finish` per iteration."""

    def __init__(self, index: int, role: Role, timing: ReplicaTiming, kv: KVBlocks, knobs: EngineKnobs,
                 queue: QueuePolicy, scheduler: ReplicaScheduler, rates: tuple[float, float],
                 sample_every_s: float = float("inf"), charges: Charges | None = None,
                 groups: KVGroups | None = None, admit_whole: bool = False):
        self.index, self.role, self.price, self.kv = index, role, timing.price, kv
        # the model's KV groups (module doc); ``win`` None: no layer slides, every count as without groups
        self.groups = groups or FULL_ATTENTION
        self.win = self.groups.window if self.groups.windowed else None
        self.n_full, self.n_slide, self.units = self.groups.full, self.groups.sliding, self.groups.groups
        self.admit_whole = admit_whole  # admissions wait until all of a request's known tokens fit (the engine's)
        self.run_price = timing.run_price  # decode-only iterations in a row, where the timing prices them at once
        loop = timing.loop
        self.after_idle, self.idle_gap_s = loop.after_idle, loop.idle_gap_s  # the first iteration after idling
        self.intake_s, self.answer_s = loop.intake_s, loop.answer_s  # per request taken in / finished while busy
        self.scheduler, self.charges = scheduler, charges
        # prompts in iterations of their own, the decodes paused (``paused``: the iteration running now is one)
        self.prefill_first = bool(getattr(scheduler, "prefill_first", False))
        self.paused = False
        self._ended = -math.inf  # when the last iteration ended
        self.owed = 0.0  # seconds the next iteration carries (module doc)
        self.bs = kv.block_tokens
        self.prefix_tokens = kv.prefix_tokens
        self.max_tokens, self.max_seqs = knobs.max_batched_tokens, knobs.max_seqs
        self.waiting = queue
        self.running: dict[int, Req] = {}  # admission order; decoding and in prefill
        self.prefilling: dict[int, Req] = {}  # running, computing more than one token
        self.receiving: dict[int, Req] = {}  # decode role: admitted, KV on its way
        self.ready: list[Req] = []  # KV arrived: decode from the next iteration
        self.held: dict[int, tuple[int, int]] = {}  # prefill role: (own blocks, shared ids) until fetched
        self.dec_n = self.dec_ctx = 0
        self.bucket = [0] * self.bs  # decoding requests by the iteration (mod bs) they need a new block in
        # of them, those short of the sliding window (module doc): count, contexts' sum, blocks, leaving iterations
        self.low_n = self.low_ctx = 0
        self.bucket_low = [0] * self.bs
        self.crossings: list[tuple[int, int, int, Req]] = []  # (iteration its context reaches the window, seq, gen, q)
        self.ends: list[tuple[int, int, int, Req]] = []  # (finishing iteration, seq, gen, request)
        self.sched: list[tuple[Req, int]] = []
        self.iteration = 0
        self.finishing = False  # inside finish(): the iteration's decode tokens are out
        self.deferred: list[tuple[Req, Callable[[int], None]]] = []  # cancel_later's
        self.busy = False
        self._seq = 0
        # What the simulator does with a request's outcome: (request, time)
        self.on_finish: Callable[[Req, float], None] = lambda q, t: None
        self.on_handoff: Callable[[Req, float], None] = lambda q, t: None
        self.on_fetch: Callable[[Req, float], None] = lambda q, t: None
        # For routers: tokens still to prefill and to decode, each at this replica's rate
        self.pending_prompt = self.pending_outputs = self.waiting_prompt = 0
        self.s_prefill, self.s_decode = rates  # seconds per prompt token, per decode token
        # Statistics and the timeline: (time, waiting, running, batch tokens, KV used fraction)
        self.iterations = self.preemptions = self.tokens = 0
        self.busy_s = 0.0
        self._started = 0.0
        self.samples: list[tuple[float, int, int, int, float]] = []
        self.sample_every = sample_every_s
        self._next_sample = 0.0

    # ---- what routers read ----------------------------------------------------------------------------
    @property
    def ended(self) -> float:
        """When its last iteration ended (-inf before the first)."""
        return self._ended

    def outstanding_s(self) -> float:
        return self.pending_prompt * self.s_prefill + self.pending_outputs * self.s_decode

    def request_s(self, prompt_tokens: int, output_tokens: int) -> float:
        """Seconds a request of these lengths adds to its work, at its prefill and decode rates (its role's part)."""
        if self.role == Role.PREFILL:
            return prompt_tokens * self.s_prefill
        if self.role == Role.DECODE:
            return output_tokens * self.s_decode
        return prompt_tokens * self.s_prefill + output_tokens * self.s_decode

    def kv_load(self) -> float:
        return (self.kv.used + self.waiting_prompt * self.units / self.bs) / self.kv.total

    # ---- requests in ----------------------------------------------------------------------------------
    def push(self, q: Req, now: float = 0.0) -> None:
        """A new request (or, for a decode replica, a handed-off one) joins the queue at ``now``."""
        if self.busy and self.intake_s:
            self.owed += self.intake_s
        if self.charges is not None:
            self.owed += self.charges.arrival_s(self, q, now)
        self.waiting.push(q)
        self.waiting_prompt += q.tokens
        self.pending_prompt += q.tokens - q.computed
        self.pending_outputs += q.target - q.outputs

    def kv_arrived(self, q: Req) -> None:
        """``q``'s KV has landed: it decodes from the next iteration (and, if preempted, recomputes here)."""
        del self.receiving[q.uid]
        q.remote = False
        self.ready.append(q)

    def release_held(self, q: Req) -> None:
        """A decode replica has fetched ``q``'s KV: its blocks are free (its prefix entries stay cached)."""
        own, shared = self.held.pop(q.uid)
        self.kv.release(own)
        self.kv.unref(q.ids[:shared])

    # ---- one iteration --------------------------------------------------------------------------------
    def blocks_for(self, q: Req, computed: int) -> int:
        """Own blocks ``q`` needs to hold ``computed`` tokens (its prefix entries hold the shared ones)."""
        return self.groups.blocks(computed, self.bs, q.shared * self.prefix_tokens)

    def held_context(self) -> int:
        """The KV tokens the decoding requests read, over every layer on average (their contexts' sum when no
        layer slides)."""
        return self.groups.held_sum(self.dec_ctx, self.low_n, self.low_ctx, self.dec_n)

    def _cross(self, i: int) -> None:
        """The decoding requests whose context reaches the window by iteration ``i`` leave the set short of it."""
        crossings = self.crossings
        while crossings and crossings[0][0] <= i:
            _, _, gen, q = heapq.heappop(crossings)
            if gen == q.gen and q.low:
                self._leave_low(q, q.c0 + i - q.j)

    def _leave_low(self, q: Req, computed: int) -> None:
        q.low = False
        self.low_n -= 1
        self.low_ctx -= computed
        self.bucket_low[q.key] -= 1

    def _join(self, q: Req, j: int) -> None:
        """``q`` decodes from iteration ``j``: summed with the others."""
        q.j, q.c0, q.o0 = j, q.computed, q.outputs
        q.key = (j - q.computed + q.shared * self.prefix_tokens) % self.bs
        q.gen += 1
        self.bucket[q.key] += 1
        self.dec_n += 1
        self.dec_ctx += q.computed
        self._seq += 1
        heapq.heappush(self.ends, (j + q.target - q.outputs - 1, self._seq, q.gen, q))
        if self.win is not None and q.computed < self.win:
            q.low = True
            self.low_n += 1
            self.low_ctx += q.computed
            self.bucket_low[q.key] += 1
            heapq.heappush(self.crossings, (j + self.win - q.computed, self._seq, q.gen, q))
        self.running[q.uid] = q

    def _leave_decoding(self, q: Req, computed: int) -> None:
        """Take ``q`` out of the sums with ``computed`` tokens in its KV; its state made explicit again."""
        self.dec_n -= 1
        self.dec_ctx -= computed
        self.bucket[q.key] -= 1
        if q.low:
            self._leave_low(q, computed)
        q.gen += 1
        q.outputs = q.o0 + computed - q.c0
        q.computed = computed
        q.tokens = computed + 1
        q.own = self.blocks_for(q, computed)

    def preempt(self, q: Req) -> None:
        """Drop ``q``'s KV (recompute): it goes back to the front of the queue."""
        rid = q.uid
        if rid in self.prefilling:
            del self.prefilling[rid]
        else:
            self._leave_decoding(q, q.c0 + self.iteration - q.j)
        del self.running[rid]
        self.kv.release(q.own)
        self.kv.unref(q.ids[:q.shared])
        self.pending_prompt += q.computed
        q.own = q.shared = q.computed = 0
        q.preemptions += 1
        self.preemptions += 1
        self.waiting.push_front(q)
        self.waiting_prompt += q.tokens

    def start(self, now: float) -> float | None:
        """Schedule and price the next iteration from ``now``: its end time, or None when there is nothing to
        run (the replica idles until a request arrives or a transfer lands)."""
        i, bs = self.iteration, self.bs
        if self.ready:
            for q in self.ready:
                self._join(q, i)
            self.ready.clear()
        if self.crossings:
            self._cross(i)
        self.sched.clear()
        chunks: list[tuple[int, int]] = []
        self.paused = False
        if self.prefill_first and (self.prefilling or len(self.waiting)):  # prompts alone, if any can run
            left = self.scheduler.fill(self, self.max_tokens, chunks, now)
            self.paused = bool(self.sched)
        if self.paused:
            tokens = self.max_tokens - left
            decodes = context = 0
        else:
            # 1. the decoding requests' new blocks
            need = self.bucket[i % bs] if self.win is None else self._need(i % bs)
            if need:
                kv = self.kv
                while need and not kv.can_allocate(need):
                    self.preempt(next(reversed(self.running.values())))
                    need = self.bucket[i % bs] if self.win is None else self._need(i % bs)
                if need:
                    kv.allocate(need)
            tokens = self.dec_n
            if not self.prefill_first and (self.prefilling or len(self.waiting)):
                tokens = self.max_tokens - self.scheduler.fill(self, self.max_tokens - self.dec_n, chunks, now)
            decodes, context = self.dec_n, self.held_context()
        if now >= self._next_sample or (tokens == 0 and self.samples and self.samples[-1][3] != 0):
            self._sample(now, tokens)
        if tokens == 0:
            self.busy = False
            self.owed = 0.0
            return None
        self.busy = True
        self._started = now
        self.tokens += tokens
        took = self.price(decodes, context, chunks)
        if self.after_idle and now - self._ended >= self.idle_gap_s:
            took *= 1.0 + self.after_idle
        if self.owed:
            took += self.owed
            self.owed = 0.0
        return now + took

    def _need(self, key: int) -> int:
        """Group blocks the decodes of an iteration at ``key`` (mod bs) take, when layers slide."""
        return self.n_full * self.bucket[key] + self.n_slide * self.bucket_low[key]

    def coast(self, now: float, limit: float) -> float:
        """Run, at once, the decode-only iterations that end before ``limit`` (the next event elsewhere) and
        finish no request: nothing else can happen meanwhile, so only their sums change. The time they end
        (``now`` when there are none). Needs a timing that prices runs of them (``run_price``)."""
        if (self.run_price is None or not self.dec_n or self.prefilling or self.ready or self.receiving
                or len(self.waiting) or self.owed):
            return now
        ends = self.ends
        while ends and ends[0][2] != ends[0][3].gen:
            heapq.heappop(ends)
        i, b = self.iteration, self.dec_n
        steps = ends[0][0] - i if ends else 0  # iterations before one finishes a request
        run: RunPrice = self.run_price
        ctx = self.dec_ctx
        if self.win is not None:  # no request may reach the window meanwhile; the KV read grows by the decodes'
            crossings = self.crossings  # mean over the layers
            while crossings and (crossings[0][2] != crossings[0][3].gen or not crossings[0][3].low):
                heapq.heappop(crossings)
            if crossings:
                steps = min(steps, crossings[0][0] - i)
            ctx = self.held_context()
            run = functools.partial(run, growth=self.groups.held_step(b, self.low_n))
        limit = min(limit, self._next_sample)
        if steps < 2 or limit <= now:
            return now
        first, two = run(b, ctx, 1), run(b, ctx, 2)
        slope = two - 2 * first  # each iteration's time grows by this much (its context grows by b)
        room = limit - now
        if slope > 0:
            k = int((-(first - slope / 2) + math.sqrt((first - slope / 2) ** 2 + 2 * slope * room)) / slope)
        else:
            k = int(room / first)
        k = min(k, steps)
        while k > 0 and not now + run(b, ctx, k) < limit:
            k -= 1
        if k < 2:
            return now
        bs, bucket = self.bs, self.bucket
        cycles, rest = divmod(k, bs)
        need = cycles * b + sum(bucket[(i + m) % bs] for m in range(rest))  # a block each per bs iterations
        if self.win is not None:
            low = self.bucket_low
            need = self.n_full * need + self.n_slide * (cycles * self.low_n + sum(low[(i + m) % bs]
                                                                                 for m in range(rest)))
        if need and not self.kv.can_allocate(need):
            return now
        if need:
            self.kv.allocate(need)
        took = run(b, ctx, k)
        self.dec_ctx += b * k
        self.low_ctx += self.low_n * k
        self.pending_outputs -= b * k
        self.iteration += k
        self.iterations += k
        self.tokens += b * k
        self.busy_s += took
        self._ended = now + took
        return now + took

    # ---- what a scheduler asks (flexmesh.serve.schedulers) -------------------------------------------------
    def has_seat(self) -> bool:
        """Whether another request may run (``max_seqs``, handed-off ones receiving their KV included)."""
        return len(self.running) + len(self.receiving) < self.max_seqs

    def grow(self, q: Req, n: int) -> bool:
        """KV blocks for ``n`` more tokens of ``q``, in prefill; where the cache has no room, the most recently
        admitted request in prefill is preempted, until there is room or ``q`` itself was (False: it no longer
        runs)."""
        kv = self.kv
        extra = self.blocks_for(q, q.computed + n) - q.own
        while extra > 0 and not kv.can_allocate(extra):
            victim = next(reversed(self.prefilling.values()))
            self.preempt(victim)
            if victim is q:
                break
        if q.uid not in self.prefilling:
            return False
        if extra > 0:
            kv.allocate(extra)
            q.own += extra
        return True

    def take(self, q: Req, n: int, chunks: list[tuple[int, int]]) -> None:
        """``q`` computes ``n`` tokens this iteration (its blocks held)."""
        chunks.append((q.computed, n))
        self.sched.append((q, n))

    def admit(self, q: Req, budget: int, now: float) -> bool:
        """Admit the queue's head if the KV cache has room for what it computes now, or with ``admit_whole`` for
        all its known tokens (vLLM's reservation: :meth:`KVGroups.reserve`; False: it waits)."""
        kv = self.kv
        if q.remote:  # a handed-off request: room for the KV it will receive
            assert now >= q.handed_s, "a decode replica admitted a request before it was handed off"
            blocks = self.groups.blocks(q.computed, self.bs)
            if not kv.can_allocate(blocks):
                return False
            self.waiting.pop()
            self.waiting_prompt -= q.tokens
            kv.allocate(blocks)
            q.own = blocks
            self.receiving[q.uid] = q
            self.on_fetch(q, now)
            return True
        hit = 0
        if q.ids:
            hit = min(kv.lookup(q.ids), (q.tokens - 1) // self.prefix_tokens)
        computed = hit * self.prefix_tokens
        n = min(q.tokens - computed, budget)
        blocks = self.groups.blocks(computed + n, self.bs, computed)
        need = blocks
        if self.admit_whole:
            need = max(blocks, self.groups.reserve(q.tokens, self.bs, computed, self.max_tokens))
        idle_hits = sum(1 for i in q.ids[:hit] if kv.refs[i] == 0)
        if not kv.can_allocate(need + idle_hits * kv.entry_blocks):
            return False
        self.waiting.pop()
        self.waiting_prompt -= q.tokens
        kv.acquire(q.ids[:hit])
        kv.allocate(blocks)
        if q.ids:
            kv.lookups += len(q.ids)
            kv.hits += hit
        q.shared, q.own, q.computed = hit, blocks, computed
        if q.preemptions == 0:
            q.cached = computed
        self.pending_prompt -= computed
        self.running[q.uid] = q
        self.prefilling[q.uid] = q
        return True

    def finish(self, now: float) -> None:
        """The iteration started last ends at ``now``: tokens computed, tokens sampled, requests done."""
        i = self.iteration
        self.finishing = True
        if self.deferred:  # cancellations asked for during the last outcome land after this iteration's tokens
            pending, self.deferred = self.deferred, []
            for q, done in pending:
                done(q.outputs if q.cancelled else self.cancel(q))
        self.iterations += 1
        self.busy_s += now - self._started
        self.busy = False
        self._ended = now
        paused = self.paused
        if not paused:
            self.dec_ctx += self.dec_n
            self.low_ctx += self.low_n
            self.pending_outputs -= self.dec_n
        ends = self.ends
        while not paused and ends and ends[0][0] <= i:
            _, _, gen, q = heapq.heappop(ends)
            if gen != q.gen:  # left the decoding set (preempted) after this entry was made
                continue
            self._leave_decoding(q, q.c0 + i - q.j + 1)
            del self.running[q.uid]
            self._done(q, now)
        for q, n in self.sched:
            if q.cancelled:  # a branch dropped earlier in this iteration's outcome
                continue
            q.computed += n
            self.pending_prompt -= n
            if q.computed < q.tokens:
                continue
            q.outputs += 1  # all its tokens computed: it samples the next
            q.tokens += 1
            self.pending_outputs -= 1
            if q.first_token_s is None:
                q.first_token_s = now
                q.replica = self.index
            if q.ids and self.prefix_tokens:
                whole = min(len(q.ids), q.r.prompt_tokens // self.prefix_tokens)
                if whole > q.shared:
                    self.kv.insert(q.ids[:whole], q.shared)  # their blocks move from its own to the cache
                    q.shared = whole
                    q.own = self.blocks_for(q, q.computed)
            del self.prefilling[q.uid]
            if q.outputs < q.target:
                self._join(q, i if paused else i + 1)  # a paused iteration does not move the decodes' count
            else:
                del self.running[q.uid]
                self._done(q, now)
        self.iteration = i if paused else i + 1
        self.paused = self.finishing = False

    def cancel_later(self, q: Req, done: Callable[[int], None]) -> None:
        """Cancel ``q`` once the next iteration has run (a cancellation that reaches the engine while it runs one
        more: the router's hop); ``done(tokens it had generated)`` then."""
        self.deferred.append((q, done))

    def cancel(self, q: Req) -> int:
        """Drop ``q`` wherever it is here (queued, in prefill or decoding; a branch no longer wanted): its KV
        freed, nothing more computed for it. The output tokens it had generated."""
        q.cancelled = True
        uid = q.uid
        if uid not in self.running:
            if self.waiting.remove(q):
                self.waiting_prompt -= q.tokens
                self.pending_prompt -= q.tokens - q.computed
                self.pending_outputs -= q.target - q.outputs
            return q.outputs
        if uid in self.prefilling:
            del self.prefilling[uid]
            self.pending_prompt -= q.tokens - q.computed
        else:  # decoding: its tokens so far, this iteration's included while its outcome is being handed out
            self._leave_decoding(q, q.c0 + self.iteration - q.j + (1 if self.finishing and not self.paused else 0))
        del self.running[uid]
        self.pending_outputs -= q.target - q.outputs
        self.kv.release(q.own)
        self.kv.unref(q.ids[:q.shared])
        q.own = q.shared = 0
        return q.outputs

    def _done(self, q: Req, now: float) -> None:
        """``q`` produced its outputs here: finished, or (a prefill replica's) handed off with its KV held."""
        if self.role == Role.PREFILL and q.outputs < q.r.output_tokens:
            self.held[q.uid] = (q.own, q.shared)
            self.on_handoff(q, now)
            return
        self.kv.release(q.own)
        self.kv.unref(q.ids[:q.shared])
        if self.answer_s:
            self.owed += self.answer_s
        if self.charges is not None:
            self.owed += self.charges.answer_s(self, q, now)
        self.on_finish(q, now)

    def _sample(self, now: float, tokens: int) -> None:
        self.samples.append((now, len(self.waiting), len(self.running) + len(self.receiving), tokens,
                             self.kv.used / self.kv.total))
        self._next_sample = now + self.sample_every
