"""Inference pricing on the device layer: what an engine iteration costs (:mod:`.timing`, the interface)."""
