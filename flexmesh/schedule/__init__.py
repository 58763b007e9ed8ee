"""Per-step scheduling: split, pack and assign each global batch's sequences (StepSchedule)."""

from flexmesh.schedule.types import Group, MicroBatch, Piece, StepSchedule

__all__ = ["Group", "MicroBatch", "Piece", "StepSchedule"]
