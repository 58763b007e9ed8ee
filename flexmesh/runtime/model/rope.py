"""Rotary position embedding, with the context-extension scalings of Hugging Face models.

The frequencies follow transformers' definitions (``modeling_rope_utils``) of ``rope_type``
``default``, ``linear`` (positions divided by the factor), ``dynamic`` (NTK: the base grows with
the sequence length past ``max_position_embeddings``), ``yarn`` (per-dimension blend of
interpolated and original frequencies plus a cos/sin scale) and ``llama3`` (Llama 3.1: low
frequencies divided by the factor, high ones kept, a smooth blend between). They are computed in
float32 in the same order of operations, so a checkpoint sees the angles it was trained with.

Dynamic scaling depends on the sequence length; transformers uses the length of the sequence in
the forward pass. Here every packed document (a ``cu_seqlens`` segment) uses its own length (its
highest position + 1), which is what a separate transformers pass over that document computes.
"""

from __future__ import annotations

import math

import torch

from flexmesh.errors import SpecError
from flexmesh.spec.model import RopeScaling


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(s: RopeScaling) -> float:
    """The factor YaRN multiplies cos and sin by (transformers' ``attention_factor``)."""
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    return _yarn_mscale(s.factor)


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                    device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim/2], cos/sin scale)`` of every rope type but dynamic (whose base varies).

    >>> f, scale = inv_frequencies(8, 10000.0)
    >>> [round(x, 4) for x in f.tolist()], scale
    ([1.0, 0.1, 0.01, 0.001], 1.0)
    """
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    base = theta ** exps  # theta^(2i/d)
    inv = 1.0 / base
    if scaling is None or scaling.rope_type == "dynamic":
        return inv, 1.0
    if scaling.rope_type == "linear":
        return inv / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv, scaling), 1.0
    return _yarn(base, head_dim, theta, scaling), yarn_attention_factor(scaling)


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    assert s.low_freq_factor is not None and s.high_freq_factor is not None and s.original_max_position
    old = s.original_max_position
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    # long wavelengths (low frequencies) are interpolated by the factor, short ones kept as they are
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(base: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    assert s.original_max_position
    original = s.original_max_position

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty interval
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).to(base.device)  # 1: original frequency (extrapolate), 0: interpolated
    extrapolated, interpolated = 1.0 / base, 1.0 / (s.factor * base)
    return interpolated * (1 - keep) + extrapolated * keep


def _document_lengths(positions: torch.Tensor, cu_seqlens: torch.Tensor | None,
                      total: int | None = None) -> torch.Tensor:
    """For every token [B, T], the length of its packed document: the segment's highest position + 1.
    ``total``: the row's tokens (``cu_seqlens[-1]``, read from the device when not given)."""
    flat = positions.reshape(-1)
    if cu_seqlens is None:
        return torch.full_like(positions, int(flat.max()) + 1)
    if flat.numel() != (int(cu_seqlens[-1]) if total is None else total):
        raise SpecError(
            "dynamic RoPE scaling needs each rank to hold whole documents, which context parallelism breaks; "
            "use cp 1, or a model with rope_type linear, yarn or llama3"
        )
    bounds = cu_seqlens[1:].to(device=flat.device, dtype=torch.int64)
    segment = torch.searchsorted(bounds, torch.arange(flat.numel(), device=flat.device), right=True)
    top = torch.zeros(len(bounds), dtype=flat.dtype, device=flat.device)
    top = top.scatter_reduce(0, segment, flat, reduce="amax", include_self=False)
    return (top[segment] + 1).view_as(positions)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: RopeScaling | None = None,
                 cu_seqlens: torch.Tensor | None = None,
                 total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [B, T, head_dim] for integer ``positions`` [B, T].

    Uses the half-split ("rotate_half") convention of Hugging Face Llama checkpoints: dimension i
    and i + head_dim/2 form a rotating pair with frequency theta^(-2i/head_dim) (before scaling).
    So position 0 is the identity (cos 1, sin 0) whatever the document's offset in the packed row.
    ``cu_seqlens`` (the packed row's document boundaries) and ``total`` (its last value, known on the
    host) are only read by dynamic scaling.
    """
    with torch.no_grad():
        pos = positions.to(torch.float32)[..., None]
        if scaling is not None and scaling.rope_type == "dynamic":
            assert scaling.original_max_position
            n = head_dim
            longest = torch.clamp(_document_lengths(positions, cu_seqlens, total), min=scaling.original_max_position)
            growth = scaling.factor * longest.to(torch.float32) / scaling.original_max_position - (scaling.factor - 1)
            base = (theta * growth ** (n / (n - 2)))[..., None]  # [B, T, 1]: the NTK base of each document
            exps = torch.arange(0, n, 2, dtype=torch.int64, device=positions.device).to(torch.float32) / n
            angles, scale = pos * (1.0 / base ** exps), 1.0
        else:
            inv, scale = inv_frequencies(head_dim, theta, scaling, positions.device)
            angles = pos * inv  # [B, T, half]
        angles = torch.cat([angles, angles], dim=-1)
        return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, T, H, D] by the angles of ``cos``/``sin`` [B, T, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
