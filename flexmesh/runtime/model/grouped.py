"""Grouped matmuls: rows of one matrix in consecutive groups, each times its own weight.

``torch._grouped_mm`` computes every group's product in one kernel (LoRA adapters of many tasks:
flexmesh.runtime.model.lora; routed experts: flexmesh.runtime.model.moe). Where it does not run for the device
and dtype (CUDA below sm90 or not bf16, rows not 16-byte aligned) each group is its own
``F.linear``, with the same result.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def grouped_kernel_ok(x: torch.Tensor, *dims: int) -> bool:
    """Whether ``torch._grouped_mm`` runs for ``x``'s device and dtype: on CPU (torch >= 2.9) with
    16-byte aligned rows (fp32 dims multiples of 4); on CUDA for bf16 on sm90 and later, with 16-byte
    aligned rows (dims multiples of 8), once a small forward and
    backward of it has run there (:func:`_grouped_probe`: its layout rules differ between releases)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":  # 16-byte aligned rows too: "strides should be multiple of 16 bytes" (rank 3 in fp32)
        return all(d * x.element_size() % 16 == 0 for d in dims)
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0) and all(d % 8 == 0 for d in dims)
            and _grouped_probe(x.device, x.dtype))


def _grouped_layout(w: torch.Tensor) -> torch.Tensor:
    """``w`` [G, N, K] as the grouped kernel's [G, K, N] operand: the transposed view on CUDA (its
    kernels take the second operand column-major), a contiguous copy on CPU (faster there)."""
    wt = w.transpose(1, 2)
    return wt.contiguous() if w.device.type == "cpu" else wt


@functools.cache
def _grouped_probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the grouped kernel's forward and backward run on ``device`` in ``dtype`` as the adapters
    call it (two groups, one empty); the per-run matmuls serve where it does not."""
    try:
        x = torch.randn(32, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(2, 8, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
        torch._grouped_mm(x, _grouped_layout(w), offs=offs).float().square().sum().backward()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, sizes: Sequence[int] | None = None,
                   loop: bool = False) -> torch.Tensor:
    """Rows of ``x`` [T, K] in group ``i`` times ``w[i]^T`` (``w`` [G, N, K]): [T, N]. ``offsets``: the
    groups' end offsets on ``x``'s device (int32, [G]); ``sizes``: the same as group sizes on the host
    (read from ``offsets`` when needed and not given). One grouped kernel, or (``loop``, or no grouped
    kernel here) one ``F.linear`` per group.

    >>> x, w = torch.randn(5, 3), torch.randn(2, 4, 3)
    >>> y = grouped_linear(x, w, torch.tensor([2, 5], dtype=torch.int32), loop=True)
    >>> torch.allclose(y, torch.cat([x[:2] @ w[0].T, x[2:] @ w[1].T]))
    True
    """
    if not loop and grouped_kernel_ok(x, w.shape[-1], w.shape[-2]):
        return torch._grouped_mm(x, _grouped_layout(w), offs=offsets)
    if sizes is None:
        ends = offsets.tolist()
        sizes = [b - a for a, b in zip([0, *ends[:-1]], ends)]
    out, start = [], 0
    for i, n in enumerate(sizes):
        out.append(F.linear(x[start:start + n], w[i]))
        start += n
    return torch.cat(out) if out else x.new_zeros(0, w.shape[-2])
