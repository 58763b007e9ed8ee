"""FlashAttention-2's price where an architecture's fastest fused attention is another kernel.

The presets price fused attention by measured kernel tables (flexmesh.cost.device.attention_tables): the
fastest kernel each architecture has, FlashAttention-3 on Hopper. flexmesh's runtime runs
FlashAttention-2 there (PyTorch's varlen kernel, or the flash-attn 2 package:
flexmesh.runtime.model.attention_kernels), which ``bench/attention_kernel.py`` measured on an H200 at 1.6-1.8x
the preset's forward time over long documents, 2.2-2.6x its backward, and 4-7x both at 512 tokens: a
larger fixed cost per query tile, and a backward slower than its forward. A stack that runs it
(``Stack(attention="flash2")``, the runtime's) is priced by the measurements recorded in
``devices.toml`` ``[flash_attention_2.<architecture>]``: per pass,

    rate(L) = efficiency x peak x L / (L rounded up to whole 128-key tiles + overhead keys)

(:meth:`flexmesh.cost.device.kernels.Kernels.attention_efficiency`'s form), fitted over both measured head
dims by least squares in relative error. Architectures not listed price it as their fused kernel.

Run ``python -m flexmesh.cost.device.flash2`` to redo the fits from the recorded samples and print them beside
the recorded values; it exits 1 when one differs by more than 0.5%.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import numpy as np

from flexmesh.cost.device.kernels import ATTN_TILE, Kernels
from flexmesh.spec.devices import FLASH2

PASSES = ("fwd", "bwd")


def fit(entry: dict, side: str) -> tuple[float, float]:
    """(efficiency, overhead keys) of pass ``side`` ("fwd" or "bwd") from ``entry``'s samples."""
    from scipy.optimize import least_squares

    lengths = np.tile(np.asarray(entry["doc_lengths"], dtype=float), len(entry["head_dims"]))
    rates = np.asarray(entry[f"{side}_tflops"], dtype=float).ravel()
    tiles = np.ceil(lengths / ATTN_TILE) * ATTN_TILE

    def residuals(p: np.ndarray) -> np.ndarray:
        return p[0] * entry["peak_tflops"] * lengths / (tiles + p[1]) / rates - 1.0

    got = least_squares(residuals, x0=[0.5, float(ATTN_TILE)], bounds=([1e-3, 0.0], [1.0, 1e5]))
    return float(got.x[0]), float(got.x[1])


def flash2_kernels(kernels: Kernels, architecture: str, peak_flops: float) -> Kernels:
    """``kernels`` with attention priced as FlashAttention-2 runs on ``architecture`` (``peak_flops``: the
    device's datasheet peak in the training dtype); ``kernels`` itself where nothing was measured there.

    >>> k = Kernels(mm_flops=600e12, attn_flops=500e12, hbm_bytes_per_s=3e12, sms=132)
    >>> f = flash2_kernels(k, "hopper", 989.5e12)
    >>> bool(f.attention(1e12, 16384) > k.attention(1e12, 16384))
    True
    >>> bool(f.attention(1e12, 16384, backward=True) > f.attention(1e12, 16384))  # its backward is slower
    True
    >>> flash2_kernels(k, "ampere", 312e12) is k
    True
    """
    entry = FLASH2.get(architecture)
    if entry is None or kernels.sms is None:  # a measured machine's attention is already its own kernel's
        return kernels
    # Its own measured form in place of the tables' (which time FlashAttention-3's calls, not this kernel's).
    return replace(kernels, attn_flops=entry["fwd_efficiency"] * peak_flops, attn_overhead=entry["fwd_overhead_keys"],
                   attn_bwd_flops=entry["bwd_efficiency"] * peak_flops, attn_bwd_overhead=entry["bwd_overhead_keys"],
                   attn_measured=None)


def main() -> int:
    worst = 0.0
    print(f"{'architecture':<12} {'pass':<4} {'efficiency':>10} {'recorded':>8} {'overhead':>8} {'recorded':>8}")
    for arch, entry in sorted(FLASH2.items()):
        for side in PASSES:
            eff, over = fit(entry, side)
            rec_e, rec_o = entry[f"{side}_efficiency"], entry[f"{side}_overhead_keys"]
            worst = max(worst, abs(eff / rec_e - 1.0), abs(over / rec_o - 1.0))
            print(f"{arch:<12} {side:<4} {eff:>10.4f} {rec_e:>8.4f} {over:>8.0f} {rec_o:>8.0f}")
    print(f"largest difference from the recorded fits: {worst:.2%}")
    return 0 if worst <= 0.005 else 1


if __name__ == "__main__":
    sys.exit(main())
