"""Compressed expert all-to-all (LSH-MoE, Nie et al., NeurIPS 2024, arXiv 2411.08446; it publishes no code, so this
follows the paper's section 3.2).

The tokens a rank sends to one expert on one rank are clustered by cross-polytope locality-sensitive hashing
(Andoni et al., 2015): ``hashes`` random rotations of the hidden state to ``dim`` dimensions, each hashing a token
to the index of its largest signed coordinate (one of ``2 dim`` codes), the codes together naming its bucket. Only
each bucket's centroid (the mean of its tokens) crosses the all-to-all and runs through the expert; on return every
token takes its centroid's output plus its own residual ``x - centroid`` (the paper's residual-based error
compensation). Tokens alone in their bucket go through exactly as uncompressed (centroid = token, residual 0),
so a hash finer than the tokens is the plain layer.

The rotations are drawn from a fixed seed per layer, the same on every rank and every step (the hash is part of the
layer's behaviour, not state); hashing runs without gradient, and the centroid's mean carries each token's gradient.

>>> import torch
>>> lsh = CrossPolytope(hidden=4, dim=2, hashes=1, seed=0)
>>> x = torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 0, 0, 1.0]])
>>> c, members = lsh.compress(x, torch.zeros(3, dtype=torch.long))
>>> c.shape[0], members.tolist()   # the two equal tokens share a bucket
(2, [0, 0, 1])
"""

from __future__ import annotations

import torch


class CrossPolytope:
    """Cross-polytope LSH of ``hidden``-wide rows: ``hashes`` rotations to ``dim`` dimensions (``(2 dim) ** hashes``
    buckets), from ``seed``."""

    def __init__(self, hidden: int, dim: int, hashes: int, seed: int) -> None:
        if dim < 1 or hashes < 1:
            raise ValueError(f"cross-polytope hashing needs dim >= 1 and hashes >= 1, got {dim} and {hashes}")
        g = torch.Generator().manual_seed(seed)
        self.rotations = torch.randn(hashes, hidden, dim, generator=g)  # Gaussian: a random rotation's direction
        self.dim, self.hashes = dim, hashes
        self.buckets = (2 * dim) ** hashes

    def bucket(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's bucket (int64 [n])."""
        with torch.no_grad():
            r = torch.einsum("nh,jhd->jnd", x.float(), self.rotations.to(x.device))
            code = torch.cat([r, -r], dim=-1).argmax(dim=-1)  # [hashes, n] in [0, 2 dim)
            base = (2 * self.dim) ** torch.arange(self.hashes, device=x.device)
            return (code * base[:, None]).sum(0)

    def compress(self, x: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The centroids of ``x`` [n, hidden] clustered within each ``group`` (int64 [n], rows already sorted by
        group) by bucket: (centroids [m, hidden] in group order, each row's centroid index [n])."""
        key = group * self.buckets + self.bucket(x)
        uniq, members = torch.unique(key, sorted=True, return_inverse=True)
        size = torch.bincount(members, minlength=uniq.numel()).to(x.dtype)
        sums = x.new_zeros(uniq.numel(), x.shape[-1]).index_add(0, members, x)
        return sums / size[:, None], members

    @staticmethod
    def clusters_per_group(group: torch.Tensor, members: torch.Tensor, groups: int) -> torch.Tensor:
        """Centroids in each group (int64 [groups]): what each group sends instead of its rows."""
        first = torch.zeros(int(members.max()) + 1 if members.numel() else 0, dtype=torch.long, device=group.device)
        first.scatter_(0, members, group)  # a centroid's rows all share its group
        return torch.bincount(first, minlength=groups)

    @staticmethod
    def decompress(y: torch.Tensor, x: torch.Tensor, centroids: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
        """Each row's output: its centroid's ``y`` plus its residual ``x - centroid``."""
        return y[members] + (x - centroids[members]).to(y.dtype)
