"""A mixture of experts as a part of the cost model: what a MoE layer adds to a dense layer's price.

The formulas are :mod:`flexmesh.cost.training.experts`' (with their sources); this part holds how the
experts run (:class:`~flexmesh.cost.training.experts.ExpertParallel`) and answers the layer's pricing
(:mod:`flexmesh.cost.training.layer`) at the four places where experts change it: the compute of a
timing measured on one rank (:meth:`ExpertLayers.times`), the exchanges of tokens and experts
(:meth:`ExpertLayers.communication`), the experts' states, gradient sync and gathered copies
(:meth:`ExpertLayers.layer_terms`) and the per-step sync (:meth:`ExpertLayers.step_sync`).
"""

from __future__ import annotations

from dataclasses import replace

from flexmesh.cost.device.hardware import Hardware
from flexmesh.cost.training.analytic import AnalyticTiming
from flexmesh.cost.training.experts import (
    ExpertParallel,
    expert_imbalanced,
    expert_states,
    expert_sync,
    gathered_expert_bytes,
    moe_communication,
)
from flexmesh.cost.training.timing import LayerTimes, LayerTiming
from flexmesh.cost.training.work import Amount
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.model import ModelSpec


class ExpertLayers:
    """The experts of ``model`` (a MoE model) run as ``parallel`` says, on ``hw``; ``timing`` the layer
    timing of the cost model (a measured one runs every expert on one rank: :meth:`times`)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, hw: Hardware, timing: LayerTiming,
                 parallel: ExpertParallel):
        self.model, self.cluster, self.hw = model, cluster, hw
        self.parallel = parallel
        self.measured = not isinstance(timing, AnalyticTiming)
        self._even: AnalyticTiming | None = None  # experts at an even load, for a measured timing

    def times(self, times: LayerTimes, s: LayerStrategy, tokens: Amount, sq_tokens: Amount) -> LayerTimes:
        """``times`` with the routed experts' part at the most loaded rank's load: a measured timing ran
        every expert on one rank, so its share was even (:func:`expert_imbalanced`); an analytic one
        prices the imbalance itself."""
        if not self.measured:
            return times
        if self._even is None:
            self._even = AnalyticTiming(self.model, self.hw, experts=replace(self.parallel, imbalance=1.0, measured=()))
        return expert_imbalanced(times, self._even, self.parallel.imbalance_at(s.dp * s.cp * s.tp), s, tokens,
                                 sq_tokens)

    def communication(self, s: LayerStrategy, dev_tokens: Amount, fwd: Amount,
                      bwd: Amount) -> tuple[Amount, Amount, Amount, Amount]:
        """(tokens forward, tokens backward, experts forward, experts backward) seconds of the experts'
        exchanges over the stage's ranks, each tp rank of a group holding ``dev_tokens``; with
        ``prefetch`` the experts' exchanges hide under the layer's ``fwd`` / ``bwd`` compute."""
        ct, hw = self.hw.collective_time, self.hw
        tf, tb, wf, wb = moe_communication(ct, self.cluster, self.model, self.parallel, s.dp * s.cp * s.tp,
                                           dev_tokens / s.tp, bool(s.recompute))
        if self.parallel.prefetch:  # the weights' exchanges under the layer's compute
            wf, wb = hw.exposed(wf, fwd), hw.exposed(wb, bwd)
        return tf, tb, wf, wb

    def layer_terms(self, s: LayerStrategy, state_bytes: tuple[float, float, float], grad_bytes: float,
                    optimizer_s_per_param: float) -> tuple[float, float, float, float]:
        """(states bytes, once-per-step sync s, optimizer s, gathered experts bytes) of one (mean) layer's
        routed experts on one rank of the stage (sharded over its ``dp x cp x tp`` ranks)."""
        n = s.dp * s.cp * s.tp
        states = expert_states(self.model, self.parallel, n, state_bytes)
        sync, optim = expert_sync(self.hw.collective_time, self.cluster, self.model, self.parallel, n, grad_bytes,
                                  optimizer_s_per_param)
        return states, sync, optim, gathered_expert_bytes(self.model, self.parallel, n)

    def step_sync(self, data_ranks: int, grad_bytes: float, optimizer_s_per_param: float) -> tuple[float, float]:
        """(gradient sync, optimizer) seconds once per step of one (mean) layer's routed experts over
        ``data_ranks`` ranks (tp ranks included)."""
        return expert_sync(self.hw.collective_time, self.cluster, self.model, self.parallel, data_ranks, grad_bytes,
                           optimizer_s_per_param)
