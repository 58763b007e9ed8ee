"""Dynamic-programming bucketing: optimal phantom tokens, edges cover their members."""

from __future__ import annotations

from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmesh.data.lengths import load_lengths
from flexmesh.errors import ScheduleError
from flexmesh.schedule.bucketing import dp_buckets


def brute_force_padding(lengths: list[int], k: int) -> int:
    """Least phantom tokens over every way to cut the sorted distinct values into <= k buckets."""
    v = sorted(set(lengths))
    best = None
    for m in range(1, min(k, len(v)) + 1):
        for cuts in combinations(range(1, len(v)), m - 1):
            uppers = [v[c - 1] for c in cuts] + [v[-1]]
            pad = sum(next(u for u in uppers if u >= x) - x for x in lengths)
            best = pad if best is None else min(best, pad)
    return best


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 200), min_size=1, max_size=12), st.integers(1, 5))
def test_dp_is_optimal_on_small_inputs(lengths, k):
    b = dp_buckets(lengths, k=k)
    assert b.padding_tokens == brute_force_padding(lengths, k)
    assert len(b.edges) <= k


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 10**6), min_size=1, max_size=300), st.integers(1, 20))
def test_every_sequence_fits_its_bucket(lengths, k):
    a = np.array(lengths)
    b = dp_buckets(a, k=k, max_points=64)
    assert np.all(b.edges[b.index] >= a)
    assert np.all(np.diff(b.edges) > 0)
    assert b.counts.sum() == a.size and b.counts.min() >= 1
    assert b.edges[-1] == a.max()


def test_enough_buckets_means_no_padding():
    b = dp_buckets([5, 5, 9, 100, 7], k=4)
    assert b.padding_tokens == 0 and b.token_error([5, 5, 9, 100, 7]) == 0.0


def test_dp_beats_equal_width_buckets_on_real_lengths():
    a = np.minimum(load_lengths("wikipedia")[:512], 196_608)  # one global batch at a 192K context
    b = dp_buckets(a, k=16)
    width = a.max() / 16
    equal_edges = np.minimum(np.ceil(a / width) * width, a.max())
    equal_error = (equal_edges - a).sum() / a.sum()
    assert b.token_error(a) < 0.2 * equal_error


def test_bad_input():
    with pytest.raises(ScheduleError):
        dp_buckets([], k=4)
    with pytest.raises(ScheduleError):
        dp_buckets([3, 4], k=0)
