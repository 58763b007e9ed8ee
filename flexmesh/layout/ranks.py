"""Ranks written as runs, ``"0-3,6"``: how a plan file lists the ranks of a pipeline stage."""

from __future__ import annotations

from flexmesh.errors import PlanError


def rank_runs(ranks: tuple[int, ...]) -> str:
    """Ranks as runs, ``"0-3,6"`` (order kept).

    >>> rank_runs((0, 1, 2, 3, 6)), rank_runs((3,)), rank_runs((2, 1))
    ('0-3,6', '3', '2,1')
    """
    parts: list[list[int]] = []
    for r in ranks:
        if parts and r == parts[-1][1] + 1:
            parts[-1][1] = r
        else:
            parts.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)


def parse_rank_runs(value: object, what: str) -> tuple[int, ...]:
    """:func:`rank_runs`' form back to ranks; a PlanError naming ``what`` when it is not one.

    >>> parse_rank_runs("0-3,6", "block")
    (0, 1, 2, 3, 6)
    """
    if not isinstance(value, str) or not value.strip():
        raise PlanError(f"{what} must be ranks written as runs such as \"0-3,6\", got {value!r}")
    out: list[int] = []
    for item in value.split(","):
        a, _, b = item.strip().partition("-")
        try:
            lo, hi = int(a), int(b) if b else int(a)
        except ValueError:
            raise PlanError(f"{what}: cannot read {item!r} in {value!r}; write runs such as \"0-3,6\"") from None
        if lo < 0 or hi < lo:
            raise PlanError(f"{what}: {item!r} is not a run of ranks (low-high, low <= high, both >= 0)")
        out.extend(range(lo, hi + 1))
    return tuple(out)
