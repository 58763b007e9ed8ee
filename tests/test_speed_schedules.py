"""Per-step schedules on devices of different speeds (hypothesis, fixed seed).

Over preset cost models, speed patterns (one rank at 0.5 or 0.25, several slow, half slow) and
random speed vectors (0.25..1.0 per rank), every policy's schedule is simulated with the same speeds:

- no simulated step is below the lower bound (the slowest lane's micro-batch phase is >= the bound,
  the step >= bound + gradient sync and optimizer);
- with ``pp == 1`` the scheduler's ``predicted_step_time`` equals the simulator's micro-batch phase,
  as it does at nominal speed (tests/test_sim_prices.py): both scale compute, not communication;
- with one rank at half speed, every policy gives that rank less work than the others get on average
  (a policy that ignored speed would give it about the same).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
from helpers import check_simulated_against_bound
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexmesh.cost import CostModel
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.lower_bound import lower_bound
from flexmesh.schedule.registry import POLICIES, make_schedule
from flexmesh.schedule.testing import tiny_context
from flexmesh.spec import parse_cluster, parse_model

OPTIONS = {"milp": {"node_limit": 50}}
PATTERNS = ("one-half", "one-quarter", "several-half", "half-half", "random")


def speed_vector(pattern: str, n: int, rng: np.random.Generator) -> tuple[float, ...]:
    """One speed factor per data rank for a named pattern (``random``: uniform in 0.25..1.0)."""
    s = np.ones(n)
    if pattern == "one-half":
        s[rng.integers(n)] = 0.5
    elif pattern == "one-quarter":
        s[rng.integers(n)] = 0.25
    elif pattern == "several-half":
        s[rng.choice(n, size=max(2, n // 4), replace=False)] = 0.5
    elif pattern == "half-half":
        s[: n // 2] = 0.5
    else:
        s = rng.uniform(0.25, 1.0, n).round(3)
    return tuple(float(x) for x in s)


@lru_cache(maxsize=None)
def _cost(model: str, cluster: str) -> CostModel:
    return CostModel(parse_model(model), parse_cluster(cluster))


@st.composite
def cases(draw):
    policy = draw(st.sampled_from(sorted(str(p) for p in POLICIES)))
    pp = 2 if policy == "chunked" else 1
    model = draw(st.sampled_from(["llama2-7b", "llama3-8b"]))
    n = draw(st.sampled_from([4, 8, 16]))
    cost = _cost(model, f"{max(1, n * pp // 8)}x{min(8, n * pp)}xA100-80GB")
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    speed = speed_vector(draw(st.sampled_from(PATTERNS)), n, rng)
    ctx = ScheduleContext(cost=cost, base=LayerStrategy(zero=draw(st.sampled_from([2, 3])), recompute=True),
                          num_ranks=n, pp=pp, cp_kind=draw(st.sampled_from(["ulysses", "ring"])), speed=speed)
    top = ctx.max_tokens(ctx.group_sizes[-1])
    short = draw(st.lists(st.integers(1, max(1, top // 64)), min_size=0, max_size=40))
    long = draw(st.lists(st.integers(1, top), min_size=1, max_size=4))
    return policy, ctx, np.array(draw(st.permutations(short + long)), dtype=np.int64)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_simulated_step_never_below_the_bound_and_prediction_equals_simulation(case):
    policy, ctx, lens = case
    check_simulated_against_bound(policy, ctx, lens, OPTIONS.get(policy, {}), exact_prediction=ctx.pp == 1)


@pytest.mark.parametrize("policy", sorted(str(p) for p in POLICIES))
def test_a_half_speed_rank_gets_less_work(policy):
    n, slow = 8, 5
    pp = 2 if policy == "chunked" else 1
    ctx = tiny_context(n, pp=pp, speed=tuple(0.5 if r == slow else 1.0 for r in range(n)))
    rng = np.random.default_rng(3)
    # Many short documents, each fitting one rank: every policy can shift work between ranks.
    lens = rng.integers(100, min(2000, ctx.max_tokens(1) // 2), 400)
    s = make_schedule(policy, lens, ctx, cp=1, **OPTIONS.get(policy, {})) if POLICIES_TAKE_CP.get(policy) \
        else make_schedule(policy, lens, ctx, **OPTIONS.get(policy, {}))
    tokens = np.zeros(n)
    for g in s.groups:
        tokens[list(g.ranks)] = g.tokens / g.cp
    others = np.delete(tokens, slow).mean()
    assert tokens[slow] < 0.8 * others, (policy, tokens.tolist())


# chunked under a pipeline may choose one group of all ranks (then every rank runs the slowest's
# pace: a 12.0 s step against 16.4 s for one group per rank, by the simulator); with cp=1 it must
# still shift work off the slow rank.
POLICIES_TAKE_CP = {"fixed": True, "padded": True, "balanced": True, "wlb": True, "chunked": True}


def test_the_bound_weighs_ranks_by_speed():
    lens = np.array([1500] * 64)
    nominal = lower_bound(lens, tiny_context(8))
    one_slow = lower_bound(lens, tiny_context(8, speed=(0.5,) + (1.0,) * 7))
    all_half = lower_bound(lens, tiny_context(8, speed=(0.5,) * 8))
    # One rank at half speed takes away at most half a rank of eight; all at half speed at most halve.
    assert nominal < one_slow <= nominal * 8 / 7.5 * (1 + 1e-9)
    assert one_slow < all_half <= 2 * nominal * (1 + 1e-9)


def test_milp_load_rows_use_each_ranks_speed():
    # One rank of eight at a quarter speed: the MILP's capacity is 7.25 ranks, not 8 x 0.25 (what
    # treating every rank as the slowest would give), so it plans within the warm start's step.
    ctx = tiny_context(8, speed=(1.0,) * 7 + (0.25,))
    rng = np.random.default_rng(0)
    lens = np.concatenate([rng.integers(50, 1500, 200), [6000, 7000]])
    s = make_schedule("milp", lens, ctx, node_limit=50)
    assert s.extra["milp_solves"] >= 1
    assert s.predicted_step_time <= s.extra["warm_start_step_time"] + 1e-12
    assert s.predicted_step_time < 1.25 * s.lower_bound


def test_a_slow_groups_placement_speed_stretches_compute_not_communication():
    """Where groups run their own micro-batch counts, the placers weigh a slow group by the speed at
    which it runs its loads as the simulator prices them (ScheduleContext.at_speed: compute
    stretched, communication not), not by its slowest member's factor alone, which would overcharge
    it and leave it idle at the end of the step. In lockstep the slowest member's factor stays."""
    from dataclasses import replace

    from flexmesh.schedule.assemble import aligned_layout
    from flexmesh.schedule.placement import slot_speeds

    lockstep = tiny_context(4, speed=(0.5, 0.5, 1.0, 1.0))  # ZeRO-3: every group runs the largest count
    assert slot_speeds(lockstep, aligned_layout([2, 2], 4), np.full(64, 1000)) == (0.5, 1.0)
    ctx = replace(lockstep, lockstep=False)
    lens = np.full(64, 1000)
    share = ctx.comm_share(2, lens)
    assert 0.0 < share < 0.5  # Ulysses groups of 2 exchange activations: part of their time is all-to-all
    assert ctx.comm_share(1, lens) == 0.0  # a group of one rank without tensor parallelism communicates nothing
    slow, fast = slot_speeds(ctx, aligned_layout([2, 2], 4), lens)
    assert fast == 1.0 and slow > 0.5
    # A packed micro-batch of these sequences on the slow group: nominal time over time at its speed.
    n = ctx.pack_tokens(2) // 1000
    comp, comm = ctx.microbatch_split(2, n * 1000.0, n * ctx.cost.attention_sq(0.0, np.array([1000.0]))[0])
    assert slow == pytest.approx(float((comp + comm) / ctx.at_speed(comp, comm, 0.5)))
    assert slot_speeds(tiny_context(4), aligned_layout([2, 2], 4), lens) == (1.0, 1.0)


def test_the_bound_with_communication_comes_within_a_fraction_of_the_fluid_optimum():
    """Sequences that all fit one rank, with exposed tensor-parallel communication (which a slow rank
    does not stretch), 12 ranks at nominal speed and 4 at a quarter. Giving each rank the same mix of
    the batch, in the share it finishes in ``T = 1 / sum_r 1 / (C / s_r + K)`` (C, K: the batch's
    compute and communication rank-seconds on single ranks), is one way to spread it, so the bound is at
    most that; weighing ranks by a power of their speed alone stays more than 1% below it, and the bound
    comes within 0.1% of it (only sequences whose mix differs from the batch's could do better)."""
    cost = _cost("llama2-13b", "8x8xH100")
    speed = (1.0,) * 12 + (0.25,) * 4
    ctx = ScheduleContext(cost=cost, base=LayerStrategy(tp=2, zero=1, recompute=True), num_ranks=16, pp=2,
                          speed=speed, lockstep=False, max_group=1)
    lens = np.random.default_rng(0).integers(200, 4000, 600)
    comp, comm = ctx.seq_work_split(1, lens)
    assert comm.sum() > 0.05 * comp.sum()  # communication matters here
    s = np.asarray(speed)
    fluid = 1.0 / float((1.0 / (comp.sum() / s + comm.sum())).sum())
    by_speed = max(float((comp + min(1.0, float(s.min())) * comm).sum() / s.sum()),  # alpha = 1
                   float((comp + comm).sum() / s.size))  # alpha = 0
    bound = lower_bound(lens, ctx)
    assert by_speed < 0.99 * fluid
    assert 0.999 * fluid <= bound <= fluid * (1 + 1e-9)
    check_simulated_against_bound("hdp", ctx, lens, {}, exact_prediction=False)
