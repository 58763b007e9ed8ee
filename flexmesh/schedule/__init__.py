"""Per-step scheduling: split, pack and assign each global batch's sequences (a StepSchedule,
defined on the ground floor in flexmesh.layout.step)."""
