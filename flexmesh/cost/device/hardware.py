"""Achievable compute throughput and alpha-beta collective times, per group size and locality.

A group of ``size`` ranks whose members sit ``per_node`` to a node spans ``nodes`` nodes. Collectives
are modelled as NCCL runs them: ring algorithms inside a node over NVLink, and across nodes bounded
by the NICs of the group's ranks (one NIC per GPU on DGX-class nodes), each part at a fitted fraction
of the datasheet bandwidth (see ``flexmesh.cost.training.calibrate``).

Worked example (a part without a measured table, 1 GiB all-reduce over the 8 GPUs of one node at
300 GB/s): ``2 * 7/8 * 2**30 B / (300 GB/s * 0.69) = 9.1 ms`` plus NCCL's latency of the protocol it picks
for that size (Simple, ``8.4 + 2 * 7 * 3.4 us``; :func:`nccl_ring_time`, NCCL's own tuning model). Inside a
node, a group runs over NVLink when its GPUs of that node lie within one NVLink domain (all 8 behind an
NVSwitch; a bridged pair of PCIe cards) and over PCIe otherwise (``DeviceSpec.nvlink_domain``).

Parts whose node was measured (``DeviceSpec.comm_table``: A100 SXM, H100 SXM, H200, B200) take the
all-reduce, all-gather and reduce-scatter inside a node from the measured NCCL times instead
(:class:`CommTable`), by message size and GPU count: mid-size messages run well below the large ones'
bandwidth, which no single efficiency and latency reproduce (A100, 8 GPUs: 136 GB/s bus bandwidth at
16 MiB, 222 GB/s at 512 MiB), and H100's all-reduce uses NVLink SHARP (445 GB/s at 512 MiB against 336
for all-gather).

A hardware profile (written by ``flexmesh profile hardware``) replaces every number here with a
measurement: ``flexmesh.profile.timing.ProfiledHardware``, a subclass built by
``flexmesh.profile.use.hardware_from_profile`` (the cost package does not read profiles; docs/profiles.md
describes the scaling to group sizes it did not measure).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from flexmesh.cost.device.kernels import (
    HBM_EFFICIENCY,
    TABLE_WEIGHTS,
    Kernels,
    MeasuredAttention,
    MeasuredDecode,
    MeasuredGemm,
)
from flexmesh.spec.cluster import ClusterSpec
from flexmesh.spec.devices import (
    ATTENTION_KERNELS,
    COMM_TABLES,
    DECODE_KERNELS,
    GEMM_KERNELS,
    GEMM_TABLES,
    DeviceSpec,
)
from flexmesh.spec.model import DTYPE_BYTES

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# Compute that a collective overlaps runs 1.13x slower on A100 (Galvatron, 2211.13878, its measured
# slowdown coefficient; docs/cost-model.md): of a collective hidden under compute, 1 - 0.13 = 0.87 of
# its time is really saved.
OVERLAP_SLOWDOWN = 1.13
PRESET_OVERLAP = 2.0 - OVERLAP_SLOWDOWN
EAGER_FLOOR_OP = "vllm_eager"  # the measured eagerly called all-reduce whose smallest message sets Hardware.eager_floor
# NCCL's own model of a ring collective, which its tuner prices each protocol by and runs the fastest of (NVIDIA/nccl,
# src/graph/tuning.cc, 2.18 to 2.2x: baseLat and hwLat of the Ring algorithm; LL moves a quarter of the bus bandwidth,
# LL128 92% of it and only where NVLink joins the ring): protocol -> (base latency us, latency per ring step us over
# NVLink, over PCIe (None: not run there), share of the bus bandwidth).
NCCL_RING_PROTOCOLS = {"LL": (6.6, 0.6, 1.0, 0.25), "LL128": (14.0, 1.9, None, 0.92), "Simple": (8.4, 3.4, 5.7, 1.0)}


def nccl_ring_time(steps: int, volume, bus_bytes_per_s: float, nvlink: bool):
    """Seconds of a ring collective of ``steps`` steps moving ``volume`` bytes per rank (``2 (k-1)/k`` of the buffer
    for an all-reduce over ``k`` GPUs, ``(k-1)/k`` for an all-gather or reduce-scatter; may be an array) at
    ``bus_bytes_per_s``, as NCCL's tuner prices it: the fastest of its protocols, each its base latency plus one hop's
    per step. Where no measured table exists this is what sets a small message's time: one hop of an LL ring costs
    0.6 us over NVLink and 1.0 over PCIe, against a Simple ring's 3.4 and 5.7 (NCCL's figures).

    >>> round(float(nccl_ring_time(6, 3 / 4 * 2 ** 17, 48e9, nvlink=False)) * 1e6, 1)  # 128 KiB over 4 GPUs on PCIe: LL
    20.8
    >>> round(float(nccl_ring_time(6, 3 / 4 * 2 ** 26, 48e9, nvlink=False)) * 1e3, 3)  # 64 MiB: Simple
    1.091
    """
    best = None
    for base, nvl, pci, share in NCCL_RING_PROTOCOLS.values():
        hop = nvl if nvlink else pci
        if hop is None:
            continue
        t = (base + steps * hop) * 1e-6 + volume / (bus_bytes_per_s * share)
        best = t if best is None else np.minimum(best, t)
    return best


@dataclass(frozen=True)
class GroupShape:
    """How a process group lies on the cluster."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / self.per_node)

    @property
    def intra_node(self) -> bool:
        return self.nodes == 1


def group_shape(size: int, stride: int, cluster: ClusterSpec) -> GroupShape:
    """Shape of a group of ``size`` ranks spaced ``stride`` apart (stride 1 = consecutive ranks).

    >>> from flexmesh.spec import parse_cluster
    >>> c = parse_cluster("4x8xA100-80GB")
    >>> group_shape(8, 1, c), group_shape(4, 8, c).nodes, group_shape(4, 2, c).nodes
    (GroupShape(size=8, per_node=8), 4, 1)
    """
    dpn = cluster.devices_per_node
    if size <= 1:
        return GroupShape(1, 1)
    per_node = max(1, min(size, dpn // stride)) if stride <= dpn else 1
    return GroupShape(size, per_node)


@lru_cache(maxsize=4096)
def pipeline_crossings(world: int, per_node: int, pp: int, v: int = 1) -> tuple[bool, ...]:
    """Per pipeline rank, whether its pipeline sends leave its node. The rank order puts stage ``i`` on
    ranks ``[i x stride, (i + 1) x stride)`` (``stride = world / pp``, stages outermost) and a rank sends
    to the same offset of the next stage; the last stage's boundary is the one before it, or with
    interleaving (``v > 1``) the one to the first stage, which runs its next chunk. A stage narrower
    than a node shares nodes with its neighbours, so only the boundaries at node edges cross.

    >>> pipeline_crossings(32, 8, 8)  # 4 GPUs a stage: every second boundary leaves the node
    (False, True, False, True, False, True, False, False)
    >>> pipeline_crossings(32, 8, 8, v=2)[-1], pipeline_crossings(16, 8, 2), pipeline_crossings(8, 8, 4)
    (True, (True, True), (False, False, False, False))
    """
    stride = world // pp

    def crosses(a: int, b: int) -> bool:
        if stride >= per_node:
            return True
        return any((a * stride + x) // per_node != (b * stride + x) // per_node for x in range(stride))

    if pp == 1:
        return (False,)
    last = 0 if v > 1 else pp - 2
    return tuple(crosses(r, r + 1 if r < pp - 1 else last) for r in range(pp))


class CommTable:
    """Measured times of ring collectives inside one node (presets/collectives.toml), by op, GPU count and
    message size.

    Between measured sizes the time is interpolated linearly in log(bytes) and log(time); below the
    smallest it is the smallest's (the latency floor); above the largest it grows in proportion to the
    bytes (the largest message's bandwidth). A GPU count the table did not measure takes the nearest
    measured one (the larger on a tie), scaled by the ring's volume ``(n - 1) / n`` over the measured
    count's.

    >>> t = CommTable({"all_gather": {2: ((1e3, 1e6), (1e-5, 1e-4))}})
    >>> [round(float(t.time("all_gather", 2, b)) * 1e6, 2) for b in (10.0, 1e3, 31622.78, 1e6, 2e6)]
    [10.0, 10.0, 31.62, 100.0, 200.0]
    >>> round(float(t.time("all_gather", 4, 1e6)) * 1e6, 2)  # 3/4 of the volume against 1/2
    150.0
    """

    def __init__(self, curves: dict[str, dict[int, tuple[tuple[float, ...], tuple[float, ...]]]],
                 linear: bool = False):
        self._raw = curves
        self._curves = {op: {n: (np.log(np.asarray(b, dtype=float)), np.log(np.asarray(t, dtype=float)),
                                 float(b[-1]), float(t[-1]))
                             for n, (b, t) in by_n.items()} for op, by_n in curves.items()}
        # seconds per byte at the best measured bandwidth (the least t / b of a curve: at a measured size,
        # since between sizes and beyond them t / b lies between its neighbours' or keeps the largest's)
        self._rate = {op: {n: min(t_ / b_ for b_, t_ in zip(b, t)) for n, (b, t) in by_n.items()}
                      for op, by_n in curves.items()}
        self.linear = linear
        self._memo: dict[tuple[str, int, float], float] = {}

    def envelope(self) -> CommTable:
        """The same table at each curve's best bandwidth and no latency: times proportional to the bytes,
        never above the measured ones, and additive (the collectives of documents run alone add up to
        theirs packed together), as :meth:`flexmesh.cost.device.kernels.Kernels.envelope` makes the kernels.

        >>> t = CommTable({"all_gather": {2: ((1e3, 1e6), (1e-5, 1e-4))}}).envelope()
        >>> [round(float(t.time("all_gather", 2, b)) * 1e6, 3) for b in (1e3, 1e6, 2e6)]
        [0.1, 100.0, 200.0]
        """
        return CommTable(self._raw, linear=True)

    def covers(self, kind: str) -> bool:
        return kind in self._curves

    def time(self, kind: str, n: int, nbytes):
        """Seconds of one ``kind`` over ``n`` GPUs of a node with a buffer of ``nbytes`` (arrays too)."""
        if not isinstance(nbytes, np.ndarray):
            key = (kind, n, float(nbytes))
            if key not in self._memo:
                self._memo[key] = float(self._time(kind, n, np.asarray(float(nbytes))))
            return self._memo[key]
        return self._time(kind, n, nbytes)

    def _time(self, kind: str, n: int, nbytes: np.ndarray) -> np.ndarray:
        if n <= 1:
            return np.zeros_like(nbytes, dtype=float)
        by_n = self._curves[kind]
        near = min(by_n, key=lambda m: (abs(m - n), -m))
        if self.linear:
            t = np.asarray(nbytes, dtype=float) * self._rate[kind][near]
        else:
            logb, logt, b_max, t_max = by_n[near]
            b = np.maximum(np.asarray(nbytes, dtype=float), 1.0)
            t = np.where(b > b_max, t_max * b / b_max, np.exp(np.interp(np.log(b), logb, logt)))
        t = t * (((n - 1) / n) / ((near - 1) / near))
        return np.where(np.asarray(nbytes) > 0, t, 0.0)


@dataclass(frozen=True)
class CollectiveParams:
    """Per-collective efficiencies and latencies; from a device preset or a hardware profile."""

    intra_gbps: float  # NVLink per GPU per direction
    inter_gbps_per_gpu: float  # node NIC bandwidth per direction divided among the node's GPUs
    ring_intra_eff: float
    ring_inter_eff: float
    a2a_intra_eff: float
    a2a_inter_eff: float
    intra_latency_s: float
    inter_latency_s: float
    nvlink_domain: int = 0  # GPUs of a node NVLink joins (0: all); groups with more of a node use PCIe
    pcie_gbps: float = 0.0  # per GPU per direction
    table: CommTable | None = None  # measured ring collectives inside a node, where the part has them
    pcie_eff: float = 0.0  # achieved fraction of pcie_gbps by collectives over PCIe; 0: ring_intra_eff's
    nvlink: bool = True  # NVLink joins the node's GPUs (DeviceSpec.intra_link other than "pcie")

    def intra_bytes_per_s(self, per_node: int) -> float:
        """Bandwidth of a group with ``per_node`` members on each node: NVLink within the NVLink domain
        (groups lie on consecutive GPUs, tp innermost), PCIe beyond it, at the share of it collectives over
        PCIe reach (``pcie_eff``) where that differs from NVLink's (the efficiencies apply to this bandwidth)."""
        if self.nvlink_domain and per_node > self.nvlink_domain:
            return self.pcie_gbps * 1e9 * (self.pcie_eff / self.ring_intra_eff if self.pcie_eff else 1.0)
        return self.intra_gbps * 1e9

    def over_nvlink(self, per_node: int) -> bool:
        """Whether a ring of ``per_node`` GPUs of a node runs over NVLink (else over PCIe)."""
        return self.nvlink and not (self.nvlink_domain and per_node > self.nvlink_domain)


class Hardware:
    """Throughput and collective times for one cluster; the only place bandwidths are turned into time."""

    def __init__(self, cluster: ClusterSpec, dtype: str = "bf16"):
        d = cluster.device
        self.cluster = cluster
        self.dtype = dtype
        self.peak_flops = d.peak_flops(dtype)
        self.matmul_flops = self.peak_flops * d.mm_efficiency
        self.attn_flops = self.peak_flops * d.attn_efficiency
        self.hbm_bytes_per_s = d.hbm_gbps * 1e9
        # The device layer's kernels (flexmesh.cost.device.kernels): each kernel as the part's measured tables time it
        # (DeviceSpec.kernel_mm_efficiency and kernel_attn_efficiency, the tables' forms), memory-bound operators at
        # the achievable fraction of the datasheet HBM bandwidth; serving prices its kernels with them. A part
        # without tables has the tile and wave model at the end-to-end fits' rates.
        self.device_kernels = device_kernels(self.tile_kernels(), d, self.peak_flops)
        # The share of the datasheet clock a power-capped part sustains (1 for the others): its Tensor Core rates at
        # that clock (the memory terms do not scale, so a few rounds bring the GEMM to the measured rate).
        self.clock, cap = 1.0, self.power_cap()
        for _ in range(4):
            if cap >= 1.0 - 1e-3:
                break
            self.clock *= cap
            self.matmul_flops, self.attn_flops = self.matmul_flops * cap, self.attn_flops * cap
            self.device_kernels = device_kernels(self.tile_kernels(), d, self.peak_flops * self.clock)
            cap = self.power_cap()
        # A training step's kernels: the same kernels and forms, at the share of their rates a training step's
        # GEMMs and attention reach (the framework terms above the device layer: DeviceSpec.framework_mm and
        # framework_attn, so the rates are peak x mm_efficiency and peak x attn_efficiency).
        self.kernels = replace(self.device_kernels, mm_flops=self.matmul_flops, attn_flops=self.attn_flops)
        self.memory_bytes = d.usable_memory_bytes
        self.source = f"preset:{d.name}"
        self.overlap = PRESET_OVERLAP
        self.comm = CollectiveParams(
            intra_gbps=d.nvlink_gbps,
            inter_gbps_per_gpu=d.node_net_gbps / cluster.devices_per_node,
            ring_intra_eff=d.intra_efficiency,
            ring_inter_eff=d.inter_efficiency,
            a2a_intra_eff=d.a2a_intra_efficiency,
            a2a_inter_eff=d.a2a_inter_efficiency,
            intra_latency_s=d.intra_latency_us * 1e-6,
            inter_latency_s=d.inter_latency_us * 1e-6,
            nvlink_domain=d.nvlink_domain,
            pcie_gbps=d.pcie_gbps,
            table=_comm_table(d.comm_table),
            pcie_eff=d.pcie_efficiency,
            nvlink=d.intra_link != "pcie",
        )

    def power_cap(self) -> float:
        """What the device layer's rates still need scaling by for a power-capped part: its measured large-GEMM
        throughput (``DeviceSpec.sustained_tflops``) over the device layer's price of that GEMM; 1 where none is
        measured or the price is already below it.

        >>> from flexmesh.spec import parse_cluster
        >>> hw = Hardware(parse_cluster("4xT4"), dtype="fp16")
        >>> round(2 * 4096 ** 3 / hw.device_kernels.gemm(4096, 4096, 4096) / 1e12, 1)  # the forum's 24, not 56
        24.0
        >>> Hardware(parse_cluster("4xA100")).power_cap()
        1.0
        """
        sustained = self.cluster.device.sustained_tflops.get(self.dtype)
        if sustained is None:
            return 1.0
        rate = 2 * 4096 ** 3 / float(self.device_kernels.gemm(4096, 4096, 4096))
        return min(1.0, sustained * 1e12 / rate)

    def tile_kernels(self) -> Kernels:
        """The tile and wave model at the end-to-end fits' rates: GEMM tiles over the datasheet SM count, memory-bound
        operators at the achievable fraction of the datasheet HBM bandwidth (what a part without measured kernel
        tables prices with, and what every part priced with before the device layer)."""
        return Kernels(mm_flops=self.matmul_flops, attn_flops=self.attn_flops,
                       hbm_bytes_per_s=self.hbm_bytes_per_s * HBM_EFFICIENCY, sms=self.cluster.device.sms,
                       dtype_bytes=DTYPE_BYTES.get(self.dtype, 2))

    def copy_time(self, nbytes: float) -> float:
        """Seconds of one streaming copy kernel moving ``nbytes`` (read and write) on one device."""
        return float(self.kernels.memory_bound(nbytes))

    def additive(self) -> Hardware:
        """A copy whose measured collectives take their best bandwidth and no latency: times proportional
        to the bytes, never above this one's, so the collectives of documents run alone add up to theirs
        packed together (:meth:`CommTable.envelope`; the cost model's lower envelope uses it)."""
        other = copy.copy(self)
        if self.comm is not None and self.comm.table is not None:
            other.comm = replace(self.comm, table=self.comm.table.envelope())
        return other

    def exposed(self, comm, window):
        """Seconds of a collective of ``comm`` s left exposed when it runs alongside ``window`` s of compute.

        ``overlap`` is the fraction of the overlapped time that is really saved: 1 where communication
        and compute run side by side unhindered, less where they share the device (the slowdown of the
        compute is charged here too), 0 where they serialise. Arrays accepted.

        >>> from flexmesh.spec import parse_cluster
        >>> hw = Hardware(parse_cluster("1x8xA100-80GB"))
        >>> round(float(hw.exposed(1.0, 4.0)), 2), round(float(hw.exposed(1.0, 0.25)), 4)
        (0.13, 0.7825)
        """
        return comm - self.overlap * np.minimum(comm, window)

    def engine_all_reduce(self, engine: str, graphed: bool, nbytes, shape: GroupShape):
        """Seconds of one all-reduce as ``engine`` runs it (``nbytes`` may be an array): its own kernels' time where
        the node's measured table timed them inside it (presets/collectives.toml's ``<engine>_graph``, replayed in a
        CUDA graph, or ``<engine>_eager``, called eagerly: the engine's dispatch, its kernel for small messages and
        NCCL for large ones), else NCCL's (:meth:`collective_time`): an ``engine`` of "nccl", a group across
        nodes, a part without the table. NCCL called eagerly (not ``graphed``) takes at least
        :meth:`eager_floor`."""
        table = self._node_table(shape)
        if engine != "nccl" and table is not None:
            for op in (f"{engine}_{'graph' if graphed else 'eager'}", f"{engine}_graph"):
                if table.covers(op):
                    return table.time(op, shape.size, nbytes)
        t = self.collective_time("all_reduce", nbytes, shape)
        floor = 0.0 if graphed else self.eager_floor(shape)
        return np.maximum(t, floor) if isinstance(t, np.ndarray) else max(t, floor)

    def eager_floor(self, shape: GroupShape) -> float:
        """The least an all-reduce called eagerly takes on this node, whatever its size: the host's work per call
        (launch, the ranks' launches meeting), which a CUDA graph's replay does not pay and nccl-tests' back-to-back
        kernels hide. Measured where the node's table timed an all-reduce called eagerly inside an engine
        (aiconfigurator-core's ``vllm_eager``, its smallest message: 45 us on an A100 node, 23 us on an H100 one;
        vLLM's own kernel, the nearest measurement of a call's host work); 0 elsewhere (no measurement: NCCL's
        kernel time alone). Vidur's eagerly called NCCL all-reduces on DGX A100 and H100 nodes measured 40-60 us
        at a decode's message (bench/tp_scaling.py)."""
        table = self._node_table(shape)
        if table is None or not table.covers(EAGER_FLOOR_OP):
            return 0.0
        return float(table.time(EAGER_FLOOR_OP, shape.size, 1.0))

    def _node_table(self, shape: GroupShape) -> CommTable | None:
        """The measured table that times a group of ``shape`` (inside one node, more than one GPU), if any."""
        comm = getattr(self, "comm", None)  # a profiled hardware has its own collectives, no tables
        if comm is None or comm.table is None or shape.nodes != 1 or shape.size <= 1:
            return None
        return comm.table

    def collective_time(self, kind: str, nbytes, shape: GroupShape):
        """Seconds for one collective; ``nbytes`` may be a numpy array.

        ``nbytes`` is the full buffer: the all-reduce buffer, the all-gather output, the reduce-scatter
        input, the all-to-all send buffer of one rank, the message of a send/recv.
        """
        n = shape.size
        if n <= 1:
            return np.zeros_like(nbytes, dtype=float) if isinstance(nbytes, np.ndarray) else 0.0
        c = self.comm
        k, m = shape.per_node, shape.nodes
        intra_bw = c.intra_bytes_per_s(k)
        nic_bw = c.inter_gbps_per_gpu * 1e9
        if kind == "send_recv":
            if m > 1:
                return nbytes / (nic_bw * c.ring_inter_eff) + c.inter_latency_s
            return nbytes / (intra_bw * c.ring_intra_eff) + c.intra_latency_s
        if kind == "all_to_all":
            # Each rank sends (n-1)/n of its buffer; (n-k)/n of it leaves the node through its own NIC.
            t_intra = nbytes * (k - 1) / n / (intra_bw * c.a2a_intra_eff)
            t_inter = nbytes * (n - k) / n / (nic_bw * c.a2a_inter_eff) if m > 1 else 0.0
            lat = c.intra_latency_s + (c.inter_latency_s if m > 1 else 0.0)
            return np.maximum(t_intra, t_inter) + lat if isinstance(nbytes, np.ndarray) else max(t_intra, t_inter) + lat
        factor = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0}.get(kind)
        if factor is None:
            raise ValueError(f"unknown collective {kind!r}; known: {COLLECTIVES}")
        # Hierarchical ring: inside the node over NVLink, across nodes through the k NICs of the group.
        t_inter = factor * (m - 1) / m * nbytes / (k * nic_bw * c.ring_inter_eff) if m > 1 else 0.0
        if c.table is not None and c.table.covers(kind):  # measured, latency included
            t_intra = c.table.time(kind, k, nbytes)
            lat = factor * (m - 1) * c.inter_latency_s
        else:  # NCCL's own model of its ring inside the node, latency included
            t_intra = nccl_ring_time(int(factor) * (k - 1), factor * (k - 1) / k * nbytes, intra_bw * c.ring_intra_eff,
                                     c.over_nvlink(k)) if k > 1 else 0.0
            lat = factor * (m - 1) * c.inter_latency_s
        if isinstance(nbytes, np.ndarray):
            return np.maximum(t_intra, t_inter) + lat
        return max(t_intra, t_inter) + lat


def device_kernels(kernels: Kernels, d: DeviceSpec, peak_flops: float) -> Kernels:
    """The device layer's kernels: ``kernels`` (the tile model) at the part's kernel rates in the measured
    tables' forms (devices.toml [gemm_kernels], [attention_kernels] and [decode_kernels] of its ``kernel_table``):
    each kernel as it measures, no framework term. A part without a kernel fit keeps ``kernels``. A training step
    prices the same forms at the framework's share of these rates (``Hardware.kernels``).

    >>> from flexmesh.spec import parse_cluster
    >>> hw = Hardware(parse_cluster("1x8xH100"))
    >>> step, dev = hw.kernels.gemm(8192, 8192, 8192), hw.device_kernels.gemm(8192, 8192, 8192)
    >>> round(step / dev, 2), round(1 / hw.cluster.device.framework_mm, 2)  # large GEMMs: 1 / the framework term
    (1.31, 1.31)
    """
    g, a = GEMM_KERNELS.get(d.gemm_table or d.kernel_table), ATTENTION_KERNELS.get(d.kernel_table)
    if g is None or a is None or d.kernel_mm_efficiency is None or d.kernel_attn_efficiency is None:
        return kernels
    # The cache term is the measured part's own L2 (its size and speed beside that part's DRAM): a part that takes
    # another's table (its peak or bandwidth not the table's) keeps none.
    own = own_tables(d)
    dec = DECODE_KERNELS.get(d.kernel_table)
    decode = None if dec is None else MeasuredDecode(
        fixed_s=dec["fixed_us"] * 1e-6, hbm_bytes_per_s=dec["hbm_fraction"] * d.hbm_gbps * 1e9,
        per_pair_s=dec["per_pair_ns"] * 1e-9, **_cache(dec, own))
    gemm = MeasuredGemm(fixed_s=g["fixed_us"] * 1e-6, power=g["power"], per_k_s=g["per_k_ns"] * 1e-9,
                        hbm_bytes_per_s=g["hbm_fraction"] * d.hbm_gbps * 1e9, weights=TABLE_WEIGHTS,
                        wave_tail=g["wave_tail"], **_cache(g, own or bool(d.gemm_table)))
    return replace(kernels, mm_flops=peak_flops * d.kernel_mm_efficiency,
                   attn_flops=peak_flops * d.kernel_attn_efficiency, attn_overhead=a["overhead_keys"],
                   gemm_measured=gemm, decode_measured=decode,
                   attn_measured=MeasuredAttention(fixed_s=a["fixed_us"] * 1e-6, per_key_s=a["per_key_ns"] * 1e-9))


def own_tables(d: DeviceSpec) -> bool:
    """Whether ``d``'s ``kernel_table`` timed ``d`` itself (the table's part has its peak and bandwidth)."""
    t = GEMM_TABLES.get(d.kernel_table)
    return t is not None and d.peak_tflops.get("bf16") == t.peak_tflops and d.hbm_gbps == t.hbm_gbps


def unmeasured(d: DeviceSpec) -> str | None:
    """Why ``d``'s kernels are priced from another part's measurements (its ``kernel_table`` timed another part,
    or none), or None where its own tables price them. A part with a GEMM table of its own (``gemm_table``) borrows
    only its attention."""
    t = GEMM_TABLES.get(d.kernel_table)
    if t is None or GEMM_KERNELS.get(d.kernel_table) is None:
        return f"{d.name}: no measured kernel table; its kernels are priced from fitted efficiencies of its datasheet"
    if own_tables(d):
        return None
    what, of = ("its attention", "no attention tables of its own") if d.gemm_table else ("priced", "no kernel tables")
    own = f" (its GEMMs from its own table, {d.gemm_table})" if d.gemm_table else ""
    if getattr(d, "architecture", t.architecture) != t.architecture:
        return (f"{d.name}: no {d.architecture} {'attention' if d.gemm_table else 'kernel'} tables; {what} from "
                f"{d.kernel_table}'s ({t.architecture}) scaled to its datasheet, another architecture's kernels{own}: "
                "its prices are the least certain")
    return (f"{d.name}: {of} of its own; {what} from {d.kernel_table}'s ({t.architecture}, the same architecture) "
            f"scaled to its datasheet{own}")


def unmeasured_notes(devices, replicas=(), all_reduce: str = "nccl") -> list[str]:  # noqa: ANN001 - DeviceSpecs
    """:func:`unmeasured`'s line for each distinct part of ``devices`` priced from another's measurements, then
    :func:`tensor_parallel_notes`' for the ``(device, tp)`` pairs of ``replicas`` (an engine's ``all_reduce``)."""
    out: list[str] = []
    for d in devices:
        note = unmeasured(d)
        if note is not None and note not in out:
            out.append(note)
    return out + tensor_parallel_notes(replicas, all_reduce)


def tensor_parallel_notes(replicas, all_reduce: str = "nccl") -> list[str]:  # noqa: ANN001 - (DeviceSpec, tp) pairs
    """What a tensor-parallel replica's all-reduces are priced from where no measurement of its node exists, one line
    per part among ``replicas`` (``(device, tp)`` pairs; tp 1 has none): a part whose node has no measured table
    (NCCL's tuning model over its datasheet links; an engine's own all-reduce, ``all_reduce`` other than "nccl", as
    NCCL's). Every measured node has each engine's timings too (presets/collectives.toml)."""
    out: list[str] = []
    for d, tp in replicas:
        if tp <= 1 or d.comm_table in COMM_TABLES:
            continue
        own = "" if all_reduce == "nccl" else f" ({all_reduce}'s own all-reduce, not timed there, as NCCL's)"
        note = (f"{d.name}: no measured NCCL table of its node; tp all-reduces priced by NCCL's tuning model over its "
                f"datasheet links ({d.intra_link}){own}")
        if note not in out:
            out.append(note)
    return out


def _cache(fit: dict[str, float], own: bool) -> dict[str, float]:
    """A kernel fit's cache constants (``flexmesh.cost.device.kernels.cached_memory``) on its own part; none on
    another."""
    if not own:
        return {}
    return {"cache_bytes": fit["cache_mb"] * 1e6, "cache_speedup": fit["cache_speedup"],
            "cache_steepness": fit["cache_steepness"]}


_TABLES: dict[str, CommTable] = {}


def _comm_table(name: str) -> CommTable | None:
    """The catalogue's measured table ``name`` (one instance per table: its memo is shared), None for ""."""
    if not name:
        return None
    if name not in _TABLES:
        _TABLES[name] = CommTable(COMM_TABLES[name])
    return _TABLES[name]
