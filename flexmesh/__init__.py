"""flexmesh: hybrid-parallel training planner and runtime for uneven sequence lengths and devices."""

__version__ = "0.1.0"
