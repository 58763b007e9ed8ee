"""A serving replica's role: it serves requests start to end, or one phase of them (prefill/decode
disaggregation, DistServe and Splitwise).

>>> Role.parse("agg") is Role.AGGREGATED, f"{Role.DECODE}", Role.PREFILL == "prefill"
(True, 'decode', True)
>>> Role.parse("mixed")
Traceback (most recent call last):
flexmesh.errors.SpecError: role 'mixed' is not one of aggregated, prefill, decode
"""

from __future__ import annotations

from flexmesh.errors import SpecError
from flexmesh.layout.enums import StrEnum, choices


class Role(StrEnum):
    AGGREGATED = "aggregated"  # prefill and decode on the same replica
    PREFILL = "prefill"  # computes the prompt and the first token, then hands the KV to a decode replica
    DECODE = "decode"  # receives a prefilled request's KV and decodes the rest

    @classmethod
    def parse(cls, word: str) -> Role:
        """A role from its name or ``agg``."""
        try:
            return cls("aggregated" if word == "agg" else word)
        except ValueError:
            raise SpecError(f"role {word!r} is not one of {', '.join(choices(cls))}") from None

    @property
    def takes_new(self) -> bool:
        """Whether new requests are routed to it (a decode replica takes hand-offs only)."""
        return self is not Role.DECODE
