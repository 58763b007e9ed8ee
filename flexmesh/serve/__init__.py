"""Serving: requests over time on replicas of a model (docs/serving-engines.md).

Everything here is torch-free except :mod:`flexmesh.serve.engine`, the real engine processes, the
HTTP router in front of them and the replay client.
"""
