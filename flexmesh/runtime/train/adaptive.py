"""AdaptiveSource: schedule step k+1 on rank 0 in the background while step k trains.

A scheduling policy costs time (the MILP can take a second); run inline it stalls every rank at
each step. Here rank 0 hands the next batch's lengths to a background thread
(``concurrent.futures``) as soon as the current step starts training, and every rank receives the
finished schedule by one ``broadcast_object_list`` on a gloo group (made once, so it works when
training runs on NCCL). One rank decides, so every rank runs the same schedule even when the policy
is time-limited and could answer differently on different ranks.

When step k ends and the schedule of step k+1 is not ready within ``deadline_s``, the step does not
wait: rank 0 computes ``fallback_fn(lengths)`` (a cheaper policy) and runs that, and the step's
metrics say ``fallback: true``. ``scheduler_s`` records how long the schedule that ran took.

Timeline with ``lookahead=1``::

    main thread   | next(1): read batch 1, schedule it (nothing to hide behind), read batch 2,
                  |          submit it | train step 1 ............ | next(2): batch 2's schedule ready?
    scheduler     |                    | schedule batch 2 ...      |   yes: run it; no: run fallback

Resume. ``state_dict`` holds the loader position of the first batch not yet trained and, on rank 0,
the choice for that batch (background result or fallback), which it settles on the spot if still
open. Schedules are not stored: after ``load_state_dict`` the batch is read again and its schedule
recomputed with the recorded choice. What is exact: the documents of every step; the schedule of
the first step after a resume (the one the checkpointed run would have run, given deterministic
policies); and every later schedule that is ready in time (the same policy on the same lengths).
Which later steps fall back depends on timing, in a resumed run as in any other; with
``deadline_s=None`` nothing falls back and every schedule is exact.

Speeds. ``set_speed`` (rank 0; flexmesh.runtime.train.stragglers re-plans through it) makes both policies
schedule for new per-rank speed factors and recomputes the schedules already computed ahead, so the
next step runs on them; the state holds the speeds, so a resumed run schedules for them too.

>>> import numpy as np
>>> from flexmesh.data.loader import DocumentLoader
>>> from flexmesh.schedule.testing import tiny_context
>>> from flexmesh.schedule.registry import make_schedule
>>> ctx = tiny_context(num_ranks=4)
>>> loader = DocumentLoader([np.ones(n, dtype=np.int64) for n in (900, 50, 3000, 60, 700, 20)], global_batch=3,
...                         max_len=4096)
>>> src = AdaptiveSource(loader, lambda n: make_schedule("hdp", n, ctx),
...                      lambda n: make_schedule("balanced", n, ctx), policy="hdp", deadline_s=None)
>>> docs, schedule = next(src)
>>> len(docs), schedule.policy, schedule.fallback
(3, 'hdp', False)
>>> src.close()
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace

import numpy as np
import torch.distributed as dist

from flexmesh.errors import ScheduleError
from flexmesh.layout.step import StepSchedule
from flexmesh.runtime.parallel.distributed import cpu_group

ScheduleFn = Callable[[list[int]], StepSchedule]
PRIMARY, FALLBACK = "primary", "fallback"


@dataclass
class _Ahead:
    """A batch read ahead: its documents, the loader position before it, and (rank 0) its schedule job."""

    docs: list
    loader_state: dict
    future: Future | None
    choice: str | None = None  # PRIMARY or FALLBACK once settled
    wait: bool = False  # read while nothing trained: no step to hide behind, so wait for the result

    @property
    def job(self) -> Future:
        """The schedule job, which rank 0 starts for every batch it reads."""
        assert self.future is not None, "only rank 0 schedules, and it schedules every batch it reads"
        return self.future


def _timed(fn: ScheduleFn, lengths: list[int]) -> tuple[StepSchedule, float]:
    t0 = time.perf_counter()
    schedule = fn(lengths)
    return schedule, time.perf_counter() - t0


class AdaptiveSource:
    """A StepSource (flexmesh.runtime.train.loop) whose schedules are computed one step ahead on rank 0.

    ``loader``: an iterator of global batches (lists of token arrays) with ``state_dict`` /
    ``load_state_dict`` (flexmesh.data.loader.DocumentLoader), run identically on every rank.
    ``schedule_fn`` / ``fallback_fn``: ``lengths -> StepSchedule``, called on rank 0 only.
    ``group``: the process group for the broadcast (default: a gloo group over all ranks).
    ``lookahead``: batches scheduled ahead of the one training. ``deadline_s``: how long the end of a
    step may wait for the next schedule before falling back (0: not at all; None: always wait).
    ``policy``: the requested policy's name for the metrics (default ``schedule_fn.policy`` if set).
    Works without torch.distributed too (one process, nothing broadcast).
    """

    def __init__(self, loader, schedule_fn: ScheduleFn, fallback_fn: ScheduleFn, *, group=None, lookahead: int = 1,
                 deadline_s: float | None = 0.0, policy: str | None = None) -> None:
        if lookahead < 1:
            raise ScheduleError(f"lookahead must be at least 1 step, got {lookahead}")
        if deadline_s is not None and deadline_s < 0:
            raise ScheduleError(f"deadline_s must be >= 0 seconds or None (always wait), got {deadline_s}")
        self.loader, self.schedule_fn, self.fallback_fn = loader, schedule_fn, fallback_fn
        self.lookahead, self.deadline_s = lookahead, deadline_s
        self.policy = policy or getattr(schedule_fn, "policy", None)
        self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self._distributed else 0
        if self._distributed and group is None:
            group = cpu_group()
        self.group = group
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flexmesh-scheduler") \
            if self.rank == 0 else None
        self._pending: deque[_Ahead] = deque()
        self._resume_choice: str | None = None
        self._exhausted = False

    # ---- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> AdaptiveSource:
        return self

    def __next__(self) -> tuple[Sequence[np.ndarray], StepSchedule]:
        if self._pending:
            entry = self._pending.popleft()
        else:
            if self._exhausted:
                raise StopIteration
            entry = self._read(wait=True)  # StopIteration ends the run
            entry.choice, self._resume_choice = self._resume_choice, None
        message = self._decide(entry) if self.rank == 0 else None
        self._top_up()  # the next batches' schedules compute while this step trains
        status, payload = self._share(message)
        if status == "error":
            raise payload
        return entry.docs, payload

    def _read(self, wait: bool = False) -> _Ahead:
        state = self.loader.state_dict()
        docs = next(self.loader)
        future = self._pool.submit(_timed, self.schedule_fn, [len(d) for d in docs]) if self._pool else None
        return _Ahead(docs=docs, loader_state=state, future=future, wait=wait)

    def _top_up(self) -> None:
        while not self._exhausted and len(self._pending) < self.lookahead:
            try:
                self._pending.append(self._read())
            except StopIteration:
                self._exhausted = True

    def _settle(self, entry: _Ahead) -> str:
        """Rank 0: the background schedule if it is ready within the deadline, else the fallback."""
        if entry.choice is None:
            if entry.wait or self.deadline_s is None:
                entry.choice = PRIMARY
            else:
                try:
                    entry.job.exception(timeout=self.deadline_s)
                    entry.choice = PRIMARY
                except FutureTimeout:
                    entry.choice = FALLBACK
        return entry.choice

    def _decide(self, entry: _Ahead) -> tuple[str, object]:
        """Rank 0: the schedule this step runs, with its provenance; errors are passed on."""
        try:
            if self._settle(entry) == PRIMARY:
                schedule, seconds = entry.job.result()
                requested = self.policy or schedule.policy
            else:
                entry.job.cancel()  # only stops it if not started; a running one finishes unused
                schedule, seconds = _timed(self.fallback_fn, [len(d) for d in entry.docs])
                requested = self.policy or "unknown"
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
            return "error", e
        return "ok", replace(schedule, requested_policy=requested, fallback=entry.choice == FALLBACK,
                             scheduler_seconds=seconds)

    def _share(self, message):
        if not self._distributed:
            return message
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    # ---- speeds (flexmesh.runtime.train.stragglers) ------------------------------------------------------
    @property
    def speed(self) -> tuple[float, ...]:
        """Rank 0: the speed factors per data rank the schedules are made for (() when nominal or unknown)."""
        groups = getattr(self.schedule_fn, "groups", None)  # a Scheduler's contexts (None: it prices nothing)
        return tuple(groups.speed) if groups is not None else ()

    def set_speed(self, speed: Sequence[float]) -> None:
        """Rank 0: make the schedules (both policies') for these speeds from the next step on; the
        schedules already computed ahead are dropped and computed again."""
        if self.rank != 0:
            return
        assert self._pool is not None  # rank 0 schedules in the background
        for fn in (self.schedule_fn, self.fallback_fn):
            if not hasattr(fn, "set_speed"):
                raise ScheduleError(f"cannot re-plan for new speeds: {fn!r} has no set_speed "
                                    "(give AdaptiveSource flexmesh.schedule.scheduler.Scheduler objects)")
            fn.set_speed(speed)
        for entry in self._pending:
            if entry.future is not None:
                entry.future.cancel()  # a running one finishes unused
            entry.future = self._pool.submit(_timed, self.schedule_fn, [len(d) for d in entry.docs])

    # ---- resume ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Loader position of the next batch to train and (rank 0) its settled choice and the speeds
        its schedules are made for; see the module doc."""
        speed = list(self.speed) if self.rank == 0 and self.speed else None
        head = self._pending[0] if self._pending else None
        if head is None:
            return {"loader": self.loader.state_dict(), "next_choice": self._resume_choice, "speed": speed}
        return {"loader": head.loader_state, "next_choice": self._settle(head) if self.rank == 0 else None,
                "speed": speed}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the batch it names is read again and its schedule recomputed."""
        self._drop_pending()
        if "loader" not in state:  # a checkpoint that stored the bare loader state (before AdaptiveSource)
            state = {"loader": state, "next_choice": None}
        self.loader.load_state_dict(state["loader"])
        choice = state.get("next_choice")
        if choice not in (None, PRIMARY, FALLBACK):
            raise ScheduleError(f"adaptive source state has next_choice={choice!r}; the checkpoint is not from this "
                                "version of flexmesh")
        self._resume_choice = choice if self.rank == 0 else None
        self._exhausted = False
        if state.get("speed") and self.rank == 0:  # the speeds a re-planned run was scheduling for
            self.set_speed(state["speed"])

    def _drop_pending(self) -> None:
        for entry in self._pending:
            if entry.future is not None:
                entry.future.cancel()
        self._pending.clear()

    def close(self) -> None:
        """Stop scheduling ahead; a schedule already running finishes in the background, unused."""
        self._drop_pending()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
