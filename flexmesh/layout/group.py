"""A replica group of a plan (flexmesh.layout.plan): ``dp`` identical pipelines of ``pp`` stages, each
stage a block of ranks, a :class:`~flexmesh.layout.strategy.LayerStrategy` per layer, a share of each
step's sequences in ``num_microbatches`` micro-batches, and the token budget of one micro-batch on one
data rank that follows from them (:meth:`ReplicaGroup.microbatch_tokens`).

What holds of any group, whatever model or cluster it runs, is checked when it is made: its chunks
cover layers ``0..L`` in order (only the first may hold the embedding alone, and the last the head
alone), every layer of a chunk runs on its pipeline rank's block (``tp x cp x dp`` ranks), and its
share divides into its micro-batches. What depends on the model and the devices is
flexmesh.search.check's.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexmesh.errors import PlanError
from flexmesh.layout.enums import PipelineSchedule
from flexmesh.layout.ranks import parse_rank_runs, rank_runs
from flexmesh.layout.strategy import LayerStrategy, chunk_anchors
from flexmesh.spec.values import known_keys, mapping, sequence, whole

_GROUP_KEYS = ("ranks", "share", "num_microbatches", "microbatch_tokens", "virtual_stages", "stages")


@dataclass(frozen=True)
class StagePlan:
    """A pipeline stage (or, with interleaving, one model chunk) holding layers [start, end)."""

    start: int
    end: int
    strategies: tuple[LayerStrategy, ...]

    def __post_init__(self) -> None:
        whole(self.start, "stage start layer", PlanError, minimum=0)
        whole(self.end, "stage end layer", PlanError, minimum=0)
        if self.end < self.start:
            raise PlanError(f"stage layers [{self.start}, {self.end}) are empty or reversed")
        if len(self.strategies) != self.end - self.start:
            raise PlanError(
                f"stage [{self.start}, {self.end}) has {self.end - self.start} layers but "
                f"{len(self.strategies)} strategies"
            )

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    @property
    def devices(self) -> int:
        return self.strategies[0].devices if self.strategies else 0

    @property
    def compact(self) -> str:
        """Run-length form, e.g. ``8x tp2-dp4z1 + 2x tp2-dp4z1-ac``."""
        runs: list[list] = []
        for s in self.strategies:
            if runs and runs[-1][1] == s:
                runs[-1][0] += 1
            else:
                runs.append([1, s])
        return " + ".join(f"{n}x {s}" for n, s in runs)


@dataclass(frozen=True)
class ReplicaGroup:
    """``dp`` identical pipelines (see the module doc): ``blocks[p]`` the ranks of pipeline rank ``p`` in
    (dp, cp, tp) order; ``stages`` the ``pp x virtual_stages`` model chunks, chunk ``i`` on pipeline
    rank ``i % pp`` (Megatron's interleaved order); ``share`` the sequences per step it takes, in
    ``num_microbatches`` micro-batches."""

    blocks: tuple[tuple[int, ...], ...]
    stages: tuple[StagePlan, ...]
    num_microbatches: int
    share: int
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        whole(self.num_microbatches, "group num_microbatches", PlanError, minimum=None)
        whole(self.share, "group share", PlanError, minimum=None)
        whole(self.virtual_stages, "group virtual_stages", PlanError, minimum=None)
        if not self.blocks or any(not b for b in self.blocks):
            raise PlanError("a replica group needs at least one pipeline stage, each on at least one rank")
        if self.virtual_stages < 1 or self.num_microbatches < 1:
            raise PlanError("pp, virtual_stages and num_microbatches must all be >= 1")
        if len(self.stages) != self.pp * self.virtual_stages:
            raise PlanError(
                f"plan has {len(self.stages)} stages but pp x virtual_stages = {self.pp} x {self.virtual_stages}"
            )
        if self.share < 1:
            raise PlanError(f"a replica group's share must be at least one sequence per step, got {self.share}")
        if self.share % self.num_microbatches:
            raise PlanError(f"a share of {self.share} sequences per step (the global batch, for one group) is not "
                            f"divisible into {self.num_microbatches} micro-batches")
        self._check_stages()

    def _check_stages(self) -> None:
        """The chunks cover layers 0..L in order and every layer of chunk ``i`` runs on the block of pipeline rank
        ``i % pp``. A chunk may hold no layers: at the ends the embedding or the head alone (Llama 3's pipeline), in
        between a rank that passes activations on (AMP's published plans, 2210.07297, hold one)."""
        expect = 0
        for i, st in enumerate(self.stages):
            if st.start != expect:
                raise PlanError(f"stage {i} starts at layer {st.start} but the previous stage ends at {expect}; "
                                "stages must cover consecutive layers in order")
            expect = st.end
            ranks = len(self.blocks[i % self.pp])
            for j, s in enumerate(st.strategies):
                if s.devices != ranks:
                    raise PlanError(f"stage {i}, layer {st.start + j} ({s}) uses tp x cp x dp = {s.devices} devices "
                                    f"but its pipeline rank has {ranks}; make tp*cp*dp equal {ranks}")

    @property
    def pp(self) -> int:
        return len(self.blocks)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for b in self.blocks for r in b)

    @property
    def stage_devices(self) -> int:
        """Ranks per pipeline stage (the first block's; the runtime needs them equal)."""
        return len(self.blocks[0])

    @property
    def num_layers(self) -> int:
        return sum(s.num_layers for s in self.stages)

    @property
    def microbatch_size(self) -> int:
        """Sequences per micro-batch across the whole stage (split further over each layer's dp)."""
        return self.share // self.num_microbatches

    @property
    def data_ranks(self) -> int:
        """Ranks of a stage that hold the same weights and share the data: the layers' dp x cp."""
        if not any(st.strategies for st in self.stages):
            return 1
        first = self.anchor(0)
        return first.dp * first.cp

    def microbatch_tokens(self, seq_len: int) -> int:
        """Tokens one data rank packs into one micro-batch: :attr:`microbatch_size` sequences of
        ``seq_len`` tokens split over the group's :attr:`data_ranks`."""
        return max(1, -(-self.microbatch_size * seq_len // self.data_ranks))

    def stage_of_layer(self, layer: int) -> int:
        """The index into ``stages`` of the chunk holding ``layer``."""
        for i, s in enumerate(self.stages):
            if s.start <= layer < s.end:
                return i
        raise PlanError(f"layer {layer} is outside this group's [0, {self.num_layers})")

    def stage_tp(self, index: int) -> int:
        """The tensor-parallel degree of chunk ``index`` (its first layer's; a chunk of the embedding or
        the head alone, its pipeline rank's other chunks': :func:`chunk_anchors`)."""
        return self.anchor(index).tp

    def anchor(self, index: int) -> LayerStrategy:
        """Chunk ``index``'s first layer's strategy, or for a chunk of no layers its :func:`chunk_anchors`'."""
        return chunk_anchors([st.strategies for st in self.stages], self.pp)[index]

    def layer_strategies(self) -> list[LayerStrategy]:
        out: list[LayerStrategy] = []
        for st in sorted(self.stages, key=lambda s: (s.start, s.end)):
            out.extend(st.strategies)
        return out

    def relay(self, index: int) -> bool:
        """Whether chunk ``index`` holds no layers between two others: its rank only passes activations on."""
        return not self.stages[index].strategies and 0 < index < len(self.stages) - 1

    def layout(self, pipeline_schedule: PipelineSchedule) -> str:
        """One line, e.g. ``pp2 1f1b m8 | [0,16) 16x tp4-dp1z1 | ...``."""
        sched = str(pipeline_schedule) + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
        ends = {0: "embedding", len(self.stages) - 1: "head"}  # a chunk of no layers (chunk_anchors)
        stages = " | ".join(f"[{s.start},{s.end}) {'relay' if self.relay(i) else s.compact or ends[i]}"
                            for i, s in enumerate(self.stages))
        return f"pp{self.pp} {sched} m{self.num_microbatches} | {stages}"

    def to_dict(self, seq_len: int) -> dict:
        """The group in a plan file of sequences of ``seq_len`` tokens (its :meth:`microbatch_tokens` shown)."""
        return {"ranks": [rank_runs(b) for b in self.blocks], "share": self.share,
                "num_microbatches": self.num_microbatches, "microbatch_tokens": self.microbatch_tokens(seq_len),
                "virtual_stages": self.virtual_stages,
                "stages": [{"layers": [s.start, s.end], "strategies": [str(x) for x in s.strategies]}
                           for s in self.stages]}

    @classmethod
    def from_dict(cls, d: dict, where: str, seq_len: int) -> "ReplicaGroup":
        """A group of a plan file of sequences of ``seq_len`` tokens; its ``microbatch_tokens``, where
        written, must be the budget its fields give."""
        mapping(d, where, PlanError)
        known_keys(d, _GROUP_KEYS, where, PlanError)
        missing = [k for k in ("ranks", "share", "stages") if k not in d]
        if missing:
            raise PlanError(f"{where} is missing {', '.join(missing)}")
        blocks = tuple(parse_rank_runs(b, f"{where} ranks[{p}]")
                       for p, b in enumerate(sequence(d["ranks"], f"{where} ranks", PlanError)))
        stages = parse_stages(d["stages"], where)
        try:
            group = cls(blocks, stages, whole(d.get("num_microbatches", 1), f"{where} num_microbatches", PlanError),
                        whole(d["share"], f"{where} share", PlanError),
                        whole(d.get("virtual_stages", 1), f"{where} virtual_stages", PlanError))
        except PlanError as e:
            raise PlanError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
        budget = group.microbatch_tokens(seq_len)
        if d.get("microbatch_tokens", budget) != budget:
            raise PlanError(f"{where}: microbatch_tokens {d['microbatch_tokens']!r} is not the budget its fields give: "
                            f"{group.microbatch_size} sequences per micro-batch (share {group.share} / "
                            f"{group.num_microbatches}) of {seq_len} tokens over {group.data_ranks} data ranks, "
                            f"{budget}; change num_microbatches, or drop microbatch_tokens to derive it")
        return group


def _runs_of(item: object, most: int) -> list:
    """``"NNx S"`` as NN copies of ``S`` (NN at most ``most``, the stage's layers); anything else as itself
    (LayerStrategy.parse judges it)."""
    if isinstance(item, str) and "x " in item:
        count, _, strategy = item.partition("x ")
        if count.strip().isdigit() and int(count) >= 1:
            if int(count) > most:
                raise PlanError(f"{item!r} repeats {int(count)} layers, more than the stage's {most}")
            return [strategy.strip()] * int(count)
    return [item]


def parse_stages(value: object, where: str) -> tuple[StagePlan, ...]:
    """``stages`` of a plan file: ``[{"layers": [start, end], "strategies": [...]}, ...]``; a strategy
    may be written ``"NNx S"`` for NN layers in a row (:attr:`StagePlan.compact`'s form).

    >>> [str(s) for s in parse_stages([{"layers": [0, 3], "strategies": ["2x tp2-dp1z0", "tp2-dp1z0-ac"]}],
    ...                                "plan")[0].strategies]
    ['tp2-dp1z0', 'tp2-dp1z0', 'tp2-dp1z0-ac']
    """
    stages = []
    for i, s in enumerate(sequence(value, f"{where} stages", PlanError)):
        try:
            start, end = s["layers"]
            items = sequence(s["strategies"], "strategies", PlanError)
        except (KeyError, ValueError, TypeError, PlanError):
            raise PlanError(f"stage {i}: needs 'layers': [start, end] and 'strategies': [...]") from None
        start = whole(start, f"stage {i} start layer", PlanError, minimum=0)
        end = whole(end, f"stage {i} end layer", PlanError, minimum=0)
        try:
            strategies = tuple(LayerStrategy.parse(x) for item in items for x in _runs_of(item, max(end - start, 1)))
        except (ValueError, TypeError, AttributeError, PlanError) as e:
            raise PlanError(f"stage {i} strategies: {str(e).strip() or type(e).__name__}") from None
        stages.append(StagePlan(start, end, strategies))
    return tuple(stages)
