"""Model and cluster specifications (dataclasses), presets, and parsers for user input."""

from flexmesh.spec.cluster import ClusterSpec, DeviceSpec, parse_cluster, DEVICE_PRESETS
from flexmesh.spec.model import ModelSpec, parse_model, MODEL_PRESETS, from_hf_config

__all__ = [
    "ClusterSpec",
    "DeviceSpec",
    "ModelSpec",
    "parse_cluster",
    "parse_model",
    "from_hf_config",
    "MODEL_PRESETS",
    "DEVICE_PRESETS",
]
