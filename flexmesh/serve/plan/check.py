"""A serving plan checked against its models and cluster (``flexmesh serve plan --check``): what its file format
cannot tell alone (devices, degrees, memory, the longest request each group is routed).

>>> import json
>>> from flexmesh.serve.layout import plan as layout
>>> example = layout.__doc__.split(".. code-block:: json")[1].split(">>>")[0]
>>> check_plan(layout.ServingPlan.from_dict(json.loads(example)))
[]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from flexmesh.cost.inference.memory import check_tp, kv_capacity, kv_groups
from flexmesh.errors import FlexmeshError, PlanError
from flexmesh.serve.layout.plan import ServingPlan
from flexmesh.serve.layout.roles import Role
from flexmesh.spec.model import ModelSpec, parse_model


def check_plan(plan: ServingPlan) -> list[str]:
    """Check ``plan`` against its models and cluster (PlanError in one line): devices, degrees, memory, the
    longest request each group is routed; the notes worth saying (a group routed nothing)."""
    models = _models(plan.models)
    try:
        cluster = plan.mixed_cluster()
    except FlexmeshError as e:
        raise PlanError(f"plan: cluster {plan.cluster!r}: {e}") from None
    used = [0] * len(cluster.groups)
    notes = []
    for i, g in enumerate(plan.groups):
        where = f"plan: groups[{i}] ({g.label})"
        if g.group >= len(cluster.groups):
            raise PlanError(f"{where}: device group {g.group} is not one of the cluster's {len(cluster.groups)} "
                            f"({cluster.label})")
        dev = cluster.groups[g.group].device
        if dev.name != g.device:
            raise PlanError(f"{where}: device group {g.group} of {cluster.label} holds {dev.name}, not "
                            f"{g.device}")
        m = models[g.model]
        try:
            check_tp(m, g.tp, g.pp)
            cap = kv_capacity(m, dev, g.tp, g.pp, g.knobs.max_batched_tokens, g.knobs.max_seqs,
                              g.knobs.block_tokens, g.knobs.memory_fraction)
        except FlexmeshError as e:
            raise PlanError(f"{where}: {e}") from None
        node = cluster.groups[g.group].devices_per_node
        if g.tp > node:
            raise PlanError(f"{where}: tp {g.tp} is wider than a node of {node} devices; lower tp (raise pp)")
        used[g.group] += g.devices
        if g.knobs.kv_blocks is not None:
            cap = replace(cap, blocks_given=g.knobs.kv_blocks)
        shares = g.decode if g.role is Role.DECODE else g.entry
        routed = [b for b, s in enumerate(shares) if s > 0 and plan.buckets.buckets[b].share > 0]
        for b in routed:
            longest = plan.buckets.buckets[b].longest
            if not kv_groups(m).fits(longest, cap):  # sliding layers hold their window
                raise PlanError(f"{where}: its KV cache holds {cap.tokens:,} tokens, fewer than bucket "
                                f"{b}'s longest request ({longest:,}); route that bucket elsewhere or raise tp")
        if not routed:
            notes.append(f"group {i} ({g.label}) is routed no requests")
    for gi, n in enumerate(used):
        have = cluster.groups[gi].world_size
        if n > have:
            raise PlanError(f"plan: the groups on device group {gi} use {n} {cluster.groups[gi].device.name} "
                            f"devices; it has {have}")
    missing = sorted(d for d in plan.devices if d not in plan.prices)
    if missing:
        notes.append(f"no price for {', '.join(missing)}")
    return notes


def _models(names: Sequence[str]) -> tuple[ModelSpec, ...]:
    out = []
    for i, n in enumerate(names):
        try:
            out.append(parse_model(n))
        except FlexmeshError as e:
            raise PlanError(f"plan: models[{i}]: {e}") from None
    return tuple(out)
