"""String enums for the words a Plan, a StepSchedule and the CLI share.

Each member *is* its string (``PipelineSchedule.ONE_F_ONE_B == "1f1b"``), prints as it and is
written to JSON as it, so files and messages read the same as before the enums existed.

>>> PipelineSchedule("interleaved") is PipelineSchedule.INTERLEAVED
True
>>> f"{CPKind.RING}", CPKind.RING == "ring", choices(Policy)
('ring', True, ('fixed', 'padded', 'balanced', 'wlb', 'hdp', 'milp', 'chunked', 'shares'))
"""

from __future__ import annotations

from enum import Enum


class StrEnum(str, Enum):
    """A string enum: each member is its string, prints and formats as it (Python 3.11's ``enum.StrEnum``, on 3.10
    too)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class PipelineSchedule(StrEnum):
    """How micro-batches flow through pipeline stages (``Plan.pipeline_schedule``)."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"
    INTERLEAVED = "interleaved"


class CPKind(StrEnum):
    """Context parallelism: none, Ulysses (all-to-all over heads) or ring (K/V passed around)."""

    NONE = "none"
    ULYSSES = "ulysses"
    RING = "ring"


class Policy(StrEnum):
    """Per-step scheduling policies (flexmesh.schedule.registry builds a step schedule with one)."""

    FIXED = "fixed"
    PADDED = "padded"
    BALANCED = "balanced"
    WLB = "wlb"
    HDP = "hdp"
    MILP = "milp"
    CHUNKED = "chunked"
    # Each replica group of a plan takes its planned share of the batch, in order, blind to lengths
    # (flexmesh.schedule.groups); no policy of one group's data ranks.
    SHARES = "shares"

    @property
    def is_baseline(self) -> bool:
        """A baseline: one static context-parallel degree, what people run today (the rest adapt per step)."""
        return self in (Policy.FIXED, Policy.PADDED, Policy.BALANCED, Policy.WLB)


class MeshAxis(StrEnum):
    """Device mesh axes, outermost first (see flexmesh.layout.mesh.rank_coords)."""

    PP = "pp"
    DP = "dp"
    CP = "cp"
    TP = "tp"


def choices(enum: type[StrEnum]) -> tuple[str, ...]:
    """The enum's values as plain strings, in definition order (for argparse ``choices``)."""
    return tuple(m.value for m in enum)
