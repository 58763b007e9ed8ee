"""Pricing of a training step, on the device layer."""
