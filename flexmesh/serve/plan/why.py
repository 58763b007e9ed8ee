"""Why a plan mixes the device types it does, in a line per type: what ``serve plan`` says without ``--explain``.

For each device type the plan uses, the buckets it takes the most of (new requests: aggregated and prefill
groups) and what serving them costs there against the other types: one replica's $/h over its capacity within the
SLO (:mod:`.capacity`), the cheapest aggregated configuration of each type, weighted by the buckets' shares. A
type none of whose replicas meets the SLO on those buckets is named so; a cheaper type the plan uses less is
marked when all its devices are taken. The MILP's choice rests on more (budgets, links, availability): this is
the first reason, the one a person asks for.
"""

from __future__ import annotations

import math

from flexmesh.serve.layout.plan import ServingPlan
from flexmesh.serve.layout.roles import Role
from flexmesh.serve.plan.planner import Planner


def _cost_per_rate(planner: Planner, device: str, b: int) -> float:
    """The least $/h per req/s of bucket ``b`` over the aggregated configurations (model 0) on ``device``."""
    best = math.inf
    for k, c in enumerate(planner.configs):
        if c.model or c.role != Role.AGGREGATED or planner.cluster.groups[c.group].device.name != device:
            continue
        rate = planner.capacity[k, b]
        if rate > 0:
            best = min(best, planner.price[c.group] * c.devices / rate)
    return best


def _mean_cost(planner: Planner, device: str, mine: list[int], shares: list[float]) -> float:
    """:func:`_cost_per_rate` over buckets ``mine``, weighted by their shares (inf where one has no replica)."""
    each = [_cost_per_rate(planner, device, b) for b in mine]
    if any(math.isinf(x) for x in each):
        return math.inf
    return sum(x * shares[b] for x, b in zip(each, mine)) / sum(shares[b] for b in mine)


def why_mix(planner: Planner, plan: ServingPlan) -> list[str]:
    """One line per device type ``plan`` sends new requests to (see the module doc)."""
    buckets = plan.buckets.buckets
    share: dict[str, list[float]] = {}  # device -> share of each bucket's new requests it takes
    used: dict[str, int] = {}
    for g in plan.groups:
        used[g.device] = used.get(g.device, 0) + g.devices
        if g.model or g.role == Role.DECODE:
            continue
        row = share.setdefault(g.device, [0.0] * len(buckets))
        for b, s in enumerate(g.entry):
            row[b] += s
    have: dict[str, int] = {}
    for grp in planner.cluster.groups:
        have[grp.device.name] = have.get(grp.device.name, 0) + grp.world_size
    devices = sorted(have)
    if len(devices) < 2:  # one type: no mix to explain
        return []
    lines = []
    for dev, row in share.items():
        mine = [b for b in range(len(buckets)) if buckets[b].share > 0 and row[b] > 0
                and row[b] >= max(share[d][b] for d in share) - 1e-9]
        if not mine:
            continue
        weight = sum(buckets[b].share for b in mine)
        shares = [b.share for b in buckets]
        own = _mean_cost(planner, dev, mine, shares)
        others = []
        for d in devices:
            if d == dev:
                continue
            c = _mean_cost(planner, d, mine, shares)
            full = " (all taken)" if used.get(d, 0) >= have[d] and c < own else ""
            others.append(f"{d} {'none within the SLO' if math.isinf(c) else f'${c:.3g}'}{full}")
        price = "its aggregated replicas miss the SLO there" if math.isinf(own) else f"${own:.3g} per req/s there"
        lines.append(f"{dev} takes {', '.join(buckets[b].label for b in mine)} ({weight:.0%} of requests): {price}"
                     + (f"; {', '.join(others)}" if others else ""))
    return lines
