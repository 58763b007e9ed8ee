"""Which data ranks run which experts each step: static, load-following (LAER-MoE) and EPLB placements.

Under fully sharded expert parallelism (flexmesh.runtime.parallel.expert_parallel) every expert's weights are
sharded over all data ranks of a pipeline stage, and each step each rank gathers the whole experts
a placement gives it; changing the placement moves no optimizer state and leaves the math as it is
(a token's expert computes the same product wherever it runs). So the placement is free to follow
the load, step by step.

A placement gives each of ``ranks`` ranks at most ``slots`` distinct experts (an expert may run on
several ranks: replicas). Every rank sends each expert's tokens to that expert's replicas in equal
contiguous shares, so rank ``r`` computes ``sum over its experts e of load[e] / replicas(e)``
(:meth:`ExpertPlacement.rank_loads`); the slowest rank sets the layer's time.

Policies (:data:`PLACEMENTS`):

- ``static``: expert parallelism as Megatron-LM and DeepSpeed place it, experts ``[r*k, (r+1)*k)`` on
  rank ``r`` (``k = ceil(E / ranks)``; with fewer experts than ranks, expert ``r mod E``), never moved.
- ``laer``: LAER-MoE's load-following placement (2602.11686), re-planned every step from the last
  step's load, which persists step to step (its measured lag-1 correlation: 0.73-0.86): every free
  slot takes a replica of the expert with the most tokens per replica (a max-heap), then replicas go
  largest first to the least-loaded rank with a free slot that lacks that expert (LPT).
- ``eplb``: DeepSeek's EPLB: the same replication and packing from the load averaged over a window of
  steps, re-planned every ``interval`` steps (it moves weights, so it changes rarely).
- ``current``: the same greedy, in every MoE layer of every micro-batch, from that micro-batch's own
  routing (one all-reduce of its tokens per expert before the experts are gathered): what a load
  that does not persist from step to step needs; the gather cannot start before the routing.

Written here rather than taken from a library: no maintained package plans expert replicas for a
load vector; the greedy is a few heap operations (LAER reports 0.5 ms at 64 devices).

>>> p = balanced_placement([90, 10, 10, 10], ranks=2, slots=3)
>>> p.hosts, [round(x, 1) for x in p.rank_loads([90, 10, 10, 10])]
(((0, 1, 2), (0, 1, 3)), [60.0, 60.0])
>>> static_placement(4, 2).imbalance([90, 10, 10, 10])
1.6666666666666667
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from flexmesh.cost.training.experts import default_slots
from flexmesh.errors import PlanError
from flexmesh.inputs import iter_jsonl

PLACEMENTS = ("static", "laer", "eplb", "current")


@dataclass(frozen=True)
class ExpertPlacement:
    """``hosts[r]``: the experts rank ``r`` runs (ascending, distinct); every expert runs somewhere."""

    num_experts: int
    hosts: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        seen = {e for h in self.hosts for e in h}
        if seen != set(range(self.num_experts)):
            lost = sorted(set(range(self.num_experts)) - seen)
            raise PlanError(f"expert placement runs no replica of experts {lost[:5]}; every expert needs a rank")
        for r, h in enumerate(self.hosts):
            if list(h) != sorted(set(h)):
                raise PlanError(f"expert placement gives rank {r} experts {list(h)}: they must be ascending and "
                                "distinct")

    @property
    def ranks(self) -> int:
        return len(self.hosts)

    @property
    def slots(self) -> int:
        return max(len(h) for h in self.hosts)

    def replicas(self) -> list[list[int]]:
        """``replicas()[e]``: the ranks running expert ``e``, ascending."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for r, h in enumerate(self.hosts):
            for e in h:
                out[e].append(r)
        return out

    def rank_loads(self, load: Sequence[float]) -> list[float]:
        """Tokens each rank computes when every expert's ``load`` splits equally over its replicas."""
        reps = [len(r) for r in self.replicas()]
        return [sum(load[e] / reps[e] for e in h) for h in self.hosts]

    def imbalance(self, load: Sequence[float]) -> float:
        """The most loaded rank over the mean (1.0: balanced; 1.0 too when nothing was routed)."""
        loads = self.rank_loads(load)
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    def to_dict(self) -> dict:
        return {"num_experts": self.num_experts, "hosts": [list(h) for h in self.hosts]}


def static_placement(num_experts: int, ranks: int) -> ExpertPlacement:
    """Experts in contiguous blocks of ``ceil(E / ranks)`` per rank; with fewer experts than ranks,
    expert ``r mod E`` on rank ``r`` (replicated round robin).

    >>> static_placement(4, 3).hosts, static_placement(2, 4).hosts
    (((0, 1), (2, 3), ()), ((0,), (1,), (0,), (1,)))
    """
    if ranks < 1:
        raise PlanError(f"an expert placement needs at least one rank, got {ranks}")
    if num_experts < ranks:
        return ExpertPlacement(num_experts, tuple((r % num_experts,) for r in range(ranks)))
    k = -(-num_experts // ranks)
    return ExpertPlacement(num_experts, tuple(tuple(range(min(r * k, num_experts), min((r + 1) * k, num_experts)))
                                              for r in range(ranks)))


def balanced_placement(load: Sequence[float], ranks: int, slots: int | None = None) -> ExpertPlacement:
    """LAER-MoE's greedy (module doc): replicas by tokens per replica, then largest first onto the
    least-loaded rank with a free slot lacking that expert (a replica no such rank is left for is
    dropped); static placement where that packs the busiest rank lighter. Deterministic: ties go to
    the lower expert and the lower rank, so every rank computes the same placement from the same load.

    >>> balanced_placement([1, 1, 1, 1, 1, 1e-25, 1e-25, 1e-25], ranks=2, slots=7).hosts  # expert 5's 2nd dropped
    ((0, 1, 2, 3, 4, 6, 7), (0, 1, 2, 3, 4, 5))
    """
    e = len(load)
    if e < 1 or ranks < 1:
        raise PlanError(f"an expert placement needs experts and ranks, got {e} experts and {ranks} ranks")
    bad = [i for i in range(e) if not math.isfinite(float(load[i])) or float(load[i]) < 0]
    if bad:  # a load read from a damaged checkpoint or trace, or a buffer nobody set
        raise PlanError(f"expert loads must be finite numbers >= 0; expert {bad[0]} has {load[bad[0]]!r}")
    slots = default_slots(e, ranks) if slots is None else slots
    if slots * ranks < e:
        raise PlanError(f"{ranks} ranks of {slots} expert slots cannot hold {e} experts; give each rank at least "
                        f"{-(-e // ranks)} slots")
    slots = min(slots, e)
    reps = [1] * e
    # every free slot: one more replica of the expert with the most tokens per replica (at most one per rank)
    heap = [(-float(load[i]), i) for i in range(e)]
    heapq.heapify(heap)
    for _ in range(slots * ranks - e):
        while heap and reps[heap[0][1]] >= ranks:
            heapq.heappop(heap)
        if not heap or -heap[0][0] <= 0:
            break
        _, i = heapq.heappop(heap)
        reps[i] += 1
        heapq.heappush(heap, (-float(load[i]) / reps[i], i))
    items = sorted(((float(load[i]) / reps[i], i) for i in range(e) for _ in range(reps[i])),
                   key=lambda t: (-t[0], t[1]))
    hosts: list[set[int]] = [set() for _ in range(ranks)]
    ranks_heap = [(0.0, r) for r in range(ranks)]  # (load so far, rank): the least loaded with a free slot on top
    for share, i in items:
        skipped = []
        while ranks_heap:
            busy, r = heapq.heappop(ranks_heap)
            if i not in hosts[r]:
                hosts[r].add(i)
                if len(hosts[r]) < slots:
                    heapq.heappush(ranks_heap, (busy + share, r))
                break
            skipped.append((busy, r))
        # The heap emptied without a placement when every rank with a free slot holds expert i already:
        # this replica is dropped (an expert's first replica always finds a rank, so each keeps a host).
        for s in skipped:
            heapq.heappush(ranks_heap, s)
    greedy = ExpertPlacement(e, tuple(tuple(sorted(h)) for h in hosts))
    # Packing replicas largest first under one replica per rank is a heuristic, and with few free slots
    # it can place a hot expert's two halves beside other hot experts: then the static blocks, which
    # fit the same slots, are kept (never a busier rank than static placement on this load).
    static = static_placement(e, ranks)
    return static if max(static.rank_loads(load)) < max(greedy.rank_loads(load)) else greedy


@dataclass
class Placer:
    """The placement of every MoE layer, step by step, for one policy (:data:`PLACEMENTS`).

    :meth:`place` gives the placements of the next step; :meth:`observe` takes the step's global load
    per layer (tokens per expert), the same on every rank. ``window`` and ``interval``: ``eplb``'s
    averaging window and re-planning period in steps.
    """

    policy: str
    layers: tuple[int, ...]  # the MoE layers this placer places (global layer numbers)
    num_experts: int
    ranks: int
    slots: int | None = None
    window: int = 10
    interval: int = 10

    def __post_init__(self) -> None:
        if self.policy not in PLACEMENTS:
            raise PlanError(f"expert placement {self.policy!r} is not one of {', '.join(PLACEMENTS)}")
        self._history: list[dict[int, list[float]]] = []
        self._steps = 0
        static = static_placement(self.num_experts, self.ranks)
        self._current = {layer: static for layer in self.layers}

    def place(self) -> dict[int, ExpertPlacement]:
        return dict(self._current)

    def observe(self, load: dict[int, Sequence[float]]) -> None:
        self._steps += 1
        if self.policy in ("static", "current"):  # never moves; placed inside each layer (the runtime)
            return
        self._history = (self._history + [{k: list(v) for k, v in load.items()}])[-self.window:]
        if self.policy == "eplb" and self._steps % self.interval:
            return
        for layer in self.layers:
            rows = [h[layer] for h in self._history] if self.policy == "eplb" else [load[layer]]
            mean = [sum(col) / len(rows) for col in zip(*rows)]
            self._current[layer] = balanced_placement(mean, self.ranks, self.slots)


def trace_imbalance(rows: Iterable[dict], placement: str, ranks: int, slots: int | None = None) -> float:
    """Mean max/mean routed tokens per rank when ``placement`` places the experts of a recorded trace
    (routing.jsonl rows: ``layer``, ``expert_tokens`` per step, in step order) over ``ranks`` ranks,
    each step placed from the steps before it as the runtime places them; the first step of each
    layer, placed statically by every policy for want of a history, is left out (a steady-state figure).

    >>> rows = [{"layer": 0, "expert_tokens": [30, 10, 10, 10]}] * 3
    >>> trace_imbalance(rows, "static", 2), trace_imbalance(rows, "laer", 2)
    (1.3333333333333333, 1.0)
    """
    by_layer: dict[int, list[list[float]]] = {}
    for r in rows:
        by_layer.setdefault(int(r["layer"]), []).append([float(x) for x in r["expert_tokens"]])
    ratios = []
    for layer, loads in by_layer.items():
        placer = Placer(placement, (layer,), len(loads[0]), ranks, slots)
        for i, load in enumerate(loads):
            if i:
                placed = balanced_placement(load, ranks, slots) if placement == "current" else placer.place()[layer]
                ratios.append(placed.imbalance(load))
            placer.observe({layer: load})
    if not ratios:
        raise PlanError("the routing trace holds fewer than two steps of a layer; record a longer run")
    return sum(ratios) / len(ratios)


def read_trace(path: str | Path) -> list[dict]:
    """The rows of a routing.jsonl (flexmesh.runtime.train.expert_training); PlanError naming the file and line
    when it is not one."""
    path = Path(path)
    rows = []
    for n, row in iter_jsonl(path, PlanError, missing=f"routing trace {str(path)!r} does not exist; give a "
                             "routing.jsonl that `flexmesh train` wrote", invalid="not a routing record"):
        i = n - 1
        try:
            loads = [float(x) for x in row["expert_tokens"]]
            int(row["layer"])
        except (ValueError, KeyError, TypeError) as e:
            raise PlanError(f"{path} line {i + 1} is not a routing record (needs layer and expert_tokens: {e}); "
                            "give a routing.jsonl that `flexmesh train` wrote") from None
        if not loads or min(loads) < 0:
            raise PlanError(f"{path} line {i + 1}: expert_tokens must be a non-empty list of counts >= 0")
        rows.append(row)
    if not rows:
        raise PlanError(f"routing trace {path} holds no rows")
    return rows
