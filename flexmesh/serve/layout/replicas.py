"""Replicas on a cluster, each with its devices, tp x pp and role.

Replicas are written ``[COUNTx]tpT[ppP][-ROLE][@GROUP]``, comma-separated: ``4xtp2`` is four aggregated
replicas of 2 devices each, ``2xtp4-prefill@H100,4xtp2-decode@A100-40GB`` splits prefill and decode over two
device types. ``ROLE`` is ``aggregated`` (the default; ``agg``), ``prefill`` or ``decode``; ``GROUP`` a device
group of the cluster by index or device name (default: the first group with devices left). Each group's
devices are handed out in order, a replica's ``tp x pp`` devices consecutive (tp innermost, as the rank
order lays them), so a replica spans nodes only when it is wider than a node.

>>> from flexmesh.spec.cluster import parse_mixed_cluster
>>> c = parse_mixed_cluster("1x8xH100+2x8xA100-40GB")
>>> reps = place(parse_replicas("2xtp4-prefill@H100,4xtp4-decode@1", c), c)
>>> [(r.index, r.spec.label, r.device.name, r.first_rank, sorted(r.nodes)) for r in reps[1:3]]
[(1, 'tp4-prefill', 'H100-80GB', 4, [0]), (2, 'tp4-decode', 'A100-40GB', 8, [1])]
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from flexmesh.cost.inference.memory import check_tp, kv_capacity, kv_groups
from flexmesh.cost.inference.transfer import Span
from flexmesh.errors import FlexmeshError, SpecError
from flexmesh.serve.layout.knobs import EngineKnobs
from flexmesh.serve.layout.roles import Role
from flexmesh.spec.cluster import MixedCluster
from flexmesh.spec.devices import DeviceSpec, device
from flexmesh.spec.model import ModelSpec

_ENTRY = re.compile(r"^(?:(\d+)x)?tp(\d+)(?:pp(\d+))?(?:-([a-z]+))?(?:@(.+))?$")


@dataclass(frozen=True)
class ReplicaSpec:
    group: int  # the cluster's device group
    tp: int = 1
    pp: int = 1
    role: Role = Role.AGGREGATED
    tier: int = 0  # the model it serves, of a fleet's models (several models, or a cascade's stages)

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # a role's name given is the role

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    @property
    def label(self) -> str:
        pp = f"pp{self.pp}" if self.pp > 1 else ""
        role = "" if self.role is Role.AGGREGATED else f"-{self.role}"
        return f"tp{self.tp}{pp}{role}"


@dataclass(frozen=True)
class PlacedReplica:
    index: int
    spec: ReplicaSpec
    device: DeviceSpec
    first_rank: int  # global rank of its first device
    nodes: frozenset[int]  # global indices of the nodes its devices are on

    @property
    def span(self) -> Span:
        return Span(self.spec.group, self.nodes, self.spec.devices)


def _group(text: str, cluster: MixedCluster, entry: str) -> int:
    if text.isdigit():
        g = int(text)
        if g >= len(cluster.groups):
            raise SpecError(f"replicas {entry!r}: group {g} is not one of the cluster's {len(cluster.groups)} "
                            f"(0..{len(cluster.groups) - 1})")
        return g
    name = device(text).name
    for g, spec in enumerate(cluster.groups):
        if spec.device.name == name:
            return g
    raise SpecError(f"replicas {entry!r}: the cluster {cluster.label} has no {name} group")


def parse_replicas(text: str, cluster: MixedCluster) -> tuple[ReplicaSpec, ...]:
    """Replica specs from ``[COUNTx]tpT[ppP][-ROLE][@GROUP],...`` (groups left out are assigned by
    :func:`place`: -1 here)."""
    out: list[ReplicaSpec] = []
    for entry in filter(None, (p.strip() for p in text.split(","))):
        m = _ENTRY.match(entry)
        if m is None:
            raise SpecError(f"replicas {entry!r} is not [COUNTx]tpT[ppP][-ROLE][@GROUP]; e.g. 4xtp2, "
                            "2xtp4-prefill@H100, tp8pp2-decode@1")
        count, tp, pp, word, group = m.groups()
        try:
            role = Role.parse(word or "agg")
        except SpecError as e:
            raise SpecError(f"replicas {entry!r}: {e}") from None
        n = int(count) if count else 1
        if n < 1 or int(tp) < 1 or int(pp or 1) < 1:
            raise SpecError(f"replicas {entry!r}: counts and degrees are >= 1")
        g = _group(group, cluster, entry) if group else -1
        out += [ReplicaSpec(g, int(tp), int(pp or 1), role)] * n
    if not out:
        raise SpecError("no replicas given; write e.g. 4xtp2 or 2xtp4-prefill,2xtp4-decode")
    return tuple(out)


def place(specs: tuple[ReplicaSpec, ...], cluster: MixedCluster) -> tuple[PlacedReplica, ...]:
    """Each replica on the next free devices of its group (or of the first group with room)."""
    used = [0] * len(cluster.groups)
    placed = []
    for i, s in enumerate(specs):
        g = s.group
        if g < 0:
            g = next((k for k, c in enumerate(cluster.groups) if c.world_size - used[k] >= s.devices), -1)
            if g < 0:
                raise SpecError(f"replica {i} ({s.label}) needs {s.devices} devices; no group of {cluster.label} has "
                                "that many left; give fewer or smaller replicas")
            s = replace(s, group=g)
        group = cluster.groups[g]
        if used[g] + s.devices > group.world_size:
            raise SpecError(f"the replicas need more than the {group.world_size} {group.device.name} devices of group "
                            f"{g} ({group.label}); give fewer or smaller replicas there")
        start = cluster.group_start(g) + used[g]
        nodes = frozenset(cluster.node_of(r) for r in range(start, start + s.devices))
        placed.append(PlacedReplica(i, s, group.device, start, nodes))
        used[g] += s.devices
    for tier in sorted({p.spec.tier for p in placed}):
        roles = {p.spec.role for p in placed if p.spec.tier == tier}
        if (Role.PREFILL in roles) != (Role.DECODE in roles):
            have, lack = (Role.PREFILL, Role.DECODE) if Role.PREFILL in roles else (Role.DECODE, Role.PREFILL)
            whose = f" of model {tier}" if tier else ""
            raise SpecError(f"{have} replicas{whose} need {lack} replicas to hand requests to or from; add some, or "
                            "make them aggregated")
    return tuple(placed)


def auto_replicas(model: ModelSpec, cluster: MixedCluster, knobs: dict[int, EngineKnobs],
                  longest_tokens: int) -> tuple[ReplicaSpec, ...]:
    """Aggregated replicas filling every group, each of the smallest tp (1, 2, 4, ... up to a node) at which a
    replica's KV cache holds the longest request (``longest_tokens``); a group where none does gets none."""
    out: list[ReplicaSpec] = []
    reasons = []
    for g, group in enumerate(cluster.groups):
        tp = 1
        while tp <= group.devices_per_node:
            try:
                check_tp(model, tp)
                k = knobs[g]
                cap = kv_capacity(model, group.device, tp, 1, k.max_batched_tokens, k.max_seqs, k.block_tokens,
                                  k.memory_fraction)
                if kv_groups(model).fits(longest_tokens, cap):  # sliding layers hold their window
                    out += [ReplicaSpec(g, tp)] * (group.world_size // tp)
                    break
                reasons.append(f"{group.device.name} tp {tp} holds {cap.tokens:,} KV tokens")
            except FlexmeshError as e:
                reasons.append(str(e))
            tp *= 2
    if not out:
        raise SpecError(f"no replica of {model.name} on {cluster.label} holds a request of {longest_tokens:,} tokens "
                        f"({reasons[-1] if reasons else 'no devices'}); give --replicas with a larger tp or pp")
    return tuple(out)
