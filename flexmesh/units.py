"""Units used across flexmesh, each defined once."""

GIB = 2**30  # bytes in a GiB
