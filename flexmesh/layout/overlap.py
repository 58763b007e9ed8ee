"""Overlap: which communication of a plan runs under compute, a plan-level choice the search prices.

Three options, each what a framework really does (docs/cost-model.md, "Overlap", has the sources):

- ``tp_comm``: tensor-parallel (sequence-parallel) all-gathers and reduce-scatters pipelined with the
  GEMMs they feed (Megatron-Core ``--tp-comm-overlap``, TransformerEngine userbuffers). Off: every TP
  collective is exposed, as the DTensor tensor parallelism of flexmesh's runtime runs it.
- ``grad_reduce``: when gradients of ZeRO-2/3 layers are reduce-scattered. ``"last"``: accumulated
  unsharded over the step's micro-batches and reduced once, bucket by bucket as the last
  micro-batch's backward finishes them (FSDP2 with ``set_requires_gradient_sync(is_last)``,
  Megatron-Core's ``overlap_grad_reduce``); ``"bucketed"``: reduce-scattered in every micro-batch's
  backward, bucket by bucket (FSDP2's default), so gradients stay sharded. ZeRO-0/1 layers accumulate
  locally and reduce once in either case.
- ``zero3_prefetch``: ZeRO-3 all-gathers issued one layer ahead, under the previous layer's compute
  (FSDP2's default), at the price of a second layer's gathered weights; off, each gather waits.

``Overlap()`` is ZeRO as its paper describes it (gradients reduce-scattered every micro-batch) with
nothing else overlapped; :data:`RUNTIME` is what flexmesh's runtime (FSDP2, DTensor TP) runs, and
plans without the field read as it.

>>> Overlap.from_dict({"tp_comm": True})
Overlap(tp_comm=True, grad_reduce='bucketed', zero3_prefetch=True)
>>> RUNTIME.to_dict()
{'tp_comm': False, 'grad_reduce': 'last', 'zero3_prefetch': True}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import lru_cache

from flexmesh.errors import PlanError
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.values import flag, known_keys, mapping

GRAD_REDUCE = ("last", "bucketed")


@dataclass(frozen=True)
class Overlap:
    """Communication/compute overlap of a plan (see the module docstring)."""

    tp_comm: bool = False
    grad_reduce: str = "bucketed"
    zero3_prefetch: bool = True

    def __post_init__(self) -> None:
        for f in ("tp_comm", "zero3_prefetch"):
            flag(getattr(self, f), f"overlap {f}", PlanError)
        if self.grad_reduce not in GRAD_REDUCE:
            raise PlanError(f"overlap grad_reduce must be one of {', '.join(GRAD_REDUCE)}, got {self.grad_reduce!r}")

    def to_dict(self) -> dict:
        """The plan file's ``overlap`` object."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object) -> "Overlap":
        """Read a plan file's ``overlap`` object; missing keys take :class:`Overlap`'s defaults."""
        given = mapping(d, "plan overlap", PlanError)
        known_keys(given, {f.name for f in fields(cls)}, "plan overlap", PlanError)
        return cls(**given)

    @property
    def label(self) -> str:
        """Short form for one-line plan summaries, e.g. ``tp-overlap grad:last prefetch``."""
        parts = ["tp-overlap"] if self.tp_comm else []
        parts.append(f"grad:{self.grad_reduce}")
        if not self.zero3_prefetch:
            parts.append("no-prefetch")
        return " ".join(parts)


# The cost model's default when a caller names none (ZeRO's paper pricing, nothing else overlapped).
NO_OVERLAP = Overlap()
# What flexmesh's runtime runs: DTensor TP without communication overlap (not available on CPU/gloo),
# FSDP2's implicit all-gather prefetch, and gradients reduced once in the last micro-batch's backward
# (the trainer's set_requires_gradient_sync(is_last)).
RUNTIME = Overlap(tp_comm=False, grad_reduce="last", zero3_prefetch=True)
# Never slower than leaving them off: TP communication under the GEMMs and ZeRO-3 gathers prefetched
# (what Megatron-Core with --tp-comm-overlap and FSDP2 run). The search's first option and how the
# baselines and mixed-device plans are priced (flexmesh.search.space).
FASTEST = Overlap(tp_comm=True, grad_reduce="bucketed", zero3_prefetch=True)


@lru_cache(maxsize=None)  # bounded by the strategies x overlap options one process prices
def acting(overlap: Overlap, s: LayerStrategy, layer: bool) -> Overlap:
    """``overlap`` with the options that change nothing for ``s`` (a layer, or with ``layer`` False
    the embedding and head) set to :data:`NO_OVERLAP`'s, so that costs priced alike share a cache entry.

    TP overlap acts on a layer with tp > 1 (its collectives and buffers; the ends have no TP
    collectives); the gradient-reduce choice on ZeRO-2/3 states sharded over more than one rank;
    prefetching on ZeRO-3 (a layer's gathered-weight buffers even unsharded, the ends' gathers only).

    >>> acting(RUNTIME, LayerStrategy(dp=4, zero=1), True) == NO_OVERLAP
    True
    """
    sharded = s.shard_degree > 1
    return Overlap(tp_comm=overlap.tp_comm and layer and s.tp > 1,
                   grad_reduce=overlap.grad_reduce if s.zero >= 2 and sharded else NO_OVERLAP.grad_reduce,
                   zero3_prefetch=overlap.zero3_prefetch if s.zero == 3 and (layer or sharded)
                   else NO_OVERLAP.zero3_prefetch)
