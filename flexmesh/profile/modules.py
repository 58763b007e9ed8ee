"""The runtime's modules as the model profilers build them: a packed row, a layer at one rank's shapes,
the degrees to measure (flexmesh.profile.model and flexmesh.profile.activations)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

import numpy as np
import torch

from flexmesh.spec.model import ModelSpec


def packed_row(spec: ModelSpec, lengths: list[int], device: torch.device, cp: int = 1, cp_rank: int = 0):
    """The runtime's :class:`~flexmesh.runtime.model.transformer.Row` of a packed row of documents of ``lengths``,
    as context-parallel rank ``cp_rank`` of ``cp`` holds it (its slice of the positions)."""
    from flexmesh.runtime.model.transformer import make_row

    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    bounds = tuple(int(x) for x in np.concatenate([[0], np.cumsum(lengths)]))
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    n = sum(lengths) // cp
    return make_row(spec, positions[:, cp_rank * n:(cp_rank + 1) * n], cu, bounds, total=sum(lengths))


def rank_block(spec: ModelSpec, dtype: torch.dtype, device: torch.device, tp: int = 1):
    """One TransformerBlock with one tensor-parallel rank's shapes (heads, kv heads and ffn / tp)."""
    from flexmesh.runtime.model.transformer import TransformerBlock

    rank_spec = replace(spec, num_heads=spec.num_heads // tp, num_kv_heads=spec.num_kv_heads // tp,
                        ffn_hidden=spec.ffn_hidden // tp, head_dim_override=spec.head_dim)
    with torch.device(device):
        block = TransformerBlock(rank_spec)
    return block.to(dtype)


def degrees(spec: ModelSpec, max_degree: int) -> list[tuple[int, int]]:
    """(tp, cp) pairs to measure: powers of two, tp dividing heads, kv heads and ffn, tp * cp <= max; a
    mixture of experts at tp 1 only (the runtime spreads experts over data ranks, never over tp)."""
    out = []
    tp = 1
    while tp <= max_degree:
        if spec.num_heads % tp == 0 and spec.num_kv_heads % tp == 0 and spec.ffn_hidden % tp == 0 \
                and (tp == 1 or not spec.is_moe):
            cp = 1
            while tp * cp <= max_degree:
                out.append((tp, cp))
                cp *= 2
        tp *= 2
    return out


def parallel_layouts(spec: ModelSpec, world_size: int, max_degree: int,
                     only: Collection[tuple[int, str, int]] | None = None) -> list[tuple[int, str, int]]:
    """(tp, cp kind, cp) of one layer to time under real process groups: every tp x cp > 1 of
    :func:`degrees` that divides the world; Ulysses only where the heads per tp rank split cp ways;
    those in ``only`` when given."""
    out = []
    for tp, cp in degrees(spec, min(max_degree, world_size)):
        if tp * cp == 1 or world_size % (tp * cp):
            continue
        if cp == 1:
            out.append((tp, "none", 1))
            continue
        out.extend((tp, kind, cp) for kind in ("ulysses", "ring")
                   if kind == "ring" or (spec.num_heads // tp) % cp == 0)
    return [layout for layout in out if only is None or layout in only]
