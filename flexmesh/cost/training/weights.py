"""What a step trains: the states a device keeps for its weights and the collectives that keep their
gradients in sync, as a part of the cost model (:class:`Trained`).

:class:`FullTraining` trains every weight (the default); :class:`~flexmesh.cost.training.adapters.AdapterCosts`
trains LoRA adapters on a frozen base. Sources of the full-training terms:

- ZeRO (1910.02054): ZeRO-1 shards the optimizer states over the data ranks, ZeRO-2 also the
  gradients, ZeRO-3 the weights too. ZeRO-3 gathers weights for forward and backward and
  reduce-scatters gradients per micro-batch, prefetched under the layer's compute; DP to ZeRO-2 sync
  gradients once per step.
- Overlap options (:class:`~flexmesh.layout.overlap.Overlap`): ZeRO-2/3 gradients reduced once or every
  micro-batch, ZeRO-3 gathers prefetched; every overlapped collective costs what does not fit under
  its compute (:meth:`Hardware.exposed`).
- Sharded data parallelism copies on the compute stream, which no overlap hides (counted from FSDP2,
  torch.distributed.fsdp._fully_shard._fsdp_collectives): every all-gather's output is split into the
  parameters (``foreach_all_gather_copy_out``: the layer's weights read and written), and every
  reduce-scatter's input is first packed from the unsharded gradients
  (``foreach_reduce_scatter_copy_in``: its gradients read and written).

>>> from flexmesh.cost.device.hardware import Hardware
>>> from flexmesh.layout.strategy import LayerStrategy
>>> from flexmesh.spec import parse_cluster
>>> cluster = parse_cluster("8xA100-80GB")
>>> full = FullTraining(Hardware(cluster), cluster, (2, 4, 12), optimizer_s_per_param=0.0)
>>> full.states(1e9, LayerStrategy(dp=8, zero=3)) / 1e9  # (2 + 4 + 12) bytes a parameter, over 8 ranks
2.25
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

from flexmesh.cost.device.hardware import Hardware, group_shape
from flexmesh.cost.training.work import Amount
from flexmesh.layout.overlap import NO_OVERLAP, Overlap
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec.cluster import ClusterSpec

# (exposed forward, exposed backward, once-per-step sync, optimizer) seconds
GradComm = tuple[float, float, float, float]


class Trained(Protocol):
    """What a step trains, asked by the layer's pricing (:mod:`flexmesh.cost.training.layer`)."""

    reduce_bytes: float  # bytes a gradient element moves in the data-parallel reduction

    def states(self, params: float, s: LayerStrategy, overlap: Overlap = NO_OVERLAP) -> float:
        """Bytes of weights, gradients and optimizer states for ``params`` parameters on one device."""
        ...

    def grad_comm(self, params: float, s: LayerStrategy, work_fwd: float, work_bwd: float,
                  overlap: Overlap = NO_OVERLAP) -> GradComm:
        """(exposed forward, exposed backward, per-step sync, optimizer) seconds for ``params``
        parameters, ZeRO's per-micro-batch collectives hidden under ``work_fwd`` / ``work_bwd``."""
        ...

    def compute(self, s: LayerStrategy, tokens: Amount, sq_tokens: Amount, fwd: Amount,
                bwd: Amount) -> tuple[Amount, Amount]:
        """A layer's (forward, backward) compute seconds as trained, given the timing's for a layer
        whose weights all train."""
        ...

    def synced_params(self, params: float) -> float:
        """Parameters among ``params`` (a layer's, or an end's) whose gradients are synchronised."""
        ...


class FullTraining:
    """Every weight trains: states and gradient sync under DP and ZeRO (see the module doc)."""

    def __init__(self, hw: Hardware, cluster: ClusterSpec, state_bytes: tuple[float, float, float],
                 optimizer_s_per_param: float, reduce_bytes: float | None = None):
        self.hw = hw
        self.cluster = cluster
        self.weight_bytes, self.grad_bytes, self.optim_bytes = state_bytes
        self.reduce_bytes = self.grad_bytes if reduce_bytes is None else reduce_bytes
        self.optimizer_s_per_param = optimizer_s_per_param
        self._collectives = lru_cache(maxsize=None)(self._collectives_uncached)

    def states(self, params: float, s: LayerStrategy, overlap: Overlap = NO_OVERLAP) -> float:
        """Bytes of weights, gradients and optimizer states for ``params`` parameters on one device.

        With ``grad_reduce="last"`` ZeRO-2/3 gradients accumulate unsharded until the step's one
        reduce-scatter (FSDP2 without gradient sync on the other micro-batches keeps them so).
        """
        p = params / s.tp
        w, g, o = self.weight_bytes, self.grad_bytes, self.optim_bytes
        d = s.shard_degree
        if s.zero >= 1:
            o /= d
        if s.zero >= 2 and overlap.grad_reduce == "bucketed":
            g /= d
        if s.zero >= 3:
            w /= d
        return p * (w + g + o)

    def grad_comm(self, params: float, s: LayerStrategy, work_fwd: float, work_bwd: float,
                  overlap: Overlap = NO_OVERLAP) -> GradComm:
        """(exposed fwd, exposed bwd, per-step sync, optimizer time) for ZeRO / DP of ``params``.

        ZeRO-0/1 reduce once per step. ZeRO-2/3 reduce-scatter every micro-batch under its backward
        (``grad_reduce="bucketed"``) or once per step (``"last"``, the step's sync). ZeRO-3 gathers
        weights for forward and backward every micro-batch, under the previous layer's compute when
        prefetched, exposed when not; FSDP2's copies on the compute stream are exposed (module doc).
        """
        d = s.shard_degree
        optim = params / s.tp / (d if s.zero >= 1 else 1) * self.optimizer_s_per_param
        if d == 1:
            return 0.0, 0.0, 0.0, optim
        ar, rs, ag, copy_out, copy_in = self._collectives(params, s.tp, d, s.zero >= 2)
        if s.zero <= 1:  # all-reduce, or reduce-scatter + all-gather of the same volume
            return 0.0, 0.0, ar, optim
        exposed = self.hw.exposed
        every = overlap.grad_reduce == "bucketed"
        if s.zero == 2:  # reduce-scatter (every micro-batch or once), all-gather updated weights once
            ag_once = ag + copy_out
            if every:
                return 0.0, float(exposed(rs, work_bwd)) + copy_in, ag_once, optim
            return 0.0, 0.0, ag_once + rs + copy_in, optim
        # ZeRO-3: gather weights for forward and for backward every micro-batch, under the previous
        # layer's compute when prefetched (a window of 0 leaves a gather exposed).
        win_f, win_b = (work_fwd, work_bwd) if overlap.zero3_prefetch else (0.0, 0.0)
        fwd = float(exposed(ag, win_f)) + copy_out
        if every:
            bwd = exposed(ag + rs, win_b) if overlap.zero3_prefetch else ag + exposed(rs, work_bwd)
            return fwd, float(bwd) + copy_out + copy_in, 0.0, optim
        return fwd, float(exposed(ag, win_b)) + copy_out, rs + copy_in, optim

    def _collectives_uncached(self, params: float, tp: int, d: int,
                              sharded: bool) -> tuple[float, float, float, float, float]:
        """(all-reduce, reduce-scatter, all-gather, copy-out, copy-in) seconds of :meth:`grad_comm` for
        ``params`` over ``tp`` x ``d`` ranks, unsharded or ZeRO-2/3; no micro-batch enters them."""
        shape = group_shape(d, tp, self.cluster)
        ct = self.hw.collective_time
        grads, weights = params / tp * self.reduce_bytes, params / tp * self.weight_bytes
        if not sharded:
            return float(ct("all_reduce", grads, shape)), 0.0, 0.0, 0.0, 0.0
        return (0.0, float(ct("reduce_scatter", grads, shape)), float(ct("all_gather", weights, shape)),
                float(self.hw.copy_time(2 * weights)), float(self.hw.copy_time(2 * grads)))

    def compute(self, s: LayerStrategy, tokens: Amount, sq_tokens: Amount, fwd: Amount,
                bwd: Amount) -> tuple[Amount, Amount]:
        return fwd, bwd

    def synced_params(self, params: float) -> float:
        return params
