"""ClusterSpec: nodes x devices per node of one device type, from a preset string or a file.

``8x8xA100-40GB`` is 8 nodes of 8 A100-40GB; ``8xH100`` is one node of 8; a path reads JSON or TOML.
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, asdict, dataclass, field, replace
from dataclasses import fields as fields_of
from pathlib import Path

from flexmesh.errors import SpecError
from flexmesh.inputs import load_config

# The device catalogue lives in flexmesh.spec.devices; its names are importable from here too.
from flexmesh.spec.devices import (  # noqa: F401
    ATTENTION_TABLES,
    DEVICE_PRESETS,
    GEMM_TABLES,
    INTRA_LINKS,
    DeviceSpec,
    KernelTable,
    catalogue_efficiency,
    device,
    preset_of_gpu,
)
from flexmesh.spec.limits import MAX_DEVICES, MAX_SPEED, MIN_FRACTION, within
from flexmesh.spec.values import known_keys, mapping, number, sequence, whole
from flexmesh.spec.values import text as nonempty_text


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
        within(self.world_size, MAX_DEVICES, f"cluster {self.nodes}x{self.devices_per_node}: devices")
        if not isinstance(self.device, DeviceSpec):
            raise SpecError(f"cluster device must be a device preset or table, got {self.device!r}")
        for i, factor in enumerate(self.speed_factors):
            number(factor, f"speed factor {i}", SpecError, MIN_FRACTION, strict=False, maximum=MAX_SPEED)
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
    def pace(self) -> float:
        """The speed one layout over all the devices runs at: its slowest device's. Every data rank waits
        for the others at each step's gradient sync (and tensor-parallel ranks at every layer), so the
        cost model prices such a layout with every device at this speed (compute stretched,
        communication not: :meth:`flexmesh.cost.CostModel.evaluate_stages`).

        >>> replace(parse_cluster("4xH100"), speed_factors=(1.0, 0.5, 1.0, 1.0)).pace, parse_cluster("4xH100").pace
        (0.5, 1.0)
        """
        return min(self.speed_factors, default=1.0)

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


@dataclass(frozen=True)
class Link:
    """The network between two device groups: bandwidth per node per direction (GB/s, as
    ``node_net_gbps``) and the latency of one message (us, the alpha of the alpha-beta model)."""

    gbps: float
    latency_us: float

    def __post_init__(self) -> None:
        number(self.gbps, "link gbps", SpecError)
        number(self.latency_us, "link latency_us", SpecError, strict=False)


@dataclass(frozen=True)
class NodeNetwork:
    """What a cluster file says of single nodes and of pairs of nodes (``nic_gbps``, ``node_links``). A
    :class:`MixedCluster`'s groups and group links carry the slowest of it (what a layout over all of a
    group's nodes, or over two whole groups, meets); this keeps the rest, so that a collective over some
    nodes is priced on those nodes' own network (:meth:`between`, :meth:`among`; flexmesh.cost.training.mixed).

    >>> net = NodeNetwork(base=(Link(50.0, 5.0),), nics=(50.0, 50.0, 12.5, 50.0),
    ...                   links=((0, 3, Link(1.0, 900.0)),))
    >>> net.between(0, {0, 1}), net.between(0, {0, 1, 2}), net.between(0, {0, 1, 3})
    (Link(gbps=50.0, latency_us=5.0), Link(gbps=12.5, latency_us=5.0), Link(gbps=1.0, latency_us=900.0))
    """

    base: tuple[Link, ...]  # per group: its inter-node network before these facts lowered it
    nics: tuple[float, ...]  # per global node: its NIC's GB/s (inf where the file gives none)
    links: tuple[tuple[int, int, Link], ...] = ()  # pairs of global nodes, as given
    group_links: tuple[tuple[int, int, Link], ...] = ()  # pairs of groups, before node links lowered them

    def among(self, nodes: frozenset[int] | set[int]) -> list[Link]:
        """The given links between two of ``nodes`` (global indices)."""
        return [link for i, j, link in self.links if i in nodes and j in nodes]

    def between(self, group: int, nodes: frozenset[int] | set[int]) -> Link:
        """The network ``nodes`` (global indices, all of ``group``) reach each other and other groups by:
        the group's, bounded by each of those nodes' NIC and by every given link between two of them."""
        base, inside = self.base[group], self.among(nodes)
        return Link(min([base.gbps, *(self.nics[n] for n in nodes), *(x.gbps for x in inside)]),
                    max([base.latency_us, *(x.latency_us for x in inside)]))


@dataclass(frozen=True)
class MixedCluster:
    """Device groups, each a :class:`ClusterSpec` of one device type, and the links between them.

    Global ranks are numbered group by group, node by node (group 0's node 0 first). ``links`` holds
    one ``(i, j, Link)`` per pair of groups ``i < j``; pairs not given default to the inter-node network
    of the slower group (the smaller ``node_net_gbps`` and the larger ``inter_latency_us``: traffic
    between the groups crosses both groups' NICs, the slower of which bounds it).

    >>> c = MixedCluster((parse_cluster("8xH100"), parse_cluster("2x8xA100-40GB")))
    >>> c.group_start(1), c.node_of(8), c.node_of(23), c.nodes, c.speed(3)
    (8, 1, 2, 3, 1.0)
    """

    groups: tuple[ClusterSpec, ...]
    links: tuple[tuple[int, int, Link], ...] = ()
    node_network: NodeNetwork | None = None  # a cluster file's per-node facts, where it gives any

    def __post_init__(self) -> None:
        if not isinstance(self.groups, tuple) or not self.groups:
            raise SpecError("a mixed cluster needs at least one device group")
        for g in self.groups:
            if not isinstance(g, ClusterSpec):
                raise SpecError(f"a mixed cluster's groups must be clusters of one device type, got {g!r}")
        within(sum(g.world_size for g in self.groups), MAX_DEVICES, "mixed cluster: devices")
        given: dict[tuple[int, int], Link] = {}
        for i, j, link in self.links:
            a, b = min(i, j), max(i, j)
            if a == b or a < 0 or b >= len(self.groups):
                raise SpecError(f"link {i}-{j} does not join two of the {len(self.groups)} groups "
                                f"(0..{len(self.groups) - 1})")
            if (a, b) in given:
                raise SpecError(f"link {a}-{b} is given twice")
            given[(a, b)] = link
        full = []
        for a in range(len(self.groups)):
            for b in range(a + 1, len(self.groups)):
                da, db = self.groups[a].device, self.groups[b].device
                full.append((a, b, given.get((a, b)) or Link(min(da.node_net_gbps, db.node_net_gbps),
                                                              max(da.inter_latency_us, db.inter_latency_us))))
        object.__setattr__(self, "links", tuple(full))
        net = self.node_network
        if net is not None and (len(net.base) != len(self.groups) or len(net.nics) != self.nodes):
            raise SpecError(f"node network of {len(net.base)} groups and {len(net.nics)} nodes given for a cluster "
                            f"of {len(self.groups)} groups and {self.nodes} nodes")

    @property
    def world_size(self) -> int:
        return sum(g.world_size for g in self.groups)

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @property
    def label(self) -> str:
        """The groups' labels joined by ``+`` (parses back to the same groups, speed factors aside)."""
        return "+".join(g.label for g in self.groups)

    def group_start(self, group: int) -> int:
        """Global rank of the group's first device."""
        return sum(g.world_size for g in self.groups[:group])

    def ranks(self, group: int) -> range:
        start = self.group_start(group)
        return range(start, start + self.groups[group].world_size)

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise SpecError(f"device {rank!r} is not in {self.label} (ranks 0..{self.world_size - 1})")

    def group_of(self, rank: int) -> int:
        self._check_rank(rank)
        for i, g in enumerate(self.groups):
            if rank < g.world_size:
                return i
            rank -= g.world_size
        raise AssertionError  # unreachable: the rank was checked

    def local_rank(self, rank: int) -> int:
        """The rank's index inside its group."""
        return rank - self.group_start(self.group_of(rank))

    def device_of(self, rank: int) -> DeviceSpec:
        return self.groups[self.group_of(rank)].device

    def speed(self, rank: int) -> float:
        return self.groups[self.group_of(rank)].speed(self.local_rank(rank))

    def node_of(self, rank: int) -> int:
        """Global node index of a rank (nodes numbered group by group)."""
        g = self.group_of(rank)
        return sum(x.nodes for x in self.groups[:g]) + self.local_rank(rank) // self.groups[g].devices_per_node

    def link(self, i: int, j: int) -> Link:
        """The link between groups ``i`` and ``j`` (``i != j``)."""
        a, b = min(i, j), max(i, j)
        for x, y, link in self.links:
            if (x, y) == (a, b):
                return link
        raise SpecError(f"no link {i}-{j}: the cluster has groups 0..{len(self.groups) - 1}")

    @property
    def uniform(self) -> bool:
        """One group whose devices all run at one speed: today's uniform planner answers it."""
        return len(self.groups) == 1 and len(set(self.groups[0].speed_factors)) <= 1

    def with_speeds(self, factors: tuple[float, ...]) -> MixedCluster:
        """The cluster with one speed factor per device (global ranks), in place of its groups' own.

        >>> c = parse_mixed_cluster("2xH100+2xA100-40GB").with_speeds((1.0, 1.0, 0.5, 1.0))
        >>> c.speed(2), c.groups[0].speed_factors, c.uniform
        (0.5, (1.0, 1.0), False)
        """
        if len(factors) != self.world_size:
            raise SpecError(f"{len(factors)} speed factors given for the {self.world_size} devices of {self.label}")
        groups = tuple(replace(g, speed_factors=tuple(factors[r] for r in self.ranks(i)))
                       for i, g in enumerate(self.groups))
        return replace(self, groups=groups)

    def to_dict(self) -> dict:
        return {"groups": [g.to_dict() for g in self.groups],
                "links": {f"{a}-{b}": {"gbps": link.gbps, "latency_us": link.latency_us} for a, b, link in self.links}}


_CLUSTER_RE = re.compile(r"^(?:(\d+)x)?(\d+)x([A-Za-z][A-Za-z0-9\-]*)$", re.IGNORECASE)

_CLUSTER_KEYS = ("nodes", "devices_per_node", "device", "speed_factors", "nic_gbps")
_DEVICE_KEYS = ("base", *DeviceSpec.__dataclass_fields__)
# Fields of a node's links: a device table that changes one prices collectives from them, not from its
# base's measured table.
_INTRA_FIELDS = {"nvlink_gbps", "intra_efficiency", "intra_latency_us", "intra_link", "nvlink_domain", "pcie_gbps",
                 "pcie_efficiency"}


def _lowered(group: ClusterSpec, gbps: float, latency_us: float = 0.0) -> ClusterSpec:
    """``group`` with its inter-node network no faster than ``gbps`` and no quicker than ``latency_us``."""
    d = group.device
    if gbps >= d.node_net_gbps and latency_us <= d.inter_latency_us:
        return group
    return replace(group, device=replace(d, node_net_gbps=min(gbps, d.node_net_gbps),
                                         inter_latency_us=max(latency_us, d.inter_latency_us)))


def _group_from_mapping(d: dict, where: str) -> tuple[ClusterSpec, tuple[float, ...]]:
    """One group's table as given (its device's own inter-node network) and each node's NIC (GB/s; inf
    where ``nic_gbps`` gives none)."""
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
        if base is not None and base.comm_table and "comm_table" not in fields and _INTRA_FIELDS & set(fields):
            fields["comm_table"] = ""  # the measured node is not this one: price it from the fields given
        try:
            dev = replace(base, **fields) if base is not None else DeviceSpec(**fields)
        except TypeError:
            needed = [f.name for f in fields_of(DeviceSpec) if f.default is MISSING and f.default_factory is MISSING]
            lacking = [k for k in needed if k not in dev]
            raise SpecError(f"{where}: a device table without base needs every field of a device ({len(lacking)} "
                            f"missing: {', '.join(lacking[:4])}{', ...' if len(lacking) > 4 else ''}); give base = "
                            "\"A100-80GB\" (a preset) and override fields") from None
        except SpecError as e:
            raise SpecError(f"{where}: {e}") from None
    else:
        raise SpecError(f"{where}: device must be a preset name or a table")
    factors = sequence(d.get("speed_factors", []), f"{where}: speed_factors", SpecError)
    nodes = whole(d["nodes"], f"{where}: nodes", SpecError)
    per_node = whole(d["devices_per_node"], f"{where}: devices_per_node", SpecError)
    nics = (math.inf,) * nodes
    if "nic_gbps" in d:  # one NIC bandwidth per node
        given = sequence(d["nic_gbps"], f"{where}: nic_gbps", SpecError)
        if len(given) != nodes:
            raise SpecError(f"{where}: nic_gbps has {len(given)} entries for {nodes} nodes; give one per node")
        nics = tuple(number(x, f"{where}: nic_gbps[{i}]", SpecError) for i, x in enumerate(given))
    try:
        return ClusterSpec(nodes=nodes, devices_per_node=per_node, device=dev, speed_factors=tuple(factors)), nics
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None


_MIXED_KEYS = ("groups", "links", "node_links")
_LINK_KEYS = ("gbps", "latency_us")


def _link(d: object, default: Link | None, where: str) -> Link:
    mapping(d, where, SpecError)
    assert isinstance(d, dict)
    known_keys(d, _LINK_KEYS, where, SpecError)
    if default is None and ("gbps" not in d or "latency_us" not in d):
        raise SpecError(f"{where} needs gbps and latency_us")
    gbps = number(d.get("gbps", default.gbps if default else 0.0), f"{where}: gbps", SpecError)
    lat = number(d.get("latency_us", default.latency_us if default else 0.0), f"{where}: latency_us", SpecError,
                 strict=False)
    return Link(gbps, lat)


def _mixed_from_mapping(d: object, where: str) -> MixedCluster:
    """A cluster file: ``groups`` (a list of one-group tables) and ``links``, or the one-group form."""
    mapping(d, f"{where}: a cluster file", SpecError)
    assert isinstance(d, dict)
    if "groups" not in d:
        if "links" in d:
            raise SpecError(f"{where}: a cluster file with links needs groups ([[groups]] tables)")
        one = {k: v for k, v in d.items() if k != "node_links"}
        group, nics = _group_from_mapping(one, where)
        return _with_node_links(MixedCluster((group,)), d.get("node_links", {}), where, nics)
    known_keys(d, _MIXED_KEYS, f"{where}: mixed cluster file", SpecError)
    tables = sequence(d["groups"], f"{where}: groups", SpecError)
    if not tables:
        raise SpecError(f"{where}: groups is empty; give one [[groups]] table per device group")
    given = [_group_from_mapping(t, f"{where}: group {i}") for i, t in enumerate(tables)]
    groups = tuple(g for g, _ in given)
    raw = mapping(d.get("links", {}), f"{where}: links", SpecError)
    default = None
    if "gbps" in raw or "latency_us" in raw:
        default = _link({k: raw[k] for k in _LINK_KEYS if k in raw}, None, f"{where}: links")
    links = []
    for key, value in raw.items():
        if key in _LINK_KEYS:
            continue
        pair = re.fullmatch(r"(\d{1,6})-(\d{1,6})", str(key))
        if pair is None:
            raise SpecError(f"{where}: links key {key!r} is not gbps, latency_us or a pair of groups like \"0-1\"")
        i, j = int(pair.group(1)), int(pair.group(2))
        links.append((i, j, _link(value, default, f"{where}: link {key}")))
    if default is not None:
        named = {(min(i, j), max(i, j)) for i, j, _ in links}
        links += [(a, b, default) for a in range(len(groups)) for b in range(a + 1, len(groups)) if (a, b) not in named]
    try:
        cluster = MixedCluster(groups, tuple(links))
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None
    return _with_node_links(cluster, d.get("node_links", {}), where, tuple(n for _, nics in given for n in nics))


def _with_node_links(cluster: MixedCluster, raw: object, where: str, nics: tuple[float, ...]) -> MixedCluster:
    """``cluster`` (its groups' networks as given) with a file's per-node facts: ``nics`` (GB/s per
    global node) and ``node_links``, ``"i-j"`` tables (global node indices, numbered group by group as
    ranks are) of ``gbps`` and ``latency_us``. A slow NIC or a link inside a group lowers that group's
    inter-node network (the smaller ``node_net_gbps``, the larger ``inter_latency_us``: what a layout
    over all its nodes meets), a link between two groups their group link the same way. The NICs and
    the links are kept beside (:class:`NodeNetwork`) where any NIC is slower than its group or a link
    is given."""
    raw = mapping(raw, f"{where}: node_links", SpecError)
    base = tuple(Link(g.device.node_net_gbps, g.device.inter_latency_us) for g in cluster.groups)
    starts = [sum(g.nodes for g in cluster.groups[:k]) for k in range(len(cluster.groups))]

    def group_of_node(n: int) -> int:
        return max(k for k, s0 in enumerate(starts) if s0 <= n)

    slow_nic = any(nic < base[group_of_node(n)].gbps for n, nic in enumerate(nics))
    groups = [_lowered(g, min(nics[s0:s0 + g.nodes])) for g, s0 in zip(cluster.groups, starts)]
    links = {(a, b): link for a, b, link in cluster.links}
    seen, given = set(), []
    for key, value in raw.items():
        pair = re.fullmatch(r"(\d{1,6})-(\d{1,6})", str(key))
        if pair is None:
            raise SpecError(f"{where}: node_links key {key!r} is not a pair of nodes like \"0-3\"")
        i, j = sorted((int(pair.group(1)), int(pair.group(2))))
        if i == j or j >= cluster.nodes:
            raise SpecError(f"{where}: node link {key} does not join two of the {cluster.nodes} nodes "
                            f"(0..{cluster.nodes - 1}, numbered group by group)")
        if (i, j) in seen:
            raise SpecError(f"{where}: node link {i}-{j} is given twice")
        seen.add((i, j))
        link = _link(value, None, f"{where}: node link {key}")
        gi, gj = group_of_node(i), group_of_node(j)
        given.append((i, j, link))
        if gi == gj:
            groups[gi] = _lowered(groups[gi], link.gbps, link.latency_us)
        else:
            old = links[(gi, gj)]
            links[(gi, gj)] = Link(min(old.gbps, link.gbps), max(old.latency_us, link.latency_us))
    net = NodeNetwork(base, nics, tuple(given), cluster.links) if slow_nic or given else None
    return MixedCluster(tuple(groups), tuple((a, b, link) for (a, b), link in links.items()), net)


_MIXED_WHERE = ("mixed clusters (groups joined by '+', or a file with [[groups]]) are accepted by "
                "`flexmesh plan` (search and --check); give one device type here")


def parse_cluster(text: str) -> ClusterSpec:
    """``NODESxPERNODExDEVICE``, ``PERNODExDEVICE`` (one node), or a JSON/TOML file path.

    One device type only: a mixed cluster (:func:`parse_mixed_cluster`) is a one-line SpecError here.
    """
    mixed = parse_mixed_cluster(text)
    if len(mixed.groups) != 1:
        raise SpecError(f"cluster {mixed.label!r} has {len(mixed.groups)} device groups; {_MIXED_WHERE}")
    return mixed.groups[0]


def mixed_cluster_from_mapping(d: object, where: str) -> MixedCluster:
    """A mixed cluster from a cluster file's contents as a mapping (``where`` names it in errors)."""
    return _mixed_from_mapping(d, where)


def _read_cluster_file(p: Path) -> object:
    if p.suffix and p.suffix.lower() not in (".json", ".toml"):
        raise SpecError(f"cluster file {p}: give a .json or .toml file (it is read by its extension)")
    return load_config(p, SpecError, invalid="cannot parse cluster file")


def _one_group(text: str) -> ClusterSpec | None:
    m = _CLUSTER_RE.match(text)
    if not m:
        return None
    nodes, per, dev = m.groups()
    return ClusterSpec(nodes=whole(int(nodes or 1), f"cluster {text!r}: nodes", SpecError),
                       devices_per_node=whole(int(per), f"cluster {text!r}: devices per node", SpecError),
                       device=device(dev))


def parse_mixed_cluster(text: str) -> MixedCluster:
    """Any cluster string as a :class:`MixedCluster`: groups joined by ``+`` (``1x8xH100+2x8xA100-40GB``),
    one group (``8xH100``, a single-group :class:`MixedCluster`), or a JSON/TOML file (``[[groups]]`` and
    ``links``, or the one-group form of :func:`parse_cluster`).

    >>> c = parse_mixed_cluster("1x8xH100+2x8xA100-40GB")
    >>> c.world_size, c.label, c.group_of(8), c.device_of(8).name, c.link(0, 1).gbps
    (24, '8xH100-80GB+2x8xA100-40GB', 1, 'A100-40GB', 200.0)
    """
    if not isinstance(text, str) or not text.strip():
        raise SpecError("the cluster is empty; write NODESxPERNODExDEVICE (e.g. 8x8xA100-40GB), PERNODExDEVICE "
                        "(8xH100), groups joined by '+' (1x8xH100+2x8xA100-40GB) or the path of a JSON/TOML "
                        "cluster file")
    one = _one_group(text)
    if one is not None:
        return MixedCluster((one,))
    p = Path(text)
    if p.exists():
        return _mixed_from_mapping(_read_cluster_file(p), str(p))
    if p.suffix.lower() in (".json", ".toml"):
        raise SpecError(f"cluster file {text!r}: no such file")
    if "+" in text:
        groups = []
        for i, part in enumerate(text.split("+")):
            g = _one_group(part.strip())
            if g is None:
                raise SpecError(f"cluster {text!r}: group {i} {part.strip()!r} is not NODESxPERNODExDEVICE or "
                                f"PERNODExDEVICE (e.g. 1x8xH100+2x8xA100-40GB); devices: {', '.join(DEVICE_PRESETS)}")
            groups.append(g)
        return MixedCluster(tuple(groups))
    raise SpecError(
        f"unknown cluster {text!r}: write NODESxPERNODExDEVICE (e.g. 8x8xA100-40GB), PERNODExDEVICE (8xH100), "
        f"groups joined by '+' or a JSON/TOML file; devices: {', '.join(DEVICE_PRESETS)}"
    )
