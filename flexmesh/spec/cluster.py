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
from flexmesh.spec.values import known_keys, mapping, number, sequence, whole
from flexmesh.spec.values import text as nonempty_text
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

    def __post_init__(self) -> None:
        where = f"device {self.name!r}"
        nonempty_text(self.name, "device name", SpecError)
        if not isinstance(self.peak_tflops, dict) or not self.peak_tflops:
            raise SpecError(f"{where}: peak_tflops must be a table of dtype = TFLOP/s, e.g. {{bf16 = 312.0}}")
        for dtype, v in self.peak_tflops.items():
            number(v, f"{where}: peak_tflops.{dtype}", SpecError)
        for f in ("memory_gib", "hbm_gbps", "nvlink_gbps", "node_net_gbps"):
            number(getattr(self, f), f"{where}: {f}", SpecError)
        for f in ("intra_latency_us", "inter_latency_us", "framework_reserve_gib"):
            number(getattr(self, f), f"{where}: {f}", SpecError, strict=False)
        # Fractions of a datasheet peak that NCCL and the matmul kernels achieve: in (0, 1].
        for f in ("mm_efficiency", "intra_efficiency", "inter_efficiency", "a2a_intra_efficiency",
                  "a2a_inter_efficiency"):
            number(getattr(self, f), f"{where}: {f}", SpecError, maximum=1.0)
        # Attention's achieved fraction of the matmul peak; a profiled device may run attention faster
        # than its measured matmuls, so only positive and finite.
        number(self.attn_efficiency, f"{where}: attn_efficiency", SpecError)
        number(self.allocator_headroom, f"{where}: allocator_headroom", SpecError, strict=False, maximum=0.99)

    def __hash__(self) -> int:  # dict field: hash by name and memory, enough to key caches
        return hash((self.name, self.memory_gib, self.mm_efficiency))

    @property
    def usable_memory_bytes(self) -> float:
        """Bytes of tensors the planner may place: capacity less the framework reserve (the CUDA
        context, which the allocator does not see), over ``1 + allocator_headroom`` (the caching
        allocator's fragmentation, a fraction of the bytes it hands out). The one budget formula."""
        return max(0.0, self.memory_gib - self.framework_reserve_gib) / (1.0 + self.allocator_headroom) * GIB

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
        for f in ("nodes", "devices_per_node"):
            whole(getattr(self, f), f"cluster {f}", SpecError, minimum=None)
        if self.nodes < 1 or self.devices_per_node < 1:
            raise SpecError(f"cluster needs at least one node and one device per node, "
                            f"got {self.nodes}x{self.devices_per_node}")
        if not isinstance(self.device, DeviceSpec):
            raise SpecError(f"cluster device must be a device preset or table, got {self.device!r}")
        for i, factor in enumerate(self.speed_factors):
            number(factor, f"speed factor {i}", SpecError)
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


_CLUSTER_KEYS = ("nodes", "devices_per_node", "device", "speed_factors")
_DEVICE_KEYS = ("base", *DeviceSpec.__dataclass_fields__)


def _from_mapping(d: dict, where: str) -> ClusterSpec:
    mapping(d, f"{where}: a cluster file", SpecError)
    known_keys(d, _CLUSTER_KEYS, f"{where}: cluster file", SpecError)
    for k in ("nodes", "devices_per_node", "device"):
        if k not in d:
            raise SpecError(f"{where}: cluster file is missing {k!r} (needs nodes, devices_per_node, device)")
    dev = d["device"]
    if isinstance(dev, str):
        dev = device(dev)
    elif isinstance(dev, dict):
        known_keys(dev, _DEVICE_KEYS, f"{where}: device table", SpecError)
        base = device(nonempty_text(dev["base"], f"{where}: device base", SpecError)) if "base" in dev else None
        fields = {k: v for k, v in dev.items() if k != "base"}
        try:
            dev = replace(base, **fields) if base is not None else DeviceSpec(**fields)
        except TypeError as e:
            raise SpecError(f"{where}: device table is incomplete ({e}); "
                            "or give base = \"A100-80GB\" and override fields") from e
        except SpecError as e:
            raise SpecError(f"{where}: {e}") from None
    else:
        raise SpecError(f"{where}: device must be a preset name or a table")
    factors = sequence(d.get("speed_factors", []), f"{where}: speed_factors", SpecError)
    nodes = whole(d["nodes"], f"{where}: nodes", SpecError)
    per_node = whole(d["devices_per_node"], f"{where}: devices_per_node", SpecError)
    try:
        return ClusterSpec(nodes=nodes, devices_per_node=per_node, device=dev, speed_factors=tuple(factors))
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None


def parse_cluster(text: str) -> ClusterSpec:
    """``NODESxPERNODExDEVICE``, ``PERNODExDEVICE`` (one node), or a JSON/TOML file path."""
    if not isinstance(text, str) or not text.strip():
        raise SpecError("the cluster is empty; write NODESxPERNODExDEVICE (e.g. 8x8xA100-40GB), PERNODExDEVICE "
                        "(8xH100) or the path of a JSON/TOML cluster file")
    m = _CLUSTER_RE.match(text)
    if m:
        nodes, per, dev = m.groups()
        return ClusterSpec(nodes=whole(int(nodes or 1), f"cluster {text!r}: nodes", SpecError),
                           devices_per_node=whole(int(per), f"cluster {text!r}: devices per node", SpecError),
                           device=device(dev))
    p = Path(text)
    if p.is_file():
        try:
            content = p.read_text(encoding="utf-8")
            raw = tomllib.loads(content) if p.suffix == ".toml" else json.loads(content)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise SpecError(f"{p}: cannot parse cluster file ({e})") from None
        return _from_mapping(raw, str(p))
    raise SpecError(
        f"unknown cluster {text!r}: write NODESxPERNODExDEVICE (e.g. 8x8xA100-40GB), PERNODExDEVICE (8xH100) "
        f"or a JSON/TOML file; devices: {', '.join(DEVICE_PRESETS)}"
    )
