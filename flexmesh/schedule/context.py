"""What a scheduling policy may ask: the cost of a micro-batch on a group, and what fits in memory.

Every time and memory figure comes from the one cost model (flexmesh.cost.CostModel); a policy
never computes its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.cost import CostModel
from flexmesh.cost.device.kernels import Kernels
from flexmesh.errors import ScheduleError
from flexmesh.layout.mesh import group_cp_kind, runs_in_lockstep
from flexmesh.layout.strategy import LayerStrategy

if TYPE_CHECKING:
    from flexmesh.layout.step import StepSchedule

# Batches whose per-sequence tables (ScheduleContext.by_size) a context keeps: a step asks for one batch
# (milp's warm starts and the lower bound of each schedule built ask again), and flexmesh.sim.compare's
# deferral makes a batch of a few sequences less; 4 covers that and bounds the memory of a context
# that schedules many steps.
BATCH_MEMO = 4

@dataclass(frozen=True)
class ScheduleContext:
    """A plan's view for the per-step scheduler.

    ``base`` gives tp, ZeRO stage, recomputation and the context-parallel kind used when a group
    shards a sequence; its cp and dp are ignored (the scheduler chooses the group size per step).
    ``num_ranks`` counts data ranks (world // (tp * pp)); ``speed`` has one factor per data rank.
    """

    cost: CostModel
    base: LayerStrategy
    num_ranks: int
    pp: int = 1
    pipeline_schedule: str = "1f1b"
    cp_kind: str = "ulysses"
    speed: tuple[float, ...] = ()
    max_group: int | None = None  # largest context-parallel group; default: all data ranks
    # Packing budget: most tokens per rank of a group in one micro-batch (None: memory alone decides).
    # Micro-batch time grows faster than its tokens where a profile says so (caches, logits), so
    # packing everything a group holds into one micro-batch is not always best.
    microbatch_tokens: int | None = None
    # Most tokens one rank's micro-batch may hold, computed stage by stage (each pipeline stage on its own
    # device with its own layers, ends and micro-batches in flight: flexmesh.schedule.groups.stage_cap)
    # in place of this context's one estimate (ceil(layers / pp) layers of the base strategy on every
    # stage, as many in flight as stages); None: that estimate.
    token_cap: int | None = None
    # Whether every data rank runs the step's largest micro-batch count (flexmesh.layout.mesh.runs_in_lockstep);
    # None: by that rule from pp, the base strategy's ZeRO stage and the model's experts (a plan passes
    # its layers' own).
    lockstep: bool | None = None
    # Layers of each pipeline chunk in chunk order (pp x v; chunk i on stage i % pp), as the plan splits
    # them, the first chunk running the embedding and the last the head; empty: every stage holds
    # ceil(layers / pp) layers, split evenly over its v chunks.
    chunk_layers: tuple[int, ...] = ()
    # Whether a policy may cut a sequence into pieces run in several micro-batches of one group. The
    # runtime trains such pieces exactly where flexmesh.layout.step.carries_pieces says so (not
    # with dynamic RoPE scaling), and the runtime's scheduler sets this from it.
    cut_documents: bool = True
    # How a policy that weighs candidate schedules of one step prices them (``chunked`` under a
    # pipeline): ``price(ctx, schedule)`` in seconds; None: the schedule's own estimate. The step
    # simulator sets it (flexmesh.sim.predict.simulated_price), so that choice and prediction agree.
    price: Callable[[ScheduleContext, StepSchedule], float] | None = field(default=None, compare=False, repr=False)
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ScheduleError("a schedule needs at least one data rank")
        if self.speed and len(self.speed) != self.num_ranks:
            raise ScheduleError(f"{len(self.speed)} speed factors for {self.num_ranks} data ranks")
        # Each context its own memo: dataclasses.replace would hand a changed context (other group
        # sizes, another cost model) the memo of the one it was made from.
        object.__setattr__(self, "_cache", {})

    @property
    def in_lockstep(self) -> bool:
        """Whether groups with fewer micro-batches run empty ones up to the step's largest count."""
        if self.lockstep is not None:
            return self.lockstep
        return runs_in_lockstep(self.pp, (self.base.zero,), self.cost.model.is_moe and self.num_ranks > 1)

    @property
    def group_sizes(self) -> list[int]:
        """Allowed group sizes: powers of two up to ``max_group`` (or the number of ranks)."""
        top = min(self.max_group or self.num_ranks, self.num_ranks)
        sizes, d = [], 1
        while d <= top:
            sizes.append(d)
            d *= 2
        return sizes

    def group_strategy(self, d: int) -> LayerStrategy:
        """The base strategy with a context-parallel group of ``d`` ranks."""
        # Every data rank holds the same weights, so ZeRO shards states over all of them whatever the
        # group size: dp * cp == num_ranks (with dp=1 a 7B model under ZeRO-3 would fit on no small group).
        # The kind the runtime really runs on a group of d: Ulysses falls back to ring where d does not
        # divide the heads per tensor-parallel rank.
        kind = group_cp_kind(self.cp_kind, self.cost.model.num_heads // self.base.tp, d)
        return replace(self.base, cp=d, cp_kind=kind, dp=max(1, self.num_ranks // d))

    @property
    def layers_per_stage(self) -> int:
        """Layers on the fullest pipeline stage."""
        return max(self.stage_layers)

    @property
    def stage_layers(self) -> tuple[int, ...]:
        """Layers on each pipeline stage (:attr:`chunk_layers` summed per stage); cached, since the
        schedulers ask for the fullest stage on every micro-batch they price."""
        if "stage_layers" not in self._cache:
            self._cache["stage_layers"] = (
                tuple(sum(self.chunk_layers[r::self.pp]) for r in range(self.pp)) if self.chunk_layers
                else (-(-self.cost.model.num_layers // self.pp),) * self.pp)
        return self._cache["stage_layers"]

    def layers_per_chunk(self, v: int) -> np.ndarray:
        """Layers of each of the ``pp * v`` chunks (fractions when the split is the even estimate)."""
        if not self.chunk_layers:
            return np.full(self.pp * v, self.layers_per_stage / v)
        if len(self.chunk_layers) != self.pp * v:
            raise ScheduleError(f"{len(self.chunk_layers)} chunks' layers given for pp {self.pp} x {v} chunks")
        return np.asarray(self.chunk_layers, dtype=float)

    def microbatch_time(self, d: int, tokens: ArrayLike, sq_tokens: ArrayLike,
                        ranks: tuple[int, ...] | None = None) -> float | np.ndarray:
        """Seconds for one micro-batch (fwd + bwd, one pipeline stage's layers) on a group of ``d`` ranks.

        ``ranks`` applies the slowest member's speed factor to the compute (:meth:`at_speed`). Arrays
        are accepted.
        """
        if ranks is not None and self.speed:
            compute, comm = self.microbatch_split(d, tokens, sq_tokens)
            return self.at_speed(compute, comm, min(self.speed[r] for r in ranks))
        return self.cost.microbatch_time(self.group_strategy(d), tokens, sq_tokens, layers=self.layers_per_stage,
                                         head=self.pp == 1)

    def microbatch_split(self, d: int, tokens: ArrayLike, sq_tokens: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`microbatch_time` at nominal speed as (compute, exposed communication), each an array.

        The split the simulator plays out (:meth:`flexmesh.cost.CostModel.microbatch_phases`: embedding,
        layers and head computing; tensor- and context-parallel communication left exposed).
        """
        ph = self.cost.microbatch_phases(self.group_strategy(d), tokens, sq_tokens, layers=self.layers_per_stage,
                                         head=self.pp == 1, embed=True)
        comm = np.asarray(ph.comm_fwd + ph.comm_bwd, dtype=float)
        return np.asarray(ph.fwd + ph.bwd, dtype=float), comm

    @staticmethod
    def at_speed(compute: ArrayLike, comm: ArrayLike, speed: ArrayLike) -> np.ndarray:
        """Seconds of work of ``compute`` + ``comm`` nominal seconds on a device of relative ``speed``.

        A speed factor scales compute only: a throttled or older GPU computes slower, while NVLink and
        the NICs do not slow down with it (the simulator's rule, :mod:`flexmesh.sim.timeline`).

        >>> float(ScheduleContext.at_speed(2.0, 1.0, 0.5))
        5.0
        """
        return np.asarray(compute, dtype=float) / np.asarray(speed, dtype=float) + np.asarray(comm, dtype=float)

    def seq_time(self, d: int, lengths: ArrayLike) -> np.ndarray:
        """Time of each sequence alone on a group of ``d`` ranks (vectorised)."""
        a = np.asarray(lengths, dtype=float)
        return np.asarray(self.microbatch_time(d, a, self.cost.attention_sq(0.0, a)))

    def envelope(self) -> ScheduleContext:
        """This context priced by the cost model's lower envelope (every kernel at its best rate:
        times linear in tokens and squared tokens, see :meth:`flexmesh.cost.device.kernels.Kernels.envelope`)."""
        if "envelope" not in self._cache:
            self._cache["envelope"] = replace(self, cost=self.cost.replace(kernels=Kernels.envelope), _cache={})
        return self._cache["envelope"]

    def packing_floor(self) -> ScheduleContext:
        """This context priced by the cost model's packing floor (a document alone never costs more than
        a micro-batch holding it, see :meth:`flexmesh.cost.device.kernels.Kernels.floor`); itself where the
        cost model has no such gap."""
        if "floor" not in self._cache:
            cost = self.cost.replace(kernels=Kernels.floor)
            self._cache["floor"] = self if cost is self.cost else replace(self, cost=cost, _cache={})
        return self._cache["floor"]

    def floor_times(self, lengths: ArrayLike) -> dict[int, np.ndarray]:
        """``{d: each sequence alone on d ranks}`` by :meth:`packing_floor` (read-only; the model's own
        :meth:`by_size` times where the floor is the model). One cost-model call per group size, kept
        for the latest :data:`BATCH_MEMO` batches as :meth:`by_size`'s tables are."""
        floor = self.packing_floor()
        if floor is self:
            return self.by_size("time", lengths)
        return self._per_batch("floor_times", lengths, lambda lens: {d: floor.seq_time(d, lens)
                                                                     for d in self.group_sizes})

    def seq_work(self, d: int, lengths: ArrayLike) -> np.ndarray:
        """Rank-seconds each sequence keeps a group of ``d`` busy at the least, however it is packed:
        ``d`` times its time beyond the fixed cost of a micro-batch, by the cost model's lower
        envelope (kernels at their best rate, so packing cannot make it cheaper). Vectorised."""
        env = self.envelope()
        a = np.asarray(lengths, dtype=float)
        return d * (np.asarray(env.seq_time(d, a)) - float(env.microbatch_time(d, 0.0, 0.0)))

    def seq_load(self, d: int, lengths: ArrayLike) -> np.ndarray:
        """Seconds each sequence adds to a group of ``d`` ranks whose micro-batches are packed (nominal
        speed, vectorised): what the placing policies add up per group.

        Kernels run a micro-batch of many documents faster than each document alone (GEMM tiles and
        waves, launches, the memory roofline: :mod:`flexmesh.cost.device.kernels`), so summing times alone
        overstates a group of many short documents. A sequence of ``l`` tokens is charged its share of
        a micro-batch packed (up to :meth:`pack_tokens`) with sequences like it,
        ``t_d(n l, n sq(l)) / n`` with ``n = max(1, floor(pack_tokens(d) / l))``; one that shares its
        micro-batch with no other like it costs its time alone (:meth:`seq_time`).
        """
        a, n = self._packed_like(d, lengths)
        return np.asarray(self.microbatch_time(d, n * a, n * self.cost.attention_sq(0.0, a))) / n

    def comm_share(self, d: int, lengths: ArrayLike) -> float:
        """Share of exposed communication in the packed loads (:meth:`seq_load`) of ``lengths`` on a group
        of ``d`` ranks, at nominal speed: the part of a group's time that a slower device does not stretch
        (:meth:`at_speed`)."""
        a, n = self._packed_like(d, lengths)
        comp, comm = self.microbatch_split(d, n * a, n * self.cost.attention_sq(0.0, a))
        total = float((comp / n).sum() + (comm / n).sum())
        return float((comm / n).sum()) / total if total > 0 else 0.0

    def _packed_like(self, d: int, lengths: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Lengths (at least 1 token) and how many of each fill a micro-batch of a group of ``d``
        (:meth:`pack_tokens`): the packing :meth:`seq_load` assumes."""
        a = np.maximum(np.asarray(lengths, dtype=float), 1.0)
        return a, np.maximum(1.0, np.floor(self.pack_tokens(d) / a))

    def by_size(self, kind: str, lengths: ArrayLike) -> dict[int, np.ndarray]:
        """``{d: per-sequence figure on d ranks}`` for every allowed group size, read-only arrays.

        ``kind`` is ``"time"`` (:meth:`seq_time`), ``"load"`` (:meth:`seq_load`) or ``"work"``
        (:meth:`seq_work`), all at nominal speed and equal to those methods' figures. A step's
        policies (and ``milp``'s warm starts, and the lower bound of each schedule built) ask for the
        same batch again: the tables of the latest :data:`BATCH_MEMO` batches are kept. All three
        kinds are made together, two cost-model calls per group size (its time is mostly per call,
        not per sequence): the model's own (each sequence alone and packed) and the envelope's.
        """
        return self._per_batch("by_size", lengths, self._tables)[kind]

    def _per_batch(self, name: str, lengths: ArrayLike, make):  # noqa: ANN001, ANN202 - any table
        """``make(lengths)``, kept in memo ``name`` for the latest :data:`BATCH_MEMO` batches; its arrays
        (in dicts, nested or not) are made read-only, since every caller shares them."""
        lens = np.ascontiguousarray(lengths)
        memo = self._cache.setdefault(name, {})
        key = (lens.dtype.str, lens.tobytes())
        if key not in memo:
            while len(memo) >= BATCH_MEMO:
                memo.pop(next(iter(memo)))  # oldest first (dicts keep insertion order)
            memo[key] = _read_only(make(lens))
        return memo[key]

    def _tables(self, lens: np.ndarray) -> dict[str, dict[int, np.ndarray]]:
        """:meth:`by_size`'s three tables of one batch, the same arithmetic as the per-size methods."""
        a = np.asarray(lens, dtype=float).reshape(-1)
        one = np.maximum(a, 1.0)  # seq_load's guard against empty sequences
        sq, sq_one = self.cost.attention_sq(0.0, a), self.cost.attention_sq(0.0, one)
        env, k = self.envelope(), a.size
        out: dict[str, dict[int, np.ndarray]] = {"time": {}, "load": {}, "work": {}}
        for d in self.group_sizes:
            n = np.maximum(1.0, np.floor(self.pack_tokens(d) / one))
            t = np.asarray(self.microbatch_time(d, np.concatenate([a, n * one]), np.concatenate([sq, n * sq_one])),
                           dtype=float)
            e = np.asarray(env.microbatch_time(d, np.append(a, 0.0), np.append(sq, 0.0)), dtype=float)
            out["time"][d], out["load"][d], out["work"][d] = t[:k], t[k:] / n, d * (e[:k] - e[k])
        return out

    def seq_work_split(self, d: int, lengths: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`seq_work` as (compute, exposed communication) rank-seconds at nominal speed, by the same
        lower envelope: the part a slower device stretches and the part it does not. Vectorised."""
        env = self.envelope()
        a = np.asarray(lengths, dtype=float)
        comp, comm = env.microbatch_split(d, a, self.cost.attention_sq(0.0, a))
        comp0, comm0 = env.microbatch_split(d, 0.0, 0.0)
        return d * (comp - float(comp0)), d * (comm - float(comm0))

    def max_tokens(self, d: int) -> int:
        """Most tokens one micro-batch may hold on a group of ``d`` ranks without exceeding memory."""
        key = ("max_tokens", d)
        if key not in self._cache:
            flight = 1.0 if self.pp == 1 else float(self.pp)
            self._cache[key] = self.token_cap * d if self.token_cap is not None else self.cost.max_tokens(
                self.group_strategy(d), layers=self.layers_per_stage, head=self.pp == 1, in_flight_mbs=flight)
        return self._cache[key]

    def pack_tokens(self, d: int) -> int:
        """Most tokens the packers put in one micro-batch of a group of ``d``: memory, and the budget."""
        cap = self.max_tokens(d)
        return cap if self.microbatch_tokens is None else min(cap, self.microbatch_tokens * d)

    def min_group(self, length: int) -> int:
        """Fewest ranks (a power of two) whose memory holds a sequence of ``length`` tokens.

        Raises ScheduleError naming the length and the largest that fits anywhere.
        """
        for d in self.group_sizes:
            if length <= self.max_tokens(d):
                return d
        largest = self.max_tokens(self.group_sizes[-1])
        raise ScheduleError(
            f"a sequence of {length} tokens fits nowhere: the largest group ({self.group_sizes[-1]} ranks) holds "
            f"at most {largest} tokens; truncate sequences to {largest}, enable recomputation, or add devices"
        )


def _read_only(tables: dict) -> dict:
    """``tables`` with every array in it (in dicts, nested or not) made read-only."""
    for value in tables.values():
        if isinstance(value, dict):
            _read_only(value)
        else:
            value.setflags(write=False)
    return tables
