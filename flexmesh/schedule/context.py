"""What a scheduling policy may ask: the cost of a micro-batch on a group, and what fits in memory.

Every time and memory figure comes from the one cost model (flexmesh.cost.CostModel); a policy
never computes its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.cost import CostModel
from flexmesh.errors import ScheduleError
from flexmesh.layout.mesh import group_cp_kind, runs_in_lockstep
from flexmesh.layout.strategy import LayerStrategy


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
    # Whether every data rank runs the step's largest micro-batch count (flexmesh.layout.mesh.runs_in_lockstep);
    # None: by that rule from pp and the base strategy's ZeRO stage (a plan passes its layers' own).
    lockstep: bool | None = None
    # Whether a policy may cut a sequence into pieces run in several micro-batches of one group. The
    # runtime trains such pieces exactly only where flexmesh.layout.step.carries_pieces says so
    # (pp = 1), and the runtime's scheduler sets this from it; the default (True) lets the simulator
    # price policies as published (InfiniPipe's slices on a pipeline).
    cut_documents: bool = True
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ScheduleError("a schedule needs at least one data rank")
        if self.speed and len(self.speed) != self.num_ranks:
            raise ScheduleError(f"{len(self.speed)} speed factors for {self.num_ranks} data ranks")

    @property
    def in_lockstep(self) -> bool:
        """Whether groups with fewer micro-batches run empty ones up to the step's largest count."""
        return runs_in_lockstep(self.pp, (self.base.zero,)) if self.lockstep is None else self.lockstep

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
        return -(-self.cost.model.num_layers // self.pp)

    def microbatch_time(self, d: int, tokens: ArrayLike, sq_tokens: ArrayLike,
                        ranks: tuple[int, ...] | None = None) -> float | np.ndarray:
        """Seconds for one micro-batch (fwd + bwd, one pipeline stage's layers) on a group of ``d`` ranks.

        ``ranks`` applies the slowest member's speed factor. Arrays are accepted.
        """
        t = self.cost.microbatch_time(self.group_strategy(d), tokens, sq_tokens, layers=self.layers_per_stage,
                                      head=self.pp == 1)
        if ranks is not None and self.speed:
            t = t / min(self.speed[r] for r in ranks)
        return t

    def seq_time(self, d: int, lengths: ArrayLike) -> np.ndarray:
        """Time of each sequence alone on a group of ``d`` ranks (vectorised)."""
        a = np.asarray(lengths, dtype=float)
        return np.asarray(self.microbatch_time(d, a, self.cost.attention_sq(0.0, a)))

    def envelope(self) -> ScheduleContext:
        """This context priced by the cost model's lower envelope (every kernel at its best rate:
        times linear in tokens and squared tokens, see :meth:`flexmesh.cost.CostModel.lower_envelope`)."""
        if "envelope" not in self._cache:
            self._cache["envelope"] = replace(self, cost=self.cost.lower_envelope(), _cache={})
        return self._cache["envelope"]

    def seq_work(self, d: int, lengths: ArrayLike) -> np.ndarray:
        """Rank-seconds each sequence keeps a group of ``d`` busy at the least, however it is packed:
        ``d`` times its time beyond the fixed cost of a micro-batch, by the cost model's lower
        envelope (kernels at their best rate, so packing cannot make it cheaper). Vectorised."""
        env = self.envelope()
        a = np.asarray(lengths, dtype=float)
        return d * (np.asarray(env.seq_time(d, a)) - float(env.microbatch_time(d, 0.0, 0.0)))

    def max_tokens(self, d: int) -> int:
        """Most tokens one micro-batch may hold on a group of ``d`` ranks without exceeding memory."""
        key = ("max_tokens", d)
        if key not in self._cache:
            flight = 1.0 if self.pp == 1 else float(self.pp)
            self._cache[key] = self.cost.max_tokens(self.group_strategy(d), layers=self.layers_per_stage,
                                                    head=self.pp == 1, in_flight_mbs=flight)
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
