"""Packing into micro-batches, group layout, and the per-step lower bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmesh.errors import ScheduleError
from flexmesh.schedule.assemble import aligned_layout
from flexmesh.schedule.lower_bound import lower_bound, min_groups
from flexmesh.schedule.packing import best_fit_decreasing, next_fit
from flexmesh.schedule.registry import make_schedule
from flexmesh.schedule.testing import tiny_context

lengths_st = st.lists(st.integers(1, 100), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None)
@given(lengths_st, st.integers(100, 300))
def test_packers_place_every_sequence_once_within_cap(lengths, cap):
    for packer in (next_fit, best_fit_decreasing):
        bins = packer(range(len(lengths)), lengths, cap)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= cap for b in bins)


@settings(max_examples=60, deadline=None)
@given(lengths_st, st.integers(100, 300))
def test_best_fit_leaves_at_most_one_half_empty_bin(lengths, cap):
    bins = best_fit_decreasing(range(len(lengths)), lengths, cap)
    loads = [sum(lengths[i] for i in b) for b in bins]
    assert sum(load <= cap / 2 for load in loads) <= 1  # any-fit packers never keep two such bins
    assert len(bins) <= -(-2 * sum(lengths) // cap)  # hence fewer than twice the ideal count


def test_best_fit_puts_a_group_that_fits_into_one_micro_batch_longest_first():
    assert best_fit_decreasing([0, 1, 2], [3, 5, 2], cap=10) == [[1, 0, 2]]
    assert best_fit_decreasing([0, 1, 2], [3, 5, 2], cap=9) == [[1, 0], [2]]
    assert best_fit_decreasing([], [3], cap=9) == []


def test_next_fit_keeps_arrival_order():
    bins = next_fit([0, 1, 2, 3, 4], [4, 4, 4, 1, 1], 8)
    assert bins == [[0, 1], [2, 3, 4]]


def test_oversized_sequence_is_a_clear_error():
    with pytest.raises(ScheduleError, match="12 tokens exceeds the micro-batch cap of 10"):
        best_fit_decreasing([0, 1], [3, 12], 10)


def test_aligned_layout_aligns_every_group_and_uses_every_rank():
    slots = aligned_layout([1, 8, 2, 4, 1], 16)
    assert sorted(r for s in slots for r in s.ranks) == list(range(16))
    assert all(s.start % s.size == 0 for s in slots)
    with pytest.raises(ScheduleError, match="powers of two"):
        aligned_layout([3], 8)
    with pytest.raises(ScheduleError, match="only 4 data ranks"):
        aligned_layout([4, 2], 4)


def test_lower_bound_single_sequence_is_its_fastest_group():
    ctx = tiny_context(8)
    n = 20_000
    need = ctx.min_group(n)
    # priced by the packing floor (ScheduleContext.packing_floor), at most the model's own time of it alone
    floor = ctx.packing_floor()
    fastest = min(float(floor.seq_time(d, [n])[0]) for d in ctx.group_sizes if d >= need)
    assert lower_bound([n], ctx) == pytest.approx(fastest)
    assert fastest <= min(float(ctx.seq_time(d, [n])[0]) for d in ctx.group_sizes if d >= need)


def test_lower_bound_many_short_sequences_is_spread_work():
    ctx = tiny_context(8)
    lens = [1000] * 64
    env = ctx.envelope()  # kernels at their best rate: packing cannot beat it
    c = float(env.microbatch_time(1, 0.0, 0.0))
    per_rank = 64 * (float(env.seq_time(1, [1000])[0]) - c) / 8
    assert lower_bound(lens, ctx) == pytest.approx(per_rank)
    # the model's own times of the sequences run one by one would overstate it: packing fills tiles
    assert per_rank < 64 * (float(ctx.seq_time(1, [1000])[0]) - float(ctx.microbatch_time(1, 0.0, 0.0))) / 8


def test_lower_bound_scales_with_speed_and_work():
    slow = tiny_context(8, speed=(0.5,) * 8)
    fast = tiny_context(8)
    lens = [3000, 500, 9000, 700] * 8
    assert lower_bound(lens, slow) == pytest.approx(2 * lower_bound(lens, fast))
    assert lower_bound(lens + lens, fast) > lower_bound(lens, fast)


def test_min_groups_matches_context_and_errors_name_the_length():
    ctx = tiny_context(8)
    lens = np.array([10, 9000, 20_000, 60_000])
    assert min_groups(lens, ctx).tolist() == [ctx.min_group(int(x)) for x in lens]
    too_long = ctx.max_tokens(8) + 1
    with pytest.raises(ScheduleError, match=f"{too_long} tokens fits nowhere.*at most {too_long - 1}"):
        min_groups([5, too_long], ctx)


def test_lower_bound_closes_groups_a_long_sequence_cannot_finish_on():
    """A sequence too slow alone on its cheapest group within the step must count its work on a larger
    one: the bound rises above the plain max(spread work, slowest sequence), and no schedule beats it."""
    ctx = tiny_context(2)
    n = ctx.max_tokens(1) - 8  # fits one rank, but runs faster on two
    work = {d: float(ctx.by_size("work", np.array([n]))[d][0]) for d in ctx.group_sizes}
    alone = {d: float(ctx.seq_time(d, [n])[0]) for d in ctx.group_sizes}
    assert alone[2] < alone[1] and work[1] < work[2]  # cheapest on 1 rank, fastest on 2
    lens = [n, 300, 300, 300]  # enough short work that spreading it, not the long one alone, binds
    short = 3 * float(ctx.by_size("work", np.array([300]))[1][0])
    plain = max((work[1] + short) / 2, alone[2])
    assert plain < alone[1]  # a step shorter than the long sequence alone on one rank is not ruled out
    bound = lower_bound(lens, ctx)
    assert bound == pytest.approx(min(alone[1], (work[2] + short) / 2))
    assert bound > plain * 1.01
    for policy in ("hdp", "milp", "balanced"):
        s = make_schedule(policy, lens, ctx)
        assert s.predicted_step_time >= bound * (1 - 1e-9)
