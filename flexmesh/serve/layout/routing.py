"""A serving plan's routing: per length class, the share of new requests (and of hand-offs to decode) each
replica takes.

>>> t = RoutingTable(prompt_edges=(1000,), entry=((1, 1, 0), (0, 0, 1)))  # short: replicas 0 and 1; long: 2
>>> t.classes, t.of(5000, 10), t.weighs(t.of(10, 10), 2, decode=False)
(2, 1, False)
"""

from __future__ import annotations

from dataclasses import dataclass

from flexmesh.errors import SpecError
from flexmesh.layout.enums import StrEnum, choices
from flexmesh.serve.layout.classes import LengthClasses


class RoutingPolicy(StrEnum):
    """How a replica is picked among those a class is routed to."""

    WEIGHTS = "weights"  # in proportion to the class's weights (smooth weighted round robin)
    LEAST_WORK = "least-work"  # the replica of positive weight whose work would finish first


@dataclass(frozen=True)
class RoutingTable(LengthClasses):
    """Requests routed by length class (:class:`~flexmesh.serve.layout.classes.LengthClasses`), as a serving plan
    routes its buckets. ``entry[class]`` holds a weight per replica of the fleet, by replica index (0 where the
    class is not sent; those of replicas outside a pool are ignored), for new requests; ``decode[class]`` the
    same for handed-off requests (empty: the decode replicas' pool by least work). ``policy``: how a replica is
    picked among those of positive weight."""

    entry: tuple[tuple[float, ...], ...] = ()
    decode: tuple[tuple[float, ...], ...] = ()
    policy: RoutingPolicy = RoutingPolicy.WEIGHTS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.policy not in choices(RoutingPolicy):
            raise SpecError(f"routing policy {self.policy!r} is not one of {', '.join(choices(RoutingPolicy))}")
        object.__setattr__(self, "policy", RoutingPolicy(self.policy))
        for name in ("entry", "decode"):
            rows = getattr(self, name)
            if rows and len(rows) != self.classes:
                raise SpecError(f"routing {name} gives {len(rows)} rows of weights for {self.classes} length classes")
            if any(w < 0 for row in rows for w in row):
                raise SpecError(f"routing {name} weights must be >= 0")

    def weighs(self, k: int, replica: int, decode: bool) -> bool:
        """Whether class ``k`` may go to ``replica`` (among new requests' or, ``decode``, hand-offs' pools): every
        replica may where the table has no rows for it."""
        rows = self.decode if decode else self.entry
        if not rows:
            return True
        row = rows[k]
        return replica < len(row) and row[replica] > 0
