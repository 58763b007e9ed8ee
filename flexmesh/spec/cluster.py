"""ClusterSpec: nodes x devices per node of one device type, from a preset string or a file.

``8x8xA100-40GB`` is 8 nodes of 8 A100-40GB; ``8xH100`` is one node of 8; a path reads JSON or TOML.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

import tomllib

from flexmesh.errors import SpecError
from flexmesh.units import GIB


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator type: datasheet numbers plus fitted efficiencies (see presets/devices.toml)."""

    name: str
    peak_tflops: dict[str, float]
    memory_gib: float
    hbm_gbps: float
    nvlink_gbps: float
    node_net_gbps: float
    intra_latency_us: float
    inter_latency_us: float
    mm_efficiency: float
    attn_efficiency: float
    intra_efficiency: float
    inter_efficiency: float
    a2a_intra_efficiency: float
    a2a_inter_efficiency: float
    framework_reserve_gib: float
    allocator_headroom: float

    def __hash__(self) -> int:  # dict field: hash by name and memory, enough to key caches
        return hash((self.name, self.memory_gib, self.mm_efficiency))

    @property
    def usable_memory_bytes(self) -> float:
        """Memory the planner may fill: capacity minus allocator headroom minus framework reserve."""
        return (self.memory_gib * (1.0 - self.allocator_headroom) - self.framework_reserve_gib) * GIB

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.peak_tflops:
            raise SpecError(f"device {self.name} has no peak for dtype {dtype}; known: {sorted(self.peak_tflops)}")
        return self.peak_tflops[dtype] * 1e12


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    # Relative speed of each device (1.0 = nominal, 0.5 = half speed); empty means all nominal.
    speed_factors: tuple[float, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise SpecError(f"cluster needs at least one node and one device per node, "
                            f"got {self.nodes}x{self.devices_per_node}")
        if self.speed_factors and len(self.speed_factors) != self.world_size:
            raise SpecError(
                f"cluster has {self.world_size} devices but {len(self.speed_factors)} speed factors; "
                "give one per device"
            )
        if any(f <= 0 for f in self.speed_factors):
            raise SpecError("speed factors must be positive (1.0 = nominal speed)")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def speed(self, rank: int) -> float:
        return self.speed_factors[rank] if self.speed_factors else 1.0

    @property
    def label(self) -> str:
        n = f"{self.nodes}x" if self.nodes > 1 else ""
        return f"{n}{self.devices_per_node}x{self.device.name}"

    def with_devices(self, nodes: int, devices_per_node: int) -> "ClusterSpec":
        return replace(self, nodes=nodes, devices_per_node=devices_per_node, speed_factors=())

    def to_dict(self) -> dict:
        d = asdict(self)
        d["speed_factors"] = list(self.speed_factors)
        return d


def _load_presets() -> dict[str, DeviceSpec]:
    raw = tomllib.loads(resources.files("flexmesh.spec").joinpath("presets/devices.toml").read_text())
    eff = raw.pop("efficiency")
    mem = raw.pop("memory")
    out = {}
    for name, d in raw.items():
        e = eff[d["family"]]
        out[name] = DeviceSpec(
            name=name,
            peak_tflops={k.removeprefix("peak_tflops_"): v for k, v in d.items() if k.startswith("peak_tflops_")},
            memory_gib=d["memory_gib"],
            hbm_gbps=d["hbm_gbps"],
            nvlink_gbps=d["nvlink_gbps"],
            node_net_gbps=d["node_net_gbps"],
            intra_latency_us=d["intra_latency_us"],
            inter_latency_us=d["inter_latency_us"],
            framework_reserve_gib=mem["framework_reserve_gib"],
            allocator_headroom=mem["allocator_headroom"],
            **e,
        )
    return out


DEVICE_PRESETS: dict[str, DeviceSpec] = _load_presets()
_ALIASES = {"A100": "A100-80GB", "H100": "H100-80GB", "H200-141GB": "H200"}
_CLUSTER_RE = re.compile(r"^(?:(\d+)x)?(\d+)x([A-Za-z0-9\-]+)$")


def device(name: str) -> DeviceSpec:
    key = _ALIASES.get(name, name)
    for k, v in DEVICE_PRESETS.items():
        if k.lower() == key.lower():
            return v
    raise SpecError(f"unknown device {name!r}; known: {', '.join(list(DEVICE_PRESETS) + list(_ALIASES))}")


def _from_mapping(d: dict, where: str) -> ClusterSpec:
    for k in ("nodes", "devices_per_node", "device"):
        if k not in d:
            raise SpecError(f"{where}: cluster file is missing {k!r} (needs nodes, devices_per_node, device)")
    dev = d["device"]
    if isinstance(dev, str):
        dev = device(dev)
    elif isinstance(dev, dict):
        base = device(dev["base"]) if "base" in dev else None
        fields = {k: v for k, v in dev.items() if k != "base"}
        if base is not None:
            dev = replace(base, **fields)
        else:
            try:
                dev = DeviceSpec(**fields)
            except TypeError as e:
                raise SpecError(f"{where}: device table is incomplete ({e}); "
                                "or give base = \"A100-80GB\" and override fields") from e
    else:
        raise SpecError(f"{where}: device must be a preset name or a table")
    return ClusterSpec(nodes=int(d["nodes"]), devices_per_node=int(d["devices_per_node"]), device=dev,
                       speed_factors=tuple(float(x) for x in d.get("speed_factors", ())))


def parse_cluster(text: str) -> ClusterSpec:
    """``NODESxPERNODExDEVICE``, ``PERNODExDEVICE`` (one node), or a JSON/TOML file path."""
    m = _CLUSTER_RE.match(text)
    if m:
        nodes, per, dev = m.groups()
        return ClusterSpec(nodes=int(nodes or 1), devices_per_node=int(per), device=device(dev))
    p = Path(text)
    if p.is_file():
        try:
            raw = tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
            raise SpecError(f"{p}: cannot parse cluster file ({e})") from e
        return _from_mapping(raw, str(p))
    raise SpecError(
        f"unknown cluster {text!r}: write NODESxPERNODExDEVICE (e.g. 8x8xA100-40GB), PERNODExDEVICE (8xH100) "
        f"or a JSON/TOML file; devices: {', '.join(DEVICE_PRESETS)}"
    )
