"""Per-layer parallel strategy: a small hashable value with a compact printable form.

Within one pipeline stage of ``D`` devices a layer runs with ``tp * cp * dp == D``:

- ``tp``: tensor parallel degree (Megatron column/row split, always with sequence parallelism on the
  norms, so activations outside the matmuls are split ``tp`` ways too);
- ``cp`` and ``cp_kind``: context parallel degree and kind, ``ulysses`` (all-to-all over heads) or
  ``ring`` (K/V blocks passed around a ring); ``cp == 1`` means ``cp_kind == "none"``;
- ``dp``: data parallel degree; ``zero`` (0-3) is the ZeRO stage, sharding over the ``dp * cp``
  ranks that hold the same weights (as FSDP over a flattened dp x cp mesh does);
- ``recompute`` (:class:`Recompute`): ``none``; ``selective``, only the attention core
  (softmax(QK^T)V) is recomputed in backward, as Megatron-LM's ``--recompute-granularity selective``
  (Korthikanti et al., 2205.05198); ``full``, activation checkpointing of the whole layer.

Compact form, as in ``tp2-u2-dp2z3-ac``: tp 2, Ulysses 2, dp 2 with ZeRO-3, fully recomputed
(``-sac``: selective recomputation).

>>> s = LayerStrategy.parse("tp2-r4-dp1z0")
>>> (s.tp, s.cp, str(s.cp_kind), s.dp, s.zero, str(s.recompute))
(2, 4, 'ring', 1, 0, 'none')
>>> str(s), str(LayerStrategy.parse("tp2-dp4z1-sac").recompute)
('tp2-r4-dp1z0', 'selective')
>>> LayerStrategy(recompute=True).recompute is Recompute.FULL  # a bool still means full or none
True
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

from flexmesh.errors import PlanError
from flexmesh.layout.enums import CPKind, StrEnum, choices


class Recompute(StrEnum):
    """What a layer recomputes in backward instead of keeping for it.

    Truthy only for ``full``: code written when recomputation was a bool (``if s.recompute``) keeps
    meaning "the whole layer is recomputed"; test ``is Recompute.SELECTIVE`` for the attention core.
    """

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    def __bool__(self) -> bool:
        return self is Recompute.FULL


CP_KINDS = choices(CPKind)
RECOMPUTE_KINDS = choices(Recompute)
_CP_LETTER = {CPKind.ULYSSES: "u", CPKind.RING: "r"}
_AC_SUFFIX = {Recompute.NONE: "", Recompute.SELECTIVE: "-sac", Recompute.FULL: "-ac"}
_RE = re.compile(r"^tp(\d+)(?:-([ur])(\d+))?-dp(\d+)z([0-3])(-s?ac)?$")


@dataclass(frozen=True, order=True)
class LayerStrategy:
    tp: int = 1
    cp: int = 1
    cp_kind: CPKind = CPKind.NONE
    dp: int = 1
    zero: int = 0
    recompute: Recompute | bool = Recompute.NONE  # a bool is read as full (True) or none (False)

    def __post_init__(self) -> None:
        rc = self.recompute
        if isinstance(rc, bool):
            rc = Recompute.FULL if rc else Recompute.NONE
        if rc not in RECOMPUTE_KINDS:
            raise PlanError(f"recompute must be one of {', '.join(RECOMPUTE_KINDS)} (or a bool), got {rc!r}")
        object.__setattr__(self, "recompute", Recompute(rc))
        if min(self.tp, self.cp, self.dp) < 1:
            raise PlanError(f"strategy degrees must be >= 1, got tp={self.tp} cp={self.cp} dp={self.dp}")
        if self.cp_kind not in CP_KINDS:
            raise PlanError(f"cp_kind must be one of {CP_KINDS}, got {self.cp_kind!r}")
        object.__setattr__(self, "cp_kind", CPKind(self.cp_kind))
        if (self.cp == 1) != (self.cp_kind == "none"):
            raise PlanError(f"cp={self.cp} with cp_kind={self.cp_kind!r}: use cp_kind 'none' exactly when cp == 1")
        if self.zero not in (0, 1, 2, 3):
            raise PlanError(f"zero stage must be 0, 1, 2 or 3, got {self.zero}")

    @property
    def recompute_kind(self) -> Recompute:
        """``recompute`` as a :class:`Recompute` (it always is one once built; the field also takes a bool)."""
        return cast(Recompute, self.recompute)

    @property
    def devices(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def shard_degree(self) -> int:
        """Ranks over which ZeRO shards states: every rank holding the same weights (dp x cp)."""
        return self.dp * self.cp

    def __str__(self) -> str:
        cp = f"-{_CP_LETTER[self.cp_kind]}{self.cp}" if self.cp > 1 else ""
        return f"tp{self.tp}{cp}-dp{self.dp}z{self.zero}{_AC_SUFFIX[self.recompute_kind]}"

    @classmethod
    def parse(cls, text: str) -> "LayerStrategy":
        m = _RE.match(text.strip())
        if not m:
            raise PlanError(
                f"cannot parse strategy {text!r}; expected e.g. 'tp2-dp4z1', 'tp1-u4-dp2z3-ac' (u=ulysses, r=ring; "
                "-ac: full recomputation, -sac: selective)"
            )
        tp, letter, cp, dp, zero, ac = m.groups()
        kind = {"u": CPKind.ULYSSES, "r": CPKind.RING, None: CPKind.NONE}[letter]
        return cls(tp=int(tp), cp=int(cp or 1), cp_kind=kind, dp=int(dp), zero=int(zero),
                   recompute={None: Recompute.NONE, "-sac": Recompute.SELECTIVE, "-ac": Recompute.FULL}[ac])

    def phase_group(self, moe: bool = False) -> "LayerStrategy":
        """What a layer's phases depend on: its tp x cp group and recomputation (for a mixture of
        experts its data ranks too); one instance per strategy, shared by every price asked for."""
        return _phase_group(self, moe)

    def same_mesh(self, other: "LayerStrategy") -> bool:
        """True when both layers place data the same way, so no resharding happens between them."""
        return (self.tp, self.cp, self.cp_kind, self.dp) == (other.tp, other.cp, other.cp_kind, other.dp)


def chunk_anchors(chunks: Sequence[Sequence[LayerStrategy]], pp: int = 1) -> list[LayerStrategy]:
    """Each chunk's first layer strategy; for a chunk of no layers (the embedding or the head alone, as
    Llama 3's first and last chunks, 2407.21783 section 3.3.2) the layout its embedding or head runs on
    and its boundary activations are cut by: that of the devices running it, i.e. its pipeline rank's
    (chunk ``i`` runs on rank ``i % pp``) next chunk's first strategy, else that rank's previous chunk's
    last; on a rank with no layer at all, the next chunk's first, else the previous chunk's last.

    >>> a, b = LayerStrategy(tp=1), LayerStrategy(tp=2)
    >>> [str(s) for s in chunk_anchors([[], [a, a], [b], []])]
    ['tp1-dp1z0', 'tp1-dp1z0', 'tp2-dp1z0', 'tp2-dp1z0']
    >>> [str(s) for s in chunk_anchors([[], [a], [b], []], pp=2)]  # rank 0 runs chunks 0 and 2
    ['tp2-dp1z0', 'tp1-dp1z0', 'tp2-dp1z0', 'tp1-dp1z0']
    """
    n = len(chunks)
    out: list[LayerStrategy | None] = [None] * n
    for step in dict.fromkeys((pp, 1)):  # the rank's own chunks first, then any chunk
        for r in range(step):
            later = earlier = None
            for i in reversed(range(r, n, step)):  # the next chunk's first, one pass from the end
                later = chunks[i][0] if chunks[i] else later
                out[i] = out[i] or later
            for i in range(r, n, step):  # else the previous chunk's last
                earlier = chunks[i][-1] if chunks[i] else earlier
                out[i] = out[i] or earlier
    if any(s is None for s in out):
        raise PlanError("no chunk holds a layer; give every stage at least one layer")
    return cast(list[LayerStrategy], out)


@lru_cache(maxsize=None)
def _phase_group(s: LayerStrategy, moe: bool) -> LayerStrategy:
    return LayerStrategy(tp=s.tp, cp=s.cp, cp_kind=s.cp_kind, recompute=s.recompute, dp=s.dp if moe else 1)
