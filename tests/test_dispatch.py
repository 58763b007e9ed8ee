"""The one dispatch (flexmesh.schedule.dispatch): every item placed once, only where it fits, each on the
group whose finish it grows least; every group kept busy when asked; one function for replica groups
(Hydraulis), the LoRA mix's replicas (LobRA) and, next, serving's router."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from flexmesh.errors import ScheduleError
from flexmesh.schedule.dispatch import dispatch, members


@st.composite
def problems(draw):
    k = draw(st.integers(1, 5))
    n = draw(st.integers(0, 30))
    costs = draw(hnp.arrays(float, (k, n), elements=st.floats(0.01, 10.0)))
    sizes = draw(hnp.arrays(int, n, elements=st.integers(1, 100)))
    caps = draw(hnp.arrays(int, k, elements=st.integers(1, 100)))
    caps[draw(st.integers(0, k - 1))] = 100  # some group holds every item
    return costs, sizes, caps


@settings(max_examples=60, deadline=None)
@given(problems(), st.booleans())
def test_every_item_once_where_it_fits(problem, keep):
    costs, sizes, caps = problem
    out = dispatch(costs, sizes, caps, keep_every=keep)
    assert out.shape == sizes.shape and ((out >= 0) & (out < len(caps))).all()
    assert (sizes <= caps[out]).all()
    parts = members(out, len(caps))
    assert sorted(int(i) for p in parts for i in p) == list(range(sizes.size))
    if keep and sizes.size >= len(caps) and (sizes <= caps.min()).all():  # every item fits everywhere
        assert all(p.size for p in parts)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_each_item_goes_where_the_finish_grows_least(problem):
    """Replaying the placements in order, each item sat on a group whose finish was least with it."""
    costs, sizes, caps = problem
    out = dispatch(costs, sizes, caps)
    allowed = np.where(sizes[None, :] <= caps[:, None], costs, np.inf)
    order = np.argsort(-np.where(np.isinf(allowed), -np.inf, allowed).max(axis=0), kind="stable")
    acc = np.zeros(len(caps))
    for i in order:
        finish = acc + allowed[:, i]
        assert finish[out[i]] == finish.min()  # exact: the minimum is one of the finishes
        acc[out[i]] += allowed[out[i], i]


def test_a_pipelines_fill_counts_its_longest_item():
    """The second group runs the item twice as fast, but as a pipeline of 3 stages its fill waits twice
    the item's time: the item goes to the first."""
    costs = np.array([[6.0], [3.0]])
    assert dispatch(costs).tolist() == [1]
    assert dispatch(costs, fill=[0, 2], alone=costs).tolist() == [0]


def test_an_item_no_group_holds_is_refused():
    with pytest.raises(ScheduleError, match="fits in no group"):
        dispatch([[1.0, 2.0]], sizes=[5, 50], capacities=[10])


def test_the_lora_mix_and_the_replica_groups_share_it():
    """Both callers go through this function (not a copy of the greedy)."""
    import inspect

    from flexmesh.schedule import groups
    from flexmesh.search import replicas

    for module in (groups, replicas):
        assert "flexmesh.schedule.dispatch import" in inspect.getsource(module)
        assert "np.argmin" not in inspect.getsource(module)
