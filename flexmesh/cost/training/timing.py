"""The one interface through which :class:`flexmesh.cost.CostModel` learns a layer's compute and bytes.

A :class:`LayerTiming` answers, per :class:`~flexmesh.layout.LayerStrategy`, how long a layer's and
the ends' (embedding, final norm + LM head + loss) passes take, how many bytes they keep for
backward, and what parameters and the optimizer step cost. The cost model adds everything that
depends on the cluster rather than on the layer: collectives (unless the timing says it measured
them), pipeline, ZeRO, memory budgets.

Two implementations:

- :class:`flexmesh.cost.training.analytic.AnalyticTiming`: FLOPs over the (datasheet or measured) throughput
  of a :class:`~flexmesh.cost.Hardware`, activation bytes counted tensor by tensor; the default;
- ``flexmesh.profile.timing.ProfiledTiming``: a model profile's fitted times and measured bytes
  (``flexmesh profile model``). The cost package never imports it: the profile package builds it.

Times accept numpy arrays for ``tokens`` / ``sq_tokens`` (the scheduler prices many micro-batches at
once); byte counts are per device of the strategy's tp x cp group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from flexmesh.cost.training.work import Amount
from flexmesh.layout.stack import Stack
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.model import ModelSpec


@dataclass(frozen=True)
class LayerTimes:
    """Seconds of one transformer layer on a tp x cp group (scalars or numpy arrays).

    ``includes_communication``: the times were measured under real tp x cp process groups, so the
    tensor- and context-parallel collectives are already in them and the cost model adds none.
    ``attention`` is the forward's attention part, under which ring attention's K/V hops hide; it is
    only read when communication is not included.
    """

    fwd: Amount
    bwd: Amount  # including the recomputed forward when the strategy recomputes
    attention: Amount = 0.0
    includes_communication: bool = False


class LayerTiming(Protocol):
    """Compute times and per-device byte counts of a layer and of the ends, per strategy."""

    dtype: str  # the dtype every byte count is in (and the one the throughput was taken for)
    stack: Stack  # how the training stack it prices runs a layer (flexmesh.layout.stack)

    def check_model(self, model: ModelSpec) -> None:
        """Raise unless ``model`` has the shape this timing describes (any dtype)."""
        ...

    def source(self, hardware_source: str) -> str:
        """Where the cost model's numbers come from, given where its :class:`Hardware`'s come from."""
        ...

    def layer_times(self, s: LayerStrategy, tokens: Amount, sq_tokens: Amount) -> LayerTimes:
        """One layer's forward and backward over ``tokens`` whose squared lengths sum to ``sq_tokens``."""
        ...

    def embedding_times(self, s: LayerStrategy, tokens: Amount) -> tuple[Amount, Amount]:
        """(forward, backward) seconds of the embedding over ``tokens`` on a tp x cp group."""
        ...

    def head_times(self, s: LayerStrategy, tokens: Amount) -> tuple[Amount, Amount]:
        """(forward, backward) seconds of the final norm + LM head + loss over ``tokens``."""
        ...

    def activation_bytes_per_token(self, s: LayerStrategy, recompute: bool) -> float:
        """Bytes one layer keeps for backward per token of the micro-batch (no mask term); with
        ``recompute`` what a recomputed layer keeps (``s.recompute`` is not read)."""
        ...

    def activation_bytes(self, s: LayerStrategy, tokens: float, recompute: bool) -> float:
        """Bytes one layer keeps for backward for ``tokens`` (no mask term), as above."""
        ...

    def mask_bytes(self, s: LayerStrategy, tokens: float, sq_tokens: float = 0.0) -> float:
        """Bytes of an attention mask or scores a layer's attention kernel keeps for ``tokens`` whose
        squared sequence lengths sum to ``sq_tokens`` (0: none)."""
        ...

    def carried_bytes(self, s: LayerStrategy, prefix: float, tokens: float) -> float:
        """Bytes a layer keeps beyond the same ``tokens`` whole when they continue a cut document's
        ``prefix`` (flexmesh.runtime.model.carry)."""
        ...

    def embedding_activation_bytes(self, s: LayerStrategy, tokens: float) -> float:
        """Bytes the embedding keeps for backward for ``tokens``."""
        ...

    def logit_bytes(self, s: LayerStrategy, tokens: float) -> float:
        """Bytes the head and loss keep for backward for ``tokens``."""
        ...

    def state_bytes_per_param(self) -> tuple[float, float, float]:
        """(weight, gradient, optimizer-state) bytes per parameter, before any sharding."""
        ...

    def optimizer_s_per_param(self) -> float:
        """Seconds of the optimizer step per (local) parameter."""
        ...

    def stage_fixed_s(self) -> float:
        """Seconds the framework adds per pipeline chunk per micro-batch (forward and backward together,
        beyond the chunk's layers, ends and sends)."""
        ...
