"""Parallelism applied to the model from outside, devices and process groups."""
