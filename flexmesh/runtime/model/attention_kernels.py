"""Local attention kernels for packed documents: one registry, one choice rule, one row description.

A packed row holds documents end to end; a token attends causally to earlier tokens of its own
document (within a sliding window where the layer has one). :class:`Documents` describes the row
once per micro-batch -- the boundaries on the device for the kernels, the same on the host for
shapes and loops, and a cache every layer shares (FlexAttention's block masks) -- so no kernel reads
a device tensor back to the host (a synchronisation) and nothing is rebuilt per layer.

The kernels, in the order :func:`select_kernel` tries them (the first that serves the device, dtype,
window and head size wins):

==========  ============================================  ======  ===========  ========  =====
name        implementation                                device  dtypes       windows   GQA
==========  ============================================  ======  ===========  ========  =====
varlen      ``torch.nn.attention.varlen.varlen_attn``     cuda    fp16, bf16   if torch  if torch
            (flash varlen in PyTorch; its signature says
            whether this torch takes windows and GQA)
flash-attn  ``flash_attn.flash_attn_varlen_func``         cuda    fp16, bf16   yes       yes
flex        compiled FlexAttention, one block mask per    cuda    any          yes       yes
            micro-batch and window, built by compiled
            ``create_block_mask`` and shared by every layer
sdpa        ``scaled_dot_product_attention`` document     any     any          yes       repeat
            by document (windowed: query block by block)
==========  ============================================  ======  ===========  ========  =====

"repeat": key/value heads are repeated to one per query head first. On CPU only ``sdpa`` runs
(PyTorch's varlen kernel and FlexAttention's backward need CUDA); its cost grows with the sum of
squared document lengths, as a varlen kernel's. The profiler times the kernel this rule picks
(flexmesh.profile.hardware), and the trainer names the kernels its steps ran in metrics.jsonl.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flexmesh.errors import PlanError

# Query block of the windowed SDPA kernel: a block of b queries reads b + w - 1 keys, so blocks of at
# least a few hundred keep the number of SDPA calls small while the cost stays O(len * (b + w)).
WINDOW_BLOCK = 256


# ---- the row -----------------------------------------------------------------------------------------
class Documents:
    """The document boundaries of one packed row, on the device and on the host, and a per-row cache.

    ``cu`` [n + 1] int32 on the compute device; ``bounds`` the same numbers as a tuple of ints. The
    last boundary is the row's end: tokens past the given boundaries (padding) are one more document.
    Build it from a host tensor (free) or pass ``bounds`` with a device tensor (no synchronisation).

    >>> d = Documents(torch.tensor([0, 3, 5]), total=6)
    >>> d.bounds, d.lengths, d.max_len, d.cu.tolist()
    ((0, 3, 5, 6), (3, 2, 1), 3, [0, 3, 5, 6])
    """

    def __init__(self, cu_seqlens: torch.Tensor, bounds: tuple[int, ...] | None = None, total: int | None = None):
        if bounds is None:
            bounds = tuple(int(x) for x in cu_seqlens.tolist())
        cu = cu_seqlens
        if total is not None and bounds[-1] < total:  # trailing padding: one more document
            bounds = (*bounds, int(total))
            cu = torch.cat([cu, cu.new_tensor([int(total)])])
        self.bounds: tuple[int, ...] = tuple(bounds)
        self.cu = cu.to(torch.int32) if cu.dtype != torch.int32 else cu
        self._cache: dict = {}

    @property
    def total(self) -> int:
        return self.bounds[-1]

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.bounds[:-1], self.bounds[1:]))

    @property
    def max_len(self) -> int:
        return max(self.lengths, default=0)

    def cached(self, key, build: Callable[[], object]) -> object:
        """``build()`` once per row and ``key``: what every layer of the micro-batch shares."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


def as_documents(cu_seqlens: "torch.Tensor | Documents", total: int) -> Documents:
    """``cu_seqlens`` as :class:`Documents` of a row of ``total`` tokens (closing the row when it does
    not end at ``total``); a :class:`Documents` passes through."""
    if isinstance(cu_seqlens, Documents):
        return cu_seqlens
    return Documents(cu_seqlens, total=total)


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index of each of ``total`` tokens; tokens past ``cu_seqlens[-1]`` get one extra id.

    >>> document_ids(torch.tensor([0, 3, 5]), 6).tolist()
    [0, 0, 0, 1, 1, 2]
    """
    idx = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(torch.int64).contiguous(), idx, right=True)


def window_causal(qi: torch.Tensor, ki: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether query position ``qi`` sees key position ``ki``: ``ki <= qi`` and, with a window, ``qi - ki < window``.

    >>> window_causal(torch.tensor([[4]]), torch.arange(6)[None], 2).int().tolist()
    [[0, 0, 0, 1, 1, 0]]
    """
    seen = ki <= qi
    return seen if window is None else seen & (qi - ki < window)


def flash_window_size(window: int | None) -> tuple[int, int]:
    """The flash kernels' ``window_size`` (keys left, keys right of the query; -1 unbounded) for ``window``.

    >>> flash_window_size(None), flash_window_size(4)
    ((-1, -1), (3, 0))
    """
    return (-1, -1) if window is None else (window - 1, 0)


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise unless q is [B, H, T, D] and k, v [B, Hkv, T, D] with H a multiple of Hkv (what every kernel,
    local or context-parallel, takes)."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"attend expects q [B, H, T, D] and k, v [B, Hkv, T, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise PlanError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads; "
                        "tensor parallelism must split both head counts by the same degree")


# ---- kernels -------------------------------------------------------------------------------------------
def sdpa_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal SDPA over one document; longer than ``window``, query block by query block.

    A block of queries [a, b) needs keys [a - w + 1, b) only, so a long document costs about
    len * (block + w) instead of len^2, and the explicit mask is block x (block + w - 1).
    """
    n = q.shape[2]
    if window is None or n <= window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    step = max(window, WINDOW_BLOCK)
    outs = []
    for a in range(0, n, step):
        b, lo = min(a + step, n), max(0, a - window + 1)
        qi = torch.arange(a, b, device=q.device)[:, None]
        mask = window_causal(qi, torch.arange(lo, b, device=q.device)[None, :], window)
        outs.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, lo:b], v[:, :, lo:b], attn_mask=mask))
    return torch.cat(outs, dim=2)


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``, ``v`` with each key/value head repeated for the query heads it serves (along ``dim``)."""
    groups = q.shape[dim] // k.shape[dim]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=dim), v.repeat_interleave(groups, dim=dim)


def _run_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, window: int | None) -> torch.Tensor:
    """Causal SDPA document by document, so the cost is sum(len^2), as a varlen kernel's.

    One SDPA over the whole packed row with a block-diagonal mask would cost row^2 however short
    its documents are, and keep a row^2 mask per layer for backward.
    """
    k, v = repeat_kv(q, k, v)
    sizes = [n for n in docs.lengths if n]  # an empty document has no tokens to split off
    if len(sizes) == 1:
        return sdpa_document(q, k, v, window)
    # split, not one slice per document: a slice's backward writes its gradient into a zero tensor
    # of the whole row, so n documents would cost n x row in backward; split's backward is one cat.
    return torch.cat([sdpa_document(qi, ki, vi, window)
                      for qi, ki, vi in zip(q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2))],
                     dim=2)


def _rows_end_to_end(docs: Documents, rows: int) -> tuple[torch.Tensor, int]:
    """Boundaries of ``rows`` copies of the row laid end to end (a batch of rows as one varlen
    sequence) and the longest document; no host read of device values."""
    if rows == 1:
        return docs.cu, docs.max_len
    t = docs.total
    cu = docs.cu
    return torch.cat([cu[:-1] + i * t for i in range(rows)] + [cu.new_tensor([rows * t])]), docs.max_len


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B * T, H, D] (a free view when B is 1 and x is a transposed [B, T, H, D])."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b * t, h, d)


@functools.lru_cache(maxsize=1)
def _torch_varlen() -> tuple[Callable, frozenset[str]] | None:
    """PyTorch's varlen attention and the keyword parameters this torch's signature has, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_serves(window: int | None, gqa: bool) -> bool:
    found = _torch_varlen()
    if found is None:
        return False
    params = found[1]
    causal = "is_causal" in params or "window_size" in params
    return causal and (window is None or "window_size" in params)


# Without ``enable_gqa`` in varlen_attn's signature (torch 2.10-2.11), keys and values are repeated to the
# query heads before the call: two copies a layer forward and their sums backward. Its flash kernel (FA2)
# serves fewer key/value heads itself, as flash_attn_varlen_func does; True passes them as they are. A
# measured choice: bench.gpu's flexmesh-gqa row against flexmesh, tests/test_cuda.py against the CPU.
VARLEN_NATIVE_GQA = False


def _varlen_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, window: int | None) -> torch.Tensor:
    """PyTorch's varlen kernel on [T, H, D] rows, causal (bottom-right aligned where a sequence has more
    keys than queries, as flash attention aligns it), within ``window``; the signature decides the keywords."""
    found = _torch_varlen()
    assert found is not None
    fn, params = found
    kwargs: dict = {}
    if k.shape[1] != q.shape[1] and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    elif k.shape[1] != q.shape[1] and not VARLEN_NATIVE_GQA:
        k, v = repeat_kv(q, k, v)
    if "window_size" in params:  # torch >= 2.12: causality is a window of (-1, 0)
        kwargs["window_size"] = (-1, 0) if window is None else flash_window_size(window)
    else:  # torch 2.10-2.11: is_causal, no windows (select_kernel does not pick it for a window)
        kwargs["is_causal"] = True
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


@functools.lru_cache(maxsize=1)
def _flash_attn() -> Callable | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # pragma: no cover - depends on the machine
        return None
    return flash_attn_varlen_func


def _flash_attn_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, window: int | None) -> torch.Tensor:
    fn = _flash_attn()
    assert fn is not None
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, window_size=flash_window_size(window))


def _varlen_rows(call: Callable) -> Callable:
    """A kernel over a packed row (:class:`Documents`) from a varlen ``call`` on [T, H, D] rows."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, window: int | None) -> torch.Tensor:
        b, h, t, d = q.shape
        cu, longest = _rows_end_to_end(docs, b)
        return call(_flat(q), _flat(k), _flat(v), cu, cu, longest, longest, window).view(b, t, h, d).transpose(1, 2)

    return run


def _varlen_suffix(call: Callable) -> Callable:
    """Queries that are the last n of each row's m keys (one document per row), from a varlen ``call``."""

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
        b, h, n, d = q.shape
        m = k.shape[2]
        cu_q = torch.arange(0, (b + 1) * n, n, dtype=torch.int32, device=q.device)
        cu_k = torch.arange(0, (b + 1) * m, m, dtype=torch.int32, device=q.device)
        return call(_flat(q), _flat(k), _flat(v), cu_q, cu_k, n, m, window).view(b, n, h, d).transpose(1, 2)

    return run


# Queries per SDPA call of a suffix (queries after a carried prefix): the explicit mask is block x keys,
# so a bounded block keeps it small (1024 x 64K booleans: 64 MiB) while the calls stay few.
SUFFIX_BLOCK = 1024


def _sdpa_suffix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """Queries at document positions ``m - n ..`` over keys ``0 .. m - 1`` of one document, causal:
    SDPA with an explicit mask, :data:`SUFFIX_BLOCK` queries at a time."""
    n, m = q.shape[2], k.shape[2]
    first = m - n
    k, v = repeat_kv(q, k, v)
    if first == 0:
        return sdpa_document(q, k, v, window)
    outs = []
    for r0 in range(0, n, SUFFIX_BLOCK):
        r1 = min(n, r0 + SUFFIX_BLOCK)
        lo, hi = (0 if window is None else max(0, first + r0 - window + 1)), first + r1
        qi = torch.arange(first + r0, first + r1, device=q.device)[:, None]
        mask = window_causal(qi, torch.arange(lo, hi, device=q.device)[None, :], window)
        outs.append(F.scaled_dot_product_attention(q[:, :, r0:r1], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask))
    return torch.cat(outs, dim=2)


@functools.lru_cache(maxsize=1)
def _flex() -> tuple[Callable, Callable] | None:
    """(compiled flex_attention, create_block_mask), or None where this torch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:  # pragma: no cover
        return None
    # compiled once: the eager FlexAttention materialises the full scores
    return torch.compile(flex_attention), create_block_mask


def flex_block_mask(docs: Documents, window: int | None, device: torch.device, compile_mask: bool = True):
    """FlexAttention's block mask of the row (document-causal, within ``window``), built once per
    micro-batch and window and shared by every layer through ``docs``' cache."""
    found = _flex()
    assert found is not None
    create_block_mask = found[1]
    total = docs.total

    def build():  # noqa: ANN202
        doc = document_ids(docs.cu, total)

        def mask_mod(b, h, qi, ki):  # noqa: ANN001, ANN202 - FlexAttention's callback signature
            return (doc[qi] == doc[ki]) & window_causal(qi, ki, window)

        return create_block_mask(mask_mod, None, None, total, total, device=device, _compile=compile_mask)

    return docs.cached(("flex", window, str(device), compile_mask), build)


def _run_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, window: int | None) -> torch.Tensor:
    found = _flex()
    assert found is not None
    block_mask = flex_block_mask(docs, window, q.device, compile_mask=q.is_cuda)
    return found[0](q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])


# ---- registry ----------------------------------------------------------------------------------------------
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionKernel:
    """One local kernel: where it runs and what it serves (see the module doc's table). ``run`` takes
    a packed row; ``suffix`` queries that are the last of one document's keys (a piece of a cut
    document after its carried prefix, flexmesh.runtime.model.carry); ``cost`` the cost model's function
    that prices it (a dotted path, checked by tests/test_attention_costs.py)."""

    name: str
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] | None  # None: any
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Documents, int | None], torch.Tensor]
    suffix: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int | None], torch.Tensor] = _sdpa_suffix
    available: Callable[[int | None, bool], bool] = field(default=lambda window, gqa: True)
    max_head_dim: int | None = None  # the flash kernels' limit (256; multiples of 8)
    cost: str = ""

    def serves(self, device: str, dtype: torch.dtype, window: int | None, head_dim: int, gqa: bool) -> bool:
        if device not in self.devices or (self.dtypes is not None and dtype not in self.dtypes):
            return False
        if self.max_head_dim is not None and (head_dim > self.max_head_dim or head_dim % 8):
            return False
        return self.available(window, gqa)


# The runtime's stack (flexmesh.layout.stack.RUNTIME_STACK) prices attention as FlashAttention-2 at its
# measured rates: varlen and flash-attn run FA2, SDPA's CUDA flash backend too; FlexAttention has no fit of
# its own and is priced the same (measured slower: docs/architecture.md).
FLASH2_COST = "flexmesh.cost.device.flash2.flash2_kernels"
KERNELS: dict[str, AttentionKernel] = {k.name: k for k in (
    AttentionKernel("varlen", ("cuda",), HALF, _varlen_rows(_varlen_call), _varlen_suffix(_varlen_call),
                    _varlen_serves, max_head_dim=256, cost=FLASH2_COST),
    AttentionKernel("flash-attn", ("cuda",), HALF, _varlen_rows(_flash_attn_call), _varlen_suffix(_flash_attn_call),
                    lambda w, g: _flash_attn() is not None, max_head_dim=256, cost=FLASH2_COST),
    AttentionKernel("flex", ("cuda",), None, _run_flex, available=lambda w, g: _flex() is not None, cost=FLASH2_COST),
    AttentionKernel("sdpa", ("cuda", "cpu"), None, _run_sdpa, cost=FLASH2_COST),
)}

USED: set[str] = set()  # the kernels this process has run (the trainer reports them)


def select_kernel(device: str, dtype: torch.dtype, window: int | None = None, head_dim: int = 64,
                  gqa: bool = False) -> AttentionKernel:
    """The first kernel of :data:`KERNELS` that serves these inputs (``sdpa`` serves everything).

    >>> select_kernel("cpu", torch.float32).name
    'sdpa'
    """
    return next(k for k in KERNELS.values() if k.serves(device, dtype, window, head_dim, gqa))


def _chosen(q: torch.Tensor, k: torch.Tensor, window: int | None, kernel: str | None) -> AttentionKernel:
    chosen = KERNELS[kernel] if kernel is not None else select_kernel(
        q.device.type, q.dtype, window, q.shape[-1], k.shape[1] != q.shape[1])
    USED.add(chosen.name)
    return chosen


def suffix_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None,
                     kernel: str | None = None) -> torch.Tensor:
    """Causal attention of queries that are the last ``n`` of one document's ``m`` keys (query ``i`` at
    position ``m - n + i``), by the chosen kernel's ``suffix``; q [B, H, n, D], k, v [B, Hkv, m, D]."""
    return _chosen(q, k, window, kernel).suffix(q, k, v, window)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: "torch.Tensor | Documents",
                    window: int | None = None, kernel: str | None = None) -> torch.Tensor:
    """Document-causal attention of a whole row held by this rank, by :func:`select_kernel`'s kernel
    (or the one named ``kernel``). q [B, H, T, D]; k, v [B, Hkv, T, D]."""
    return _chosen(q, k, window, kernel).run(q, k, v, as_documents(cu_seqlens, q.shape[2]), window)


def model_kernels(spec, device: str, dtype: str) -> list[str]:  # noqa: ANN001 - a ModelSpec
    """The local attention kernels ``spec``'s layers will use on ``device`` in training dtype ``dtype``
    (as a run's log names them before its first step; metrics.jsonl names those that ran)."""
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    gqa = spec.num_kv_heads != spec.num_heads
    windows = {spec.window_of(i) for i in range(spec.num_layers)}
    return sorted({select_kernel(device, torch_dtype, w, spec.head_dim, gqa).name for w in windows})
