"""One engine: transformers' continuous batching on one model, with per-token timestamps and a log of
its iterations.

transformers' ``ContinuousBatchingManager`` (the loop behind ``generate_batch``) runs a background
thread that, every iteration, schedules a batch (decoding requests and prefill chunks under one token
budget), runs the model once and appends one token to every request that finished its prompt. This
module sizes it explicitly (:class:`~flexmesh.serve.engine.config.EngineConfig`), asks for greedy decoding and
per-token timestamps, and records every iteration's batch and duration. On a CPU it keeps attention as the model
has it (SDPA) and no graphs; on a GPU it takes what transformers offers for speed there: flash attention where a
flash kernel is installed (``auto_switch_to_flash``; transformers 5.17 always switches) and CUDA graphs where
transformers' own rule turns them on (``use_cuda_graph=None``: graphs for the paths whose attention needs no mask).
What it got, and why not where it could not, is :attr:`Engine.speed` (on ``/v1/models`` and in the engine's log).
Batches stay synchronous (``use_async_batching=False``): an iteration is timed from its scheduling to its tokens.

Iterations: transformers offers no per-iteration callback, so :class:`_TimedManager` wraps the
manager's loop body (``_generation_loop_body``, checked against transformers 5.24 by
tests/test_serve_engine.py): the time from scheduling to the tokens handed out, and the batch as
``(tokens already in the KV cache, tokens computed now)`` per request -- the batch that
:class:`flexmesh.cost.inference` prices -- and the CPU time the loop's thread had meanwhile (less than the
duration when other processes held the cores: how contended a measurement was). The idle wait of an empty
loop is not an iteration. Each iteration also counts the requests the engine took in (:meth:`Engine.submit`)
and answered (handed a finished request to its caller) while it ran, and the CPU time the engine's other threads
had meanwhile: its HTTP thread parses, checks and submits the one and answers the other beside the loop, holding
the interpreter while the loop's thread waits for it (:func:`flexmesh.profile.iteration.request_costs_from`
prices a request of each kind from these).

Clocks: every time here is ``time.perf_counter()``, which on Linux reads CLOCK_MONOTONIC, one clock
for every process on the machine; the router and the replay client compare times across processes
on it.
"""

from __future__ import annotations

import collections
import inspect
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from flexmesh.errors import ServeError
from flexmesh.serve.engine.config import EngineConfig
from flexmesh.serve.engine.model import build_model

ITERATIONS_KEPT = 100_000  # iterations an engine keeps in memory for /iterations (a bounded ring)
START_S = 120.0  # the most an engine's loop may take to build its KV cache


@dataclass(frozen=True)
class Iteration:
    """One engine iteration: when it started and ended (perf_counter seconds) and its batch."""

    start_s: float
    end_s: float
    batch: tuple[tuple[int, int], ...]  # (tokens in the KV cache before, tokens computed now) per request
    cpu_s: float = 0.0  # CPU time of the engine's thread meanwhile: below duration_s when it waited for a core
    taken: int = 0  # requests the engine took in meanwhile (module doc)
    answered: int = 0  # requests it handed out finished meanwhile
    others_cpu_s: float = 0.0  # CPU time of the engine's other threads meanwhile (its HTTP thread's, mostly)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    def to_dict(self) -> dict:
        return {"start_s": self.start_s, "end_s": self.end_s, "batch": [list(b) for b in self.batch],
                "cpu_s": self.cpu_s, "taken": self.taken, "answered": self.answered, "others_cpu_s": self.others_cpu_s}


@dataclass(frozen=True)
class Finished:
    """A request the engine finished: its generated tokens and when each came (perf_counter seconds)."""

    request_id: str
    prompt_tokens: int
    tokens: list[int]
    token_s: list[float]
    queued_s: float  # when the engine took the request
    started_s: float  # when its first iteration was scheduled
    error: str | None = None
    cancelled: bool = False  # stopped by :meth:`Engine.cancel`: ``tokens`` are those it had generated


def batching_config(cfg: EngineConfig, fields: Iterable[str]) -> dict[str, Any]:
    """transformers' ``ContinuousBatchingConfig`` arguments for ``cfg``, by the fields the installed release's
    class has (``fields``): the page size is ``page_size`` in 5.24, ``block_size`` in 5.17; releases without
    ``auto_switch_to_flash`` never switch attention, which is what is asked of the others. A field still missing is
    one ServeError naming the release.

    >>> old = ["block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "scheduler_type",
    ...        "safety_margin", "allow_block_sharing", "use_cuda_graph", "use_async_batching", "seed"]
    >>> kw = batching_config(EngineConfig(page_size=32), old)  # 5.17's fields
    >>> kw["block_size"], "page_size" in kw, "auto_switch_to_flash" in kw, kw["use_cuda_graph"]
    (32, False, False, False)
    >>> gpu = batching_config(EngineConfig(device="cuda:0"), [*old, "auto_switch_to_flash"])  # transformers decides
    >>> gpu["use_cuda_graph"], gpu["auto_switch_to_flash"], gpu["use_async_batching"]
    (None, True, False)
    """
    fields = set(fields)
    gpu = cfg.device != "cpu"
    kw: dict[str, Any] = {
        "page_size" if "page_size" in fields else "block_size": cfg.page_size, "num_blocks": cfg.num_blocks,
        "max_batch_tokens": cfg.max_batch_tokens, "max_requests_per_batch": cfg.max_requests_per_batch,
        "scheduler_type": cfg.scheduler, "safety_margin": cfg.safety_margin, "allow_block_sharing": cfg.block_sharing,
        "use_cuda_graph": None if gpu else False, "use_async_batching": False, "seed": cfg.seed}
    if "auto_switch_to_flash" in fields:
        kw["auto_switch_to_flash"] = gpu
    missing = sorted(set(kw) - fields)
    if missing:
        import transformers

        raise ServeError(f"transformers {transformers.__version__}'s continuous batching has no "
                         f"{', '.join(missing)}; install a transformers 5 release this flexmesh was tested with "
                         "(5.17 or 5.24)")
    return kw


def speed(device: str, graphs: tuple[bool, bool], attention: str, flash_installed: bool) -> dict:
    """What an engine on ``device`` runs with for speed, and why not where it could not: ``graphs`` are CUDA graphs
    for (prefill, decode) batches as transformers decided them, ``attention`` the implementation the model ended on.

    >>> speed("cuda:0", (False, True), "paged|sdpa", False)["note"]
    'cuda:0: CUDA graphs for decode batches; attention paged|sdpa (no flash kernel installed: flash-attn)'
    >>> speed("cuda:1", (False, False), "paged|sdpa", True)["note"].split("; ")
    ['cuda:1: no CUDA graphs (transformers captured none: its rule for this attention, or no graph backend)', \
'attention paged|sdpa (transformers kept it)']
    >>> speed("cpu", (False, False), "paged|sdpa", False)["note"]
    'cpu: no CUDA graphs or flash attention on a CPU; attention paged|sdpa'
    """
    paths = [name for name, on in zip(("prefill", "decode"), graphs) if on]
    if device == "cpu":
        note = f"cpu: no CUDA graphs or flash attention on a CPU; attention {attention}"
    else:
        flash = "flash" in attention
        why = "" if flash else (" (no flash kernel installed: flash-attn)" if not flash_installed
                                else " (transformers kept it)")
        got = (f"CUDA graphs for {' and '.join(paths)} batches" if paths
               else "no CUDA graphs (transformers captured none: its rule for this attention, or no graph backend)")
        note = f"{device}: {got}; attention {attention}{why}"
    return {"cuda_graphs": {"prefill": graphs[0], "decode": graphs[1]}, "attention": attention, "note": note}


def _flash_installed() -> bool:
    from transformers.utils import import_utils

    return any(getattr(import_utils, f, lambda **_: False)() for f in ("is_flash_attn_2_available",
                                                                        "is_flash_attn_3_available"))


def _manager_class():
    from transformers.generation.continuous_batching import ContinuousBatchingManager

    class _TimedManager(ContinuousBatchingManager):
        """The manager with its iterations recorded (see the module doc)."""

        def _generation_loop_body(self, batch_processor, bootstrapping: bool) -> bool:
            self.processor = batch_processor  # the scheduler's request states, read when cancelling
            before = getattr(self, "current_batch", 0)
            # counted from where the last pass of the loop left off: what came between two iterations is the next
            # one's, what came while the loop idled is no iteration's
            taken, answered = getattr(self, "seen", None) or self.counts()
            start, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
            go_on = super()._generation_loop_body(batch_processor, bootstrapping)
            end, cpu, process = time.perf_counter(), time.thread_time() - cpu, time.process_time() - process
            self.seen = now_taken, now_answered = self.counts()
            if self.current_batch != before:
                batch = tuple((f.state.position_offset - f.query_length, f.query_length)
                              for f in batch_processor.inputs_and_outputs.requests_in_batch)
                self.on_iteration(Iteration(start, end, batch, cpu, now_taken - taken, now_answered - answered,
                                            max(process - cpu, 0.0)))
            return go_on

        def on_iteration(self, it: Iteration) -> None:  # replaced per engine
            pass

        def counts(self) -> tuple[int, int]:  # replaced per engine: requests taken in and answered so far
            return 0, 0

    return _TimedManager


class Engine:
    """transformers' continuous batching on ``cfg``'s model, started at construction, stopped by
    :meth:`close` (also on ``with``).

    Submit with :meth:`submit` (``on_done`` is called from the engine's thread with a
    :class:`Finished`) or run a list of prompts to the end with :meth:`run`; :attr:`iterations` holds
    the last :data:`ITERATIONS_KEPT` iterations, and ``on_iteration`` (if given) sees each as it ends.
    """

    def __init__(self, cfg: EngineConfig, on_iteration: Callable[[Iteration], None] | None = None) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.model = build_model(cfg)
        if cfg.device != "cpu":
            if not torch.cuda.is_available():
                raise ServeError(f"engine device {cfg.device} asked for, but torch sees no CUDA device here")
            self.model = self.model.to(cfg.device)
        self.vocab = int(self.model.config.vocab_size)
        self.max_position = int(self.model.config.max_position_embeddings)
        gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=16)
        cb = ContinuousBatchingConfig(**batching_config(cfg, inspect.signature(ContinuousBatchingConfig).parameters))
        self.iterations: collections.deque[Iteration] = collections.deque(maxlen=ITERATIONS_KEPT)
        self._on_iteration = on_iteration
        self._pending: dict[str, tuple[int, float, Callable[[Finished], None]]] = {}
        self._cancelling: list[tuple[str, object]] = []  # (request id, its scheduler state) until the loop drops it
        self._lock = threading.Lock()
        self._counter = 0
        self._taken = self._answered = 0  # requests taken in and answered so far (each iteration counts its own)
        self.last_iteration_s = time.perf_counter()  # when the loop last finished an iteration (or started)
        self._manager = _manager_class()(self.model, gen, cb)
        self._manager.on_iteration = self._record
        self._manager.counts = lambda: (self._taken, self._answered)
        self._collector = threading.Thread(target=self._collect, name="engine-results", daemon=True)
        self._manager.start()
        self._collector.start()
        self._wait_started()
        graphs = getattr(self._manager.continuous_batching_config, "cuda_graph_booleans", (False, False))
        self.speed = speed(cfg.device, tuple(graphs), str(self.model.config._attn_implementation), _flash_installed())

    def _wait_started(self, timeout_s: float = START_S) -> None:
        """Until the loop has built its batch processor (its KV cache): a loop that failed doing so (a cache that
        does not fit in memory, say) is one ServeError line here, not an engine that answers nothing."""
        m = self._manager
        status = getattr(m, "background_thread_status", None)
        deadline = time.perf_counter() + timeout_s
        while getattr(m, "batch_processor", None) is None:
            error = getattr(status, "fatal_error", None)
            if error is not None or not m.is_running():
                why = f"{type(error).__name__}: {error}" if error is not None else "it stopped"
                self.close()
                raise ServeError(f"the engine's generation loop failed to start ({why})".replace("\n", " "))
            if time.perf_counter() > deadline:
                self.close()
                raise ServeError(f"the engine's generation loop was not ready within {timeout_s:.0f} s")
            time.sleep(0.01)

    # -- requests ---------------------------------------------------------------------------------

    def check(self, prompt: list[int], max_new_tokens: int) -> None:
        """ServeError (one line) for a request this engine cannot run."""
        if not prompt:
            raise ServeError("prompt is empty; send at least one token id")
        if max_new_tokens < 1:
            raise ServeError(f"max_tokens must be at least 1, got {max_new_tokens}")
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab), None)
        if bad is not None:
            raise ServeError(f"prompt token {bad!r} is not a token id of this model (0..{self.vocab - 1})")
        total = len(prompt) + max_new_tokens
        if total > self.max_position:
            raise ServeError(f"prompt ({len(prompt)}) + max_tokens ({max_new_tokens}) = {total} tokens exceed the "
                             f"model's {self.max_position} positions; shorten either")
        if total > self.cfg.kv_tokens:
            raise ServeError(f"prompt + max_tokens = {total} tokens exceed the engine's KV cache of "
                             f"{self.cfg.kv_tokens} tokens; raise num_blocks")

    def submit(self, prompt: list[int], max_new_tokens: int, on_done: Callable[[Finished], None],
               request_id: str | None = None) -> str:
        """Queue a greedy request (named ``request_id``, else the engine's own count); ``on_done`` gets its
        :class:`Finished` (from another thread)."""
        self.check(prompt, max_new_tokens)
        if not self._manager.is_running():
            raise ServeError("the engine has stopped; start it again")
        with self._lock:
            rid = request_id if request_id is not None else f"r{self._counter}"
            self._counter += 1
            if rid in self._pending:
                raise ServeError(f"request id {rid!r} is running already; name each request once")
            self._pending[rid] = (len(prompt), time.perf_counter(), on_done)
            self._taken += 1  # before the loop can wake for it (then an idle loop's pass holds it, no iteration)
        got = self._manager.add_request(list(prompt), request_id=rid, max_new_tokens=max_new_tokens,
                                        record_timestamps=True, eos_token_id=-1)
        if got is None:
            with self._lock:
                self._pending.pop(rid, None)
                self._taken -= 1
            raise ServeError("the engine is stopping and takes no new request")
        return rid

    def run(self, prompts: list[list[int]], max_new_tokens: list[int], timeout_s: float = 600.0) -> list[Finished]:
        """Submit every prompt at once and wait for all (ServeError after ``timeout_s``)."""
        done: dict[str, Finished] = {}
        cond = threading.Condition()

        def finished(f: Finished) -> None:
            with cond:
                done[f.request_id] = f
                cond.notify_all()

        ids = [self.submit(p, n, finished) for p, n in zip(prompts, max_new_tokens)]
        with cond:
            if not cond.wait_for(lambda: len(done) == len(ids) or not self._manager.is_running(), timeout_s):
                raise ServeError(f"{len(ids) - len(done)} of {len(ids)} requests unfinished after {timeout_s:.0f} s")
        if len(done) < len(ids):
            raise ServeError("the engine stopped before every request finished")
        return [done[i] for i in ids]

    def cancel(self, request_id: str) -> bool:
        """Stop a request: once the loop has dropped it (at its next iteration), its ``on_done`` gets a
        :class:`Finished` with ``cancelled`` and the tokens it had generated. False when it is not running here
        (unknown, or finished meanwhile)."""
        with self._lock:
            if request_id not in self._pending:
                return False
            processor = getattr(self._manager, "processor", None)
            scheduler = getattr(processor, "scheduler", None)
            state = None
            if scheduler is not None:
                state = scheduler.active_requests.get(request_id) or scheduler.waiting_requests.get(request_id)
            self._cancelling.append((request_id, state))
        self._manager.cancel_request(request_id)
        return True

    def _settle_cancelled(self) -> None:
        """Hand out the cancellations the loop has carried out (their request no longer in its scheduler)."""
        processor = getattr(self._manager, "processor", None)
        scheduler = getattr(processor, "scheduler", None)
        with self._lock:
            if not self._cancelling:
                return
            left: list[tuple[str, object]] = []
            done: list[tuple[str, object]] = []
            for rid, state in self._cancelling:
                live = None if scheduler is None else (scheduler.active_requests.get(rid)
                                                       or scheduler.waiting_requests.get(rid))
                (left if live is not None else done).append((rid, live or state))
            self._cancelling = left
            entries = [(rid, state, self._pending.pop(rid, None)) for rid, state in done]
        for rid, state, entry in entries:
            if entry is None:  # it finished before the cancellation landed
                continue
            prompt_tokens, queued, on_done = entry
            tokens = list(getattr(state, "generated_tokens", []) or [])
            on_done(Finished(rid, prompt_tokens, tokens, [], queued, -1.0, None, cancelled=True))

    @property
    def outstanding(self) -> int:
        """Requests submitted and not yet finished."""
        with self._lock:
            return len(self._pending)

    @property
    def running(self) -> bool:
        return self._manager.is_running()

    # -- background ---------------------------------------------------------------------------------

    def _record(self, it: Iteration) -> None:
        self.last_iteration_s = it.end_s
        self.iterations.append(it)
        if self._on_iteration is not None:
            self._on_iteration(it)

    def _collect(self) -> None:
        """Hand each finished request to its caller (transformers' output queue, read by one thread)."""
        manager = self._manager
        while True:
            self._settle_cancelled()
            out = manager.get_result(timeout=0.05 if self._cancelling else 0.2)
            if out is None:
                if not manager.is_running() and manager.output_router.output_queue.empty():
                    self._fail_pending("the engine stopped")
                    return
                continue
            if not out.is_finished():
                continue
            with self._lock:
                entry = self._pending.pop(out.request_id, None)
            if entry is None:
                continue
            prompt_tokens, queued, on_done = entry
            on_done(Finished(out.request_id, prompt_tokens, list(out.generated_tokens), list(out.timestamps or []),
                             queued, float(out.lifespan[0]), out.error))
            with self._lock:
                self._answered += 1

    def _fail_pending(self, why: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for rid, (prompt_tokens, queued, on_done) in pending.items():
            on_done(Finished(rid, prompt_tokens, [], [], queued, -1.0, why))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop: requests still running fail (a hard stop), within ``timeout_s``."""
        if self._manager.is_running():
            self._manager.stop(block=True, timeout=timeout_s, hard_stop=True)
        self._collector.join(timeout=timeout_s)
        self._fail_pending("the engine stopped")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

