"""Measure activation memory exactly: the bytes autograd keeps for backward, counted as they are saved.

The allocator's peak (GPU) or the resident set size (CPU) mixes activations with weights, gradients,
optimizer states and allocator slack; the cost model predicts activations separately, so they are
measured separately, with autograd's saved-tensor hooks. Each saved tensor is charged by its
storage (a view saved twice, or two views of one buffer, count once); parameters and views of
them (the ``weight.t()`` a linear layer saves) are not activations and are skipped. A tensor stops
counting when autograd releases it after its backward, so :attr:`SavedActivationMeter.peak_bytes`
is the high-water mark over everything the meter saw,
pipelines with several micro-batches in flight included.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(8, 8))
>>> lin = torch.nn.Linear(8, 8, bias=False)
>>> with SavedActivationMeter() as meter:
...     x = torch.ones(4, 8)
...     y = torch.tanh(lin(x @ w))   # saves x, x @ w and y (4x8 each); w and lin.weight.t() are weights
...     loss = y.sum()
>>> meter.peak_bytes, meter.live_bytes
(384, 384)
>>> loss.backward(); del y, loss; meter.live_bytes
0
"""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    t = t._local_tensor if isinstance(t, DTensor) else t
    # A collective's pending result (tensor parallelism) is a wrapper without storage of its own.
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter (a leaf that needs gradients) or a view of one, such as the ``weight.t()`` a matmul saves."""
    base = t._base if t._base is not None else t
    return base.requires_grad and base.is_leaf


class _Saved:
    """What autograd holds in place of a saved tensor; releases its charge when autograd drops it."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "SavedActivationMeter", key) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


class SavedActivationMeter:
    """Context manager counting the live and peak bytes of tensors saved for backward (see module doc)."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict = {}  # storage key -> [bytes, references]
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> "SavedActivationMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _pack(self, t: torch.Tensor) -> _Saved:
        # a plain tensor (most of what autograd saves) is its own local tensor: no wrapper to look through
        local = t if type(t) is torch.Tensor else _local(t)
        if _is_weight(t) or (local is not t and _is_weight(local)) or local.device.type == "meta":
            return _Saved(t, self, None)
        storage = local.untyped_storage()
        key = (local.device, storage.data_ptr())
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [storage.nbytes(), 1]
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[1] += 1
        return _Saved(t, self, key)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._refs[key]
            self.live_bytes -= entry[0]
