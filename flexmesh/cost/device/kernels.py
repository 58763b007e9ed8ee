"""Kernel times on one GPU: GEMMs by shape, memory-bound operators by bytes, flash attention by block.

One efficiency per GPU type cannot follow GEMM throughput falling with matrix size, nor price the
elementwise work that does no matmul. :class:`Kernels` prices each kernel from datasheet numbers
and a few fitted ones (``python -m flexmesh.cost.training.calibrate`` redoes the fits; docs/cost-model.md
has the table of terms):

- GEMM ``(M, N, K)`` (``M x K`` times ``K x N``): output tiles of ``TILE x TILE`` (CUTLASS's default
  threadblock tile for SM80/SM90 GEMMs, docs/efficient_gemm.md; cuBLAS' heuristics pick 128- and
  256-wide tiles) run in waves of one tile per SM (the SM count from the datasheet, ``DeviceSpec.sms``:
  A100 108, H100 SXM and H200 132); a wave takes ``2 TILE^2 K / (peak x mm_efficiency / SMs)``, ``mm_efficiency``
  being what the largest GEMMs reach (fitted). Tile and wave quantization as NVIDIA's "Matrix
  Multiplication Background" guide (Deep Learning Performance documentation) describes them. The
  time is the larger of that and the bytes of A, B and C over the HBM bandwidth (roofline), plus
  one kernel's fixed cost. (A per-tile fixed cost in K-steps was tried as a further fitted constant:
  the fitting rows drive it to zero, so it is not part of the model.)
- Memory-bound operators (norms, residual adds, rotary, activations, softmax and cross entropy,
  optimizer step): bytes moved over the datasheet HBM bandwidth x :data:`HBM_EFFICIENCY`.
- Flash attention over blocks of ``L`` keys: tiles of ``ATTN_TILE`` queries x ``ATTN_TILE`` keys
  (FlashAttention-2, 2307.08691, section 3.3), so ``L`` rounds up to whole tiles, and each query
  tile pays a fixed cost of ``ATTN_QUERY_OVERHEAD`` keys (loading Q, rescaling and writing O).
- Every kernel: :data:`LAUNCH_S` of fixed cost.

Those are the shapes a training step's pricing uses, at the end-to-end fits' rates. The device layer's own
kernels, priced as aiconfigurator-core's measured tables time them (``Hardware.device_kernels``), take the
forms those tables support over every shape they hold (:class:`MeasuredGemm`, :class:`MeasuredAttention`;
``python -m flexmesh.cost.device.gemm_tables --fit`` and ``attention_tables --fit`` redo their constants):

- GEMM: ``fixed + (compute^p + memory^p)^(1/p) + per_k x K``: the tensor-core work at the kernel rate and
  the three matrices' bytes at the GEMMs' achieved bandwidth, joined by a soft maximum (small and skinny
  GEMMs pay for both), plus one kernel's fixed cost and a K-loop term (a GEMM of few output tiles
  walks its reduction on few SMs). No tiles below one wave: there the kernels a library picks per shape (tile
  sizes, split-K) fill the SMs, and the tables price 128 x 128 tiles 2 to 6 times too slow below 128 rows.
  From one wave of :data:`WAVE_TILE` tiles (128 x 256) on the part's SMs up, the last wave's idle SMs cost a
  fitted share ``wave_tail`` of their time: ``compute x (1 + wave_tail x (ceil(w) - w) / w)``, ``w`` the
  waves (NVIDIA's "Matrix Multiplication Background" guide, Deep Learning Performance documentation). The
  fits keep it on the A100 (0.72) and the L40S (0.27), whose kernels run whole waves of large tiles, and
  find none or next to none on Hopper and Blackwell (B200 0.005).
- The cache (GEMM memory and decode KV reads, :func:`cached_memory`): the tables time a kernel called again and
  again on the same buffers, so a working set that fits the GPU's last-level (L2) cache is read from it, not
  from DRAM. A fraction ``h = 1 / (1 + (working set / cache)^steepness)`` of the bytes moves ``cache_speedup``
  times faster than DRAM: all of a small working set, none of one far past the cache (a cache that a working
  set overflows thrashes). A GEMM's working set is what the timed calls keep reading: the input, the
  :data:`TABLE_WEIGHTS` (six) weights the tables cycle through and the output, ``MK + 6 KN + MN`` elements
  (its bytes moved a call stay ``MK + KN + MN``). ``cache``, ``cache_speedup`` and ``steepness`` are fitted
  per table with the other constants; ``cache_speedup`` <= 1 is no cache term, and a part priced from another
  part's table has none (``Hardware.device_kernels``: the cache is the measured part's own). It matters where
  DRAM is slow beside the cache: the L40S (GDDR6 at 864 GB/s, 96 MB of L2; the GEMM fit's cache is 99 MB)
  reads GEMMs' working sets within it at 1.0-2.2 TB/s (its GEMVs, M <= 8, weights of 4 to 16 MB at a median
  1.0-1.3 TB/s; M = 8192, N = 32, inputs of 8 to 100 MB at 1.5-2.2 TB/s) and decode KV of 32 to 96 MB at
  1.1-1.7 TB/s (medians), above its DRAM's datasheet rate, and 0.6-0.7 TB/s past them.
- Attention over ``L`` keys a call: the FLOPs at the kernel rate with the tile form above, plus per call a
  fixed cost and a per-key term.
- Decode attention (one query per sequence against its cached keys and values, :class:`MeasuredDecode`):
  memory-bound, the KV bytes read at a fitted fraction of the HBM bandwidth (and the cache term above), plus
  per call a fixed cost and
  a cost per (sequence, KV head) pair (each is a unit of work the kernel schedules: its query heads loaded,
  its partial results combined). ``python -m flexmesh.cost.device.decode_tables --fit`` redoes its constants.

>>> k = Kernels(mm_flops=100e12, attn_flops=50e12, hbm_bytes_per_s=1e12, sms=100, launch_s=0.0)
>>> big, small = k.gemm_efficiency(8192, 8192, 8192), k.gemm_efficiency(64, 8192, 8192)
>>> round(float(big), 3), round(float(small), 3)  # 4096 tiles in 41 waves | 64 tiles, half-used, on 100 SMs
(0.999, 0.32)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

# Output tile of a GEMM kernel: CUTLASS's default 128 x 128 threadblock tile (SM80 and SM90).
TILE = 128
# Flash attention tile: 128 queries x 128 keys (FlashAttention-2, 2307.08691, section 3.3).
ATTN_TILE = 128
# Fixed cost per kernel: an empty kernel sustains about 334,000 asynchronous launches per second
# (M. Boyer, University of Virginia, "CUDA kernel overhead" measurements): 3 us per kernel.
LAUNCH_S = 3e-6
# Achievable fraction of the datasheet HBM bandwidth by streaming kernels: STREAM-like copy and
# triad kernels reach about 90% of it on A100 and H100 (BabelStream, Deakin et al., and NVIDIA's
# bandwidthTest report 1.3-1.4 TB/s of 1.555 on A100-40GB and about 3.0 TB/s of 3.35 on H100 SXM).
HBM_EFFICIENCY = 0.9
# Per query tile, flash attention loads Q and writes O and its softmax statistics: the bytes of one
# more K/V tile iteration (FlashAttention-2's algorithm 1, 2307.08691), so one tile of keys' worth.
ATTN_QUERY_OVERHEAD = float(ATTN_TILE)
# The measured form's wave term (:class:`MeasuredGemm`) counts output tiles of 128 rows (tokens) x 256 columns
# (output features): cuBLAS' large-GEMM tile on SM80 and SM89; the tables' fitted rows take it over 128 x 128
# and 256 x 128 on the A100 and the L40S (the parts whose fits keep a wave term).
WAVE_TILE = (128, 256)
# The measured GEMM tables time six layers' weights against one input (aiconfigurator-core's vLLM collector,
# collector/vllm/collect_gemm.py: six RowParallelLinear layers a timed call, its latency / 6), so what the cache
# must hold across the repeated calls is the input, six weights and the output.
TABLE_WEIGHTS = 6


def cached_memory(nbytes, bytes_per_s: float, cache_bytes: float, speedup: float, steepness: float,  # noqa: ANN001, ANN201
                  working_set=None):  # noqa: ANN001
    """Seconds to move ``nbytes`` of a working set read again and again: the fraction ``1 / (1 + (working_set /
    cache_bytes)^steepness)`` of it from the cache at ``speedup x bytes_per_s``, the rest at ``bytes_per_s`` (the
    module doc; ``working_set``, what the cache must hold across the repeated calls, defaults to ``nbytes``). A
    cache is never slower than DRAM and its cached fraction falls at least as fast as ``cache_bytes /
    working_set``: ``speedup`` and ``steepness`` below 1 count as 1 (``cache_bytes`` <= 0 or ``speedup`` <= 1: all
    at ``bytes_per_s``, no cache term).

    >>> small, large = cached_memory(1e6, 1e12, 32e6, 2.0, 4.0), cached_memory(1e9, 1e12, 32e6, 2.0, 4.0)
    >>> round(float(small) * 1e6, 3), round(float(large) * 1e3, 3)  # us within the cache, ms far past it
    (0.5, 1.0)
    >>> round(float(cached_memory(1e6, 1e12, 32e6, 2.0, 4.0, working_set=1e9)) * 1e6, 3)  # others' bytes evict it
    1.0
    """
    if cache_bytes <= 0.0 or speedup <= 1.0:
        return nbytes / bytes_per_s
    held = nbytes if working_set is None else working_set
    hit = 1.0 / (1.0 + (np.maximum(held, 0.0) / cache_bytes) ** max(steepness, 1.0))
    t = nbytes * (1.0 - hit * (1.0 - 1.0 / speedup)) / bytes_per_s
    return t if isinstance(t, np.ndarray) else float(t)


@dataclass(frozen=True)
class MeasuredGemm:
    """A GEMM's time as the measured tables have it, beyond its rate (``Kernels.mm_flops``): see the module doc.

    >>> g = MeasuredGemm(fixed_s=2e-6, hbm_bytes_per_s=1e12, power=2.0, per_k_s=0.0)
    >>> k = Kernels(mm_flops=100e12, attn_flops=50e12, hbm_bytes_per_s=1e12, sms=None, gemm_measured=g)
    >>> round(float(k.gemm(4096, 4096, 4096)) * 1e6, 1), round(float(k.gemm(1, 4096, 4096)) * 1e6, 1)
    (1380.1, 35.6)
    """

    fixed_s: float
    hbm_bytes_per_s: float  # what the GEMMs' memory-bound shapes reach
    power: float  # of the soft maximum of compute and memory time
    per_k_s: float  # seconds per element of the reduction dimension
    cache_bytes: float = 0.0  # the working set the cache holds (module doc); 0: no cache term
    cache_speedup: float = 1.0  # the cache's bandwidth over hbm_bytes_per_s
    cache_steepness: float = 1.0  # how fast the cached fraction falls past cache_bytes
    weights: int = 1  # distinct weights the repeated calls cycle through against one input (TABLE_WEIGHTS)
    # the share of a partial last wave's idle SMs a GEMM of at least one wave of WAVE_TILE tiles pays for
    # (``Kernels.sms``; module doc): 0 none (below 0 counts as 0), 1 whole waves (above 1 counts as 1)
    wave_tail: float = 0.0


@dataclass(frozen=True)
class MeasuredAttention:
    """A fused attention call's costs as the measured tables have them, beyond its rate: a fixed cost and a
    per-key term per call (see the module doc)."""

    fixed_s: float
    per_key_s: float


@dataclass(frozen=True)
class MeasuredDecode:
    """A decode-attention call as the measured tables time it: ``fixed_s + per_pair_s x (sequences x KV heads)
    + KV bytes / hbm_bytes_per_s`` (the cached fraction of the KV faster: see the module doc).

    >>> d = MeasuredDecode(fixed_s=10e-6, hbm_bytes_per_s=3e12, per_pair_s=25e-9)
    >>> k = Kernels(mm_flops=1.0, attn_flops=1.0, hbm_bytes_per_s=1.0, sms=None, decode_measured=d)
    >>> round(float(k.decode_attention(3e9, 64 * 8)) * 1e6, 1)  # 64 sequences, 8 KV heads, 3 GB of KV
    1022.8
    """

    fixed_s: float
    hbm_bytes_per_s: float  # what decode attention's KV reads reach
    per_pair_s: float  # seconds per (sequence, KV head) pair of a call
    cache_bytes: float = 0.0  # the KV the cache holds (module doc); 0: no cache term
    cache_speedup: float = 1.0  # the cache's bandwidth over hbm_bytes_per_s
    cache_steepness: float = 1.0  # how fast the cached fraction falls past cache_bytes


# Scalar GEMM prices a Kernels keeps (Kernels._gemms): the search's shapes many times over.
GEMM_CACHE_SHAPES = 1 << 16


@dataclass(frozen=True)
class Kernels:
    """Kernel-time model of one device (times in seconds; shapes may be numpy arrays).

    ``mm_flops`` and ``attn_flops``: peak x the fitted efficiency of the largest GEMMs and of flash
    attention over long blocks; ``sms`` None: no tile or wave quantization (a measured machine, or a
    device without a datasheet entry here), GEMMs then run at ``mm_flops`` whatever their shape.
    """

    mm_flops: float
    attn_flops: float
    hbm_bytes_per_s: float  # achievable: datasheet x HBM_EFFICIENCY, or measured
    sms: int | None
    attn_overhead: float = ATTN_QUERY_OVERHEAD  # keys' worth of fixed cost per query tile
    launch_s: float = LAUNCH_S
    dtype_bytes: int = 2
    roofline: bool = True  # False: GEMMs at their compute time alone (see :meth:`envelope`)
    # True: a block is priced at the best efficiency of any block up to its length (see :meth:`floor`)
    attn_best_below: bool = False
    # A backward that runs at its own pace (FlashAttention-2 on Hopper, :func:`flash2_kernels`): its rate
    # over long blocks and its fixed cost per query tile in keys; None: the forward's
    attn_bwd_flops: float | None = None
    attn_bwd_overhead: float | None = None
    # True (the envelope): attention keeps its per-query-tile cost with keys not rounded up to tiles
    attn_untiled: bool = False
    # The measured tables' forms (the device layer's kernels, not a training step's): GEMMs without tiles
    # or waves, attention calls with their measured fixed and per-key costs; None: the forms above
    gemm_measured: MeasuredGemm | None = None
    attn_measured: MeasuredAttention | None = None
    decode_measured: MeasuredDecode | None = None
    # Scalar GEMMs of the measured form already priced, by shape (the search prices the same shapes again and
    # again; three numpy powers a call are its cost): not a field of the model, a fresh one on every copy.
    _gemms: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def envelope(self) -> "Kernels":
        """The same device with every kernel at its best rate: no tiles, waves, launches or roofline.

        Its times are linear in tokens (plus attention's squared tokens), never above this model's,
        and additive: the sum over documents run alone equals them packed together. A lower bound
        built on them holds for every packing (:meth:`flexmesh.cost.CostModel.replace`).
        Attention keeps its fixed cost per query tile (keys not rounded up to tiles): ``L^2 / (L +
        overhead)`` per document is ``L^2 + overhead x L`` over the rate, linear in squared tokens and
        tokens, and never above the tiled price.

        >>> k = Kernels(mm_flops=100e12, attn_flops=50e12, hbm_bytes_per_s=1e12, sms=100)
        >>> e = k.envelope()
        >>> bool(e.gemm(64, 8192, 8192) <= k.gemm(64, 8192, 8192))
        True
        >>> float(e.gemm(64, 8, 8) + e.gemm(64, 8, 8)) == float(e.gemm(128, 8, 8))
        True
        """
        # (a device priced without tiles, sms None, has no per-tile cost to keep: its attention is at full rate)
        return replace(self, sms=None, launch_s=0.0, roofline=False, attn_untiled=self.sms is not None)

    def floor(self) -> "Kernels":
        """The same device with attention blocks at the best efficiency of any block up to their length, and
        measured GEMMs without their last wave's idle share.

        Attention is priced over blocks of the micro-batch's mean length (:meth:`attention_efficiency`),
        whose keys are rounded up to whole tiles. A short document packed beside a long one lowers the
        mean: past a tile boundary, that can drop a partly filled tile and price the pair below the long
        document alone. So can a measured GEMM's wave term (``MeasuredGemm.wave_tail``): a few more tokens
        fill the last wave's idle SMs. A bound on "a micro-batch never takes less than its longest member"
        uses this model, whose prices never fall as tokens are added (:func:`flexmesh.schedule.lower_bound`).

        >>> k = Kernels(mm_flops=100e12, attn_flops=50e12, hbm_bytes_per_s=1e12, sms=100)
        >>> bool(k.attention_efficiency(257.0) < k.attention_efficiency(256.0))
        True
        >>> float(k.floor().attention_efficiency(257.0)) == float(k.attention_efficiency(256.0))
        True
        """
        gemm = None if self.gemm_measured is None else replace(self.gemm_measured, wave_tail=0.0)
        return replace(self, attn_best_below=True, gemm_measured=gemm)

    # ---- GEMMs ---------------------------------------------------------------------------------
    def gemm_compute(self, m, n, k):  # noqa: ANN001, ANN201 - floats or numpy arrays
        """Seconds of the tensor-core work of ``(m, n, k)``: whole waves of whole tiles (the FLOPs at the rate
        alone without SMs or in the measured form)."""
        if self.sms is None or self.gemm_measured is not None:
            return 2.0 * m * n * k / self.mm_flops
        if isinstance(m, np.ndarray) or isinstance(n, np.ndarray):
            waves = np.ceil(np.ceil(m / TILE) * np.ceil(n / TILE) / self.sms)
        else:  # scalars (the search prices one layer at a time): plain floats are much faster
            waves = math.ceil(math.ceil(m / TILE) * math.ceil(n / TILE) / self.sms)
        return waves * (2.0 * self.sms * TILE * TILE) * k / self.mm_flops

    def gemm(self, m, n, k):  # noqa: ANN001, ANN201
        """Seconds of one GEMM ``(m x k) @ (k x n)``: roofline of the tiled compute and the bytes of
        the three matrices, plus the kernel's fixed cost (none for an empty ``m``)."""
        compute = self.gemm_compute(m, n, k)
        if not self.roofline:
            return compute
        if self.gemm_measured is not None:
            if isinstance(compute, np.ndarray):
                return self._gemm_measured(self.gemm_measured, compute, m, n, k)
            key = (m, n, k)
            t = self._gemms.get(key)
            if t is None:
                if len(self._gemms) >= GEMM_CACHE_SHAPES:  # a long simulation's every token count: start afresh
                    self._gemms.clear()
                t = self._gemms[key] = self._gemm_measured(self.gemm_measured, compute, m, n, k)
            return t
        memory = (m * k + k * n + m * n) * self.dtype_bytes / self.hbm_bytes_per_s
        if isinstance(compute, np.ndarray):  # an empty dimension (no tokens) runs nothing
            return (np.maximum(compute, memory) + self.launch_s) * ((m > 0) & (n > 0) & (k > 0))
        return max(compute, memory) + self.launch_s if m > 0 and n > 0 and k > 0 else 0.0

    def _gemm_measured(self, g: MeasuredGemm, compute, m, n, k):  # noqa: ANN001, ANN202
        tail = min(max(g.wave_tail, 0.0), 1.0)
        if tail > 0.0 and self.sms is not None:
            if isinstance(m, np.ndarray) or isinstance(n, np.ndarray):
                waves = np.ceil(m / WAVE_TILE[0]) * np.ceil(n / WAVE_TILE[1]) / self.sms
                idle = np.where(waves >= 1.0, np.ceil(waves) - waves, 0.0)
                compute = compute * (1.0 + tail * idle / np.maximum(waves, 1.0))
            else:
                waves = math.ceil(m / WAVE_TILE[0]) * math.ceil(n / WAVE_TILE[1]) / self.sms
                if waves >= 1.0:
                    compute = compute * (1.0 + tail * (math.ceil(waves) - waves) / waves)
        memory = cached_memory((m * k + k * n + m * n) * self.dtype_bytes, g.hbm_bytes_per_s, g.cache_bytes,
                               g.cache_speedup, g.cache_steepness,
                               working_set=(m * k + g.weights * k * n + m * n) * self.dtype_bytes)
        # np.power for scalars too: Python's ``**`` calls libm's pow, numpy's loop over arrays an AVX-512 pow where
        # the CPU has one, and the two differ in the last bit; one ufunc prices one GEMM the same alone or in an array
        t = g.fixed_s + np.power(np.power(compute, g.power) + np.power(memory, g.power), 1.0 / g.power) \
            + g.per_k_s * k
        if isinstance(t, np.ndarray):
            return t * ((m > 0) & (n > 0) & (k > 0))
        return float(t) if m > 0 and n > 0 and k > 0 else 0.0

    def gemm_efficiency(self, m, n, k):  # noqa: ANN001, ANN201
        """Achieved fraction of ``mm_flops`` (what :meth:`gemm` implies, launch included)."""
        return 2.0 * m * n * k / self.mm_flops / self.gemm(m, n, k)

    def linear(self, m, n, k):  # noqa: ANN001, ANN201
        """(forward, backward) seconds of a linear layer: the forward GEMM ``(m, n, k)``; backward the
        input gradient ``(m, k, n)`` and the weight gradient ``(n, k, m)``, reducing over tokens."""
        return self.gemm(m, n, k), self.gemm(m, k, n) + self.gemm(n, k, m)

    # ---- memory-bound operators ----------------------------------------------------------------
    def memory_bound(self, nbytes, kernels=1.0):  # noqa: ANN001, ANN201
        """Seconds of ``kernels`` streaming kernels moving ``nbytes`` in all."""
        return nbytes / self.hbm_bytes_per_s + kernels * self.launch_s * (nbytes > 0)

    # ---- flash attention -----------------------------------------------------------------------
    def attention_efficiency(self, block, overhead: float | None = None):  # noqa: ANN001, ANN201
        """Fraction of ``attn_flops`` reached over blocks of ``block`` keys: keys rounded up to whole
        tiles, and each query tile's fixed cost of ``attn_overhead`` keys (or ``overhead``; with
        ``attn_best_below``, the best of that over blocks up to ``block``: at the last whole number of
        tiles, see :meth:`floor`)."""
        overhead = self.attn_overhead if overhead is None else overhead
        if isinstance(block, np.ndarray):
            b = np.maximum(block, 1.0)
            if self.attn_untiled:
                return b / (b + overhead)
            if self.sms is None:
                return np.ones_like(b)
            eff = b / (np.ceil(b / ATTN_TILE) * ATTN_TILE + overhead)
            if self.attn_best_below:
                whole = np.floor(b / ATTN_TILE) * ATTN_TILE
                eff = np.maximum(eff, whole / (whole + overhead))
            return eff
        keys = max(float(block), 1.0)
        if self.attn_untiled:
            return keys / (keys + overhead)
        if self.sms is None:
            return 1.0
        rate = keys / (math.ceil(keys / ATTN_TILE) * ATTN_TILE + overhead)
        if self.attn_best_below:
            tiled = float(math.floor(keys / ATTN_TILE) * ATTN_TILE)
            rate = max(rate, tiled / (tiled + overhead))
        return rate

    def attention(self, flops, block, calls: float = 1.0, backward: bool = False,  # noqa: ANN001, ANN201
                  fixed: bool = True):
        """Seconds of ``calls`` flash-attention kernels doing ``flops`` over blocks of ``block`` keys
        (``backward``: at the backward's own rate where it has one; with measured calls, each call's fixed and
        per-key costs in place of the launch, and a backward at the forward's rate: the tables time forwards).
        ``fixed`` False: without the calls' fixed costs (or launches), which a caller batching several blocks into
        one kernel (an engine's varlen call per layer) charges once itself."""
        if self.attn_measured is not None and self.roofline:
            a = self.attn_measured
            t = flops / (self.attn_flops * self.attention_efficiency(block))
            # the floor (attn_best_below) leaves out the per-key cost: it is charged by the mean block, which a
            # shorter document packed beside a long one lowers (see floor)
            per_key = 0.0 if self.attn_best_below else a.per_key_s
            return t + calls * ((a.fixed_s if fixed else 0.0) + per_key * block) * (flops > 0)
        if backward and self.attn_bwd_flops is not None:
            t = flops / (self.attn_bwd_flops * self.attention_efficiency(block, self.attn_bwd_overhead))
        else:
            t = flops / (self.attn_flops * self.attention_efficiency(block))
        return t + calls * self.launch_s * (flops > 0) if fixed else t

    # ---- decode attention ----------------------------------------------------------------------
    def decode_attention(self, kv_bytes, pairs, calls: float = 1.0):  # noqa: ANN001, ANN201
        """Seconds of ``calls`` decode-attention kernels reading ``kv_bytes`` of cached keys and values in all
        for ``pairs`` (sequence, KV head) pairs: memory-bound (the measured form where the device has one; else
        the bytes at the HBM rate and a launch a call)."""
        d = self.decode_measured
        if d is None:
            return kv_bytes / self.hbm_bytes_per_s + calls * self.launch_s * (kv_bytes > 0)
        kv = cached_memory(kv_bytes, d.hbm_bytes_per_s, d.cache_bytes, d.cache_speedup, d.cache_steepness)
        return (kv + pairs * d.per_pair_s + calls * d.fixed_s) * (kv_bytes > 0)
