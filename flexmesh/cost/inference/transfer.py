"""KV transfer between replicas over the cluster's links (prefill/decode disaggregation).

A prefill replica hands a request's KV cache (``prompt tokens x`` :func:`~flexmesh.cost.inference.memory.
kv_bytes_per_token`) to a decode replica. Each device of the sender holds its shard and sends it in
parallel (``min`` of the two replicas' device counts streams), as vLLM's KV connectors move KV device to
device (NIXL), priced as point-to-point sends on the device layer
(:meth:`flexmesh.cost.device.hardware.Hardware.collective_time`, ``send_recv``):

- inside one node: NVLink per device (PCIe where the node has no NVLink between them);
- across nodes of one device group: each device's share of its node's NICs;
- across device groups: the cluster's link between the two groups (GB/s per node, per direction; every node
  of the smaller replica sending), at the groups' inter-node efficiency.

A transfer costs ``latency + bytes / bandwidth`` (:class:`Path`); links are not shared between transfers here
(no contention is modelled).

>>> from flexmesh.spec.cluster import parse_mixed_cluster
>>> c = parse_mixed_cluster("1x8xH100+2x8xA100-40GB")
>>> nvlink = kv_path(Span(0, frozenset({0}), 1), Span(0, frozenset({0}), 1), c)
>>> across = kv_path(Span(0, frozenset({0}), 4), Span(1, frozenset({1}), 4), c)
>>> round(nvlink.seconds(2**30) * 1e3, 2), round(across.seconds(2**30) * 1e3, 2)  # 1 GiB
(3.47, 6.34)
"""

from __future__ import annotations

from dataclasses import dataclass

from flexmesh.cost.device.hardware import GroupShape, Hardware
from flexmesh.cost.inference.memory import served_dtype
from flexmesh.spec.cluster import MixedCluster


@dataclass(frozen=True)
class Span:
    """Where a replica lies: its device group, the global nodes its devices are on, how many devices."""

    group: int
    nodes: frozenset[int]
    devices: int


@dataclass(frozen=True)
class Path:
    """A transfer's fixed latency and its bandwidth (bytes per second, all streams together)."""

    latency_s: float
    bytes_per_s: float
    via: str  # "nvlink", "pcie", "network", "link 0-1"

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


def kv_path(src: Span, dst: Span, cluster: MixedCluster) -> Path:
    """The path KV takes from replica ``src`` to replica ``dst``."""
    streams = min(src.devices, dst.devices)
    if src.group == dst.group:
        group = cluster.groups[src.group]
        hw = Hardware(group, served_dtype("bf16", group.device))  # its links alone are read: any dtype it runs
        same_node = len(src.nodes) == 1 and src.nodes == dst.nodes
        shape = GroupShape(2, 2 if same_node else 1)
        # Seconds of one stream's send is affine in its bytes: its latency, then its bandwidth.
        latency = float(hw.collective_time("send_recv", 0.0, shape))
        probe = float(1 << 30)
        per_stream = probe / (float(hw.collective_time("send_recv", probe, shape)) - latency)
        if same_node:
            via = "pcie" if hw.comm.nvlink_domain and 2 > hw.comm.nvlink_domain else "nvlink"
        else:
            via = "network"
        return Path(latency, streams * per_stream, via)
    link = cluster.link(src.group, dst.group)
    a, b = cluster.groups[src.group].device, cluster.groups[dst.group].device
    efficiency = min(a.inter_efficiency, b.inter_efficiency)
    nodes = min(len(src.nodes), len(dst.nodes))
    return Path(link.latency_us * 1e-6, link.gbps * 1e9 * nodes * efficiency,
                f"link {min(src.group, dst.group)}-{max(src.group, dst.group)}")
