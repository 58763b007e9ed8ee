"""One dispatch: items (sequences, requests) over groups (replica groups, replicas) by what each costs where.

The same greedy serves every mix of layouts: each step's sequences over a plan's replica groups
(Hydraulis, 2412.07894: flexmesh.schedule.groups), over the replicas of a LoRA mix (LobRA, 2509.01193:
flexmesh.search.replicas), and a serving router's requests over its replicas.

In: ``costs[g, i]``, the seconds item ``i`` adds to group ``g``'s finish (``inf`` where it cannot run
there), and optionally ``capacities[g]`` with ``sizes[i]``: item ``i`` runs on group ``g`` only where
``sizes[i] <= capacities[g]`` (the group's memory holds it). Out: the group of every item.

Items are placed costliest first (the largest finite cost; stable), or in a given ``order``, each on
the group whose finish grows least: its accumulated cost plus, for a pipelined group, its fill
``fill[g]`` times the longest item it holds alone (``alone[g, i]``: a pipeline of ``pp`` stages waits
``pp - 1`` of its longest micro-batch). With ``keep_every``, every group keeps at least one item while
there are as many items as groups (a runtime steps every group): the cheapest move from the fullest
group. Written here because no library solves this online greedy (an LP relaxation bounds it:
flexmesh.schedule.groups.groups_lower_bound).

>>> import numpy as np
>>> costs = np.array([[4.0, 2.0, 1.0, 1.0], [8.0, 4.0, 2.0, 2.0]])  # group 1 runs at half speed
>>> dispatch(costs).tolist()
[0, 1, 0, 0]
>>> dispatch(costs, sizes=[9, 2, 1, 1], capacities=[8, 16]).tolist()  # item 0 fits group 1 alone
[1, 0, 0, 0]
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from flexmesh.errors import ScheduleError


def dispatch(costs: ArrayLike, sizes: ArrayLike | None = None, capacities: ArrayLike | None = None, *,
             order: ArrayLike | None = None, fill: ArrayLike | None = None, alone: ArrayLike | None = None,
             keep_every: bool = False) -> np.ndarray:
    """The group of every item (see the module doc); ScheduleError where an item fits no group."""
    cost = np.array(costs, dtype=float, ndmin=2)
    k, n = cost.shape
    if sizes is not None and capacities is not None:
        over = np.asarray(sizes)[None, :] > np.asarray(capacities)[:, None]
        cost = np.where(over, np.inf, cost)
    nowhere = np.flatnonzero(np.isinf(cost).all(axis=0)) if k else np.arange(n)
    if nowhere.size:
        raise ScheduleError(f"item {int(nowhere[0])} fits in no group; give it a group that holds it")
    if order is None:
        finite = np.where(np.isinf(cost), -np.inf, cost)
        order = np.argsort(-finite.max(axis=0), kind="stable")  # costliest first
    fills = np.zeros(k) if fill is None else np.asarray(fill, dtype=float)
    single = np.zeros((k, n)) if alone is None else np.asarray(alone, dtype=float)
    acc = np.zeros(k)
    longest = np.zeros(k)
    members: list[list[int]] = [[] for _ in range(k)]
    for i in np.asarray(order):
        finish = acc + cost[:, i] + np.where(fills > 0, fills * np.maximum(longest, single[:, i]), 0.0)
        g = int(np.argmin(finish))
        members[g].append(int(i))
        acc[g] += cost[g, i]
        longest[g] = max(longest[g], single[g, i])
    if keep_every:
        for g in range(k):
            while not members[g] and n >= k:
                donor = max(range(k), key=lambda d: len(members[d]))
                movable = [i for i in members[donor] if np.isfinite(cost[g, i])]
                if len(members[donor]) < 2 or not movable:
                    break
                i = min(movable, key=lambda i: cost[g, i])
                members[donor].remove(i)
                members[g].append(i)
    out = np.empty(n, dtype=np.int64)
    for g, items in enumerate(members):
        out[items] = g
    return out


def members(assignment: ArrayLike, groups: int) -> list[np.ndarray]:
    """Per group, the indices of its items in ascending order.

    >>> [m.tolist() for m in members([1, 0, 1], 3)]
    [[1], [0, 2], []]
    """
    a = np.asarray(assignment)
    return [np.flatnonzero(a == g) for g in range(groups)]
