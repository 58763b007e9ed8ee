"""The cost model's answers for one step's schedules: micro-batch times and phases, token caps, syncs.

The per-step scheduler (flexmesh.schedule) prices many micro-batches at once (numpy arrays of tokens
and squared tokens) and the step simulator (flexmesh.sim) orders their passes; both ask
:class:`~flexmesh.cost.training.model.CostModel`, which takes these methods from :class:`StepPricing`. The
formulas are the layer's own (:meth:`CostModel._layer_phases`), summed over a stage's layers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from flexmesh.cost.training.experts import ExpertParallel, expert_sync, synced_params
from flexmesh.cost.training.memory import layer_transient_bytes
from flexmesh.cost.training.work import MicrobatchPhases, Work
from flexmesh.layout.enums import CPKind
from flexmesh.layout.overlap import Overlap
from flexmesh.layout.strategy import LayerStrategy

if TYPE_CHECKING:
    from flexmesh.cost.device.hardware import Hardware
    from flexmesh.cost.training.timing import LayerTiming
    from flexmesh.cost.training.work import LayerCost
    from flexmesh.spec.cluster import ClusterSpec
    from flexmesh.spec.model import ModelSpec


class StepPricing:
    """Per-step pricing, mixed into :class:`~flexmesh.cost.training.model.CostModel` (see the module doc)."""

    if TYPE_CHECKING:  # what CostModel provides
        model: ModelSpec
        cluster: ClusterSpec
        hw: Hardware
        experts: ExpertParallel
        grad_bytes: float
        timing: LayerTiming
        step_overlap: Overlap

        @property
        def memory_budget(self) -> float: ...

        def layer(self, s: LayerStrategy, work: Work, overlap: Overlap = ...) -> LayerCost: ...

        def ends(self, s: LayerStrategy, work: Work, embed: bool, head: bool, overlap: Overlap = ...) -> LayerCost: ...

        def _layer_phases(self, s: LayerStrategy, tokens, sq_tokens, overlap: Overlap = ...): ...  # noqa: ANN001

        def _grad_comm(self, params: float, s: LayerStrategy, work_fwd: float, work_bwd: float,
                       overlap: Overlap = ...): ...  # noqa: ANN202

    # ---- for the per-step scheduler -----------------------------------------------------------------
    def microbatch_time(self, s: LayerStrategy, tokens, sq_tokens, layers: int | None = None,
                        embed: bool = True, head: bool = True):
        """Forward + backward seconds of one micro-batch on a tp x cp group; numpy arrays accepted.

        Time is exactly linear in ``tokens`` and ``sq_tokens`` except where communication hides under
        compute, so it is evaluated term by term rather than through fitted coefficients. ZeRO
        collectives are per step and left to :meth:`step_grad_sync`."""
        return self.microbatch_phases(s, tokens, sq_tokens, layers, head, embed=embed).total

    def activation_bytes_per_token(self, s: LayerStrategy, layers: int | None = None,
                                   in_flight_mbs: float = 1.0) -> float:
        """Saved-activation bytes per token of a micro-batch on each device of a tp x cp group."""
        layers = self.model.num_layers if layers is None else layers
        return self.timing.activation_bytes_per_token(s, bool(s.recompute)) * layers * in_flight_mbs

    def max_tokens(self, s: LayerStrategy, layers: int | None = None, embed: bool = True, head: bool = True,
                   in_flight_mbs: float = 1.0, overlap: Overlap | None = None) -> int:
        """Largest micro-batch (tokens on the tp x cp group) that fits in device memory under ``s``
        (and ``overlap``, default :attr:`step_overlap`)."""
        layers = self.model.num_layers if layers is None else layers
        overlap = self.step_overlap if overlap is None else overlap
        one = Work(tokens=1.0, sq_tokens=1.0)
        states = self.layer(s, one, overlap).states * layers
        if embed or head:
            states += self.ends(s, one, embed, head, overlap).states
        per_token = self.activation_bytes_per_token(s, layers, in_flight_mbs)
        if s.recompute:  # one layer's full activations while it is recomputed
            per_token += self.timing.activation_bytes_per_token(s, False)
        if head:
            per_token += self.timing.logit_bytes(s, 1.0)
        # Transient buffers: a constant part and a part linear in the micro-batch's tokens.
        transient = layer_transient_bytes(self.model, s, 0.0, overlap, 0.0, self.grad_bytes)
        per_token += layer_transient_bytes(self.model, s, 1.0, overlap, 0.0, self.grad_bytes) - transient
        free = self.memory_budget - states - transient
        return max(0, int(free / per_token))

    # ---- for the simulator ------------------------------------------------------------------------
    def microbatch_phases(self, s: LayerStrategy, tokens, sq_tokens, layers: int | None = None,
                          head: bool = True, embed: bool = False) -> "MicrobatchPhases":
        """:meth:`microbatch_time` split into forward and backward, compute and exposed communication,
        so that a pipeline simulation can order the passes. The embedding costs what the timing says
        (nothing analytically: a lookup has no FLOPs to count; a model profile's fit). TP communication
        is exposed or overlapped as :attr:`step_overlap` says."""
        layers = self.model.num_layers if layers is None else layers
        tokens = np.asarray(tokens, dtype=float)
        sq = np.asarray(sq_tokens, dtype=float)
        fwd, bwd, cf, cb = self._layer_phases(s, tokens, sq, self.step_overlap)
        head_f, head_b = self.timing.head_times(s, tokens) if head else (0.0, 0.0)
        if embed:
            emb_f, emb_b = self.timing.embedding_times(s, tokens)
            head_f, head_b = head_f + emb_f, head_b + emb_b
        zero = np.zeros_like(tokens)
        return MicrobatchPhases(fwd=fwd * layers + head_f, bwd=bwd * layers + head_b,
                                comm_fwd=(cf + zero) * layers, comm_bwd=(cb + zero) * layers)

    def step_grad_sync(self, s: LayerStrategy, data_ranks: int, layers: int | None = None,
                       embed: bool = True, head: bool = True) -> tuple[float, float]:
        """(gradient sync, optimizer) seconds, once per step, for one stage's parameters over ``data_ranks``.

        For per-step schedules whose ranks run different numbers of micro-batches: gradients are
        accumulated locally and reduced once at the end of the step over every data rank holding the
        same weights (tp-strided). ZeRO-0/1 all-reduce the gradients; ZeRO-2 and ZeRO-3 reduce-scatter
        them and all-gather the updated weights (ZeRO-3's per-layer gathers inside the step are
        prefetched under compute, as in :meth:`layer`). Nothing is hidden here; callers that overlap
        the sync with a backward pass do so themselves."""
        layers = self.model.num_layers if layers is None else layers
        m = self.model
        t = replace(s, cp=1, cp_kind=CPKind.NONE, dp=data_ranks, zero=min(s.zero, 2))
        # routed experts: below; the router and shared expert are whole on every tp rank
        params = [(synced_params(m, s.tp), layers)]
        if embed:
            params.append((m.embedding_params, 1))
        if head:  # a tied head on another stage keeps its own copy (as in :meth:`ends`)
            params.append((m.head_params + (m.vocab * m.hidden if m.tie_embeddings and not embed else 0), 1))
        sync = optim = 0.0
        for p, n in params:
            zf, zb, once, opt = self._grad_comm(p, t, 0.0, 0.0)
            sync += n * (zf + zb + once)
            optim += n * opt
        if m.is_moe:
            esync, eopt = expert_sync(self.hw.collective_time, self.cluster, m, self.experts, data_ranks * s.tp,
                                      self.grad_bytes, self.timing.optimizer_s_per_param())
            sync, optim = sync + layers * esync, optim + layers * eopt
        return sync, optim
