"""Model and cluster specifications (dataclasses), presets, and parsers for user input."""

from flexmesh.spec.cluster import DEVICE_PRESETS, ClusterSpec, DeviceSpec, parse_cluster
from flexmesh.spec.model import MODEL_PRESETS, ModelSpec, from_hf_config, parse_model

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
