"""The device layer: what a device does (kernel times, collectives over links)."""
