"""The simulator prices what the scheduler priced and what the runtime runs (hypothesis).

Over preset cost models and random model profiles (ProfiledTiming from a synthetic ModelProfile),
ZeRO-2 and ZeRO-3, Ulysses and ring, every pp == 1 policy's schedule is simulated and:

- no simulated step is below the lower bound: the slowest rank's micro-batch phase (``work_end``)
  is >= ``StepSchedule.lower_bound``, which covers that phase only (gradient sync and optimizer come
  after it in both);
- the scheduler's ``predicted_step_time`` equals the simulator's micro-batch phase, the slowest
  lane's ``work_end``, for the same schedule. Both are that quantity exactly when ``pp == 1`` and
  every rank runs at nominal speed: then both sum, per group, the cost model's micro-batch times
  (embedding, layers, head, context-parallel communication), ZeRO-3's empty micro-batches included.
  With speed factors both divide compute alone by the speed (tests/test_speed_schedules.py checks
  that case); with pipelines the scheduler's ``(pp - 1) * max`` is an estimate of the simulated pipeline.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from helpers import check_simulated_against_bound
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from flexmesh.cost import CostModel
from flexmesh.layout.mesh import group_cp_kind
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.profile import ModelProfile, ProfiledTiming
from flexmesh.profile.fit import LayerFit
from flexmesh.schedule.context import ScheduleContext
from flexmesh.schedule.registry import POLICIES
from flexmesh.sim.timeline import simulate_step
from flexmesh.spec import MODEL_PRESETS, parse_cluster, parse_model

POLICY_NAMES = sorted(str(p) for p in POLICIES if str(p) != "chunked")  # chunked needs pp > 1
OPTIONS = {"milp": {"node_limit": 50}}


def _fit(draw, scale: float) -> LayerFit:
    return LayerFit(draw(st.floats(0, 1e-3)) * scale, draw(st.floats(1e-7, 1e-5)) * scale,
                    draw(st.floats(0, 2e-9)) * scale, draw(st.floats(0, 1e-10)) * scale)


@st.composite
def cost_models(draw) -> CostModel:
    """A preset (llama2-7b, llama3-8b on A100s) or the tiny model priced by a random model profile."""
    if draw(st.booleans()):
        return CostModel(parse_model(draw(st.sampled_from(["llama2-7b", "llama3-8b"]))),
                         parse_cluster(draw(st.sampled_from(["1x8xA100-80GB", "2x8xA100-40GB"]))))
    spec = MODEL_PRESETS["tiny"]
    layer = {k: _fit(draw, s) for k, s in (("forward", 1.0), ("backward", 2.0), ("backward_recompute", 3.0))}
    mp = ModelProfile(model=spec.to_dict(), dtype="fp32", layer=layer,
                      embedding={"forward": _fit(draw, 0.1), "backward": _fit(draw, 0.2)},
                      head={"forward": _fit(draw, 1.0), "backward": _fit(draw, 2.0)},
                      activations={"layers": [{"tp": 1, "cp": 1, "recompute": r, "bytes_per_token": b}
                                              for r, b in ((False, 20000.0), (True, 1024.0))],
                                   "attention_mask_bytes_per_sq_row_token": 0.0,
                                   "embedding_bytes_per_token": 8.0, "head_bytes_per_token": 33000.0},
                      states={"weight_bytes_per_param": 4, "grad_bytes_per_param": 4, "optimizer_bytes_per_param": 8,
                              "optimizer_step_s_per_param": 2e-9}, name="random.json")
    c = parse_cluster("16xA100-80GB")
    # A small memory makes long documents need context-parallel groups, as on the real models.
    c = replace(c, device=replace(c.device, memory_gib=draw(st.sampled_from([0.02, 0.1])), framework_reserve_gib=0.0,
                                  allocator_headroom=0.0))
    return CostModel(spec, c, timing=ProfiledTiming(mp))


@st.composite
def cases(draw):
    cost = draw(cost_models())
    ctx = ScheduleContext(cost=cost, base=LayerStrategy(zero=draw(st.sampled_from([2, 3])), recompute=True),
                          num_ranks=cost.cluster.world_size, cp_kind=draw(st.sampled_from(["ulysses", "ring"])))
    top = ctx.max_tokens(ctx.group_sizes[-1])
    assume(top >= 1)  # ZeRO-2 keeps a 7B model's gradients whole: an A100-40GB may hold no tokens
    short = draw(st.lists(st.integers(1, max(1, top // 64)), min_size=0, max_size=40))
    long = draw(st.lists(st.integers(1, top), min_size=1, max_size=4))
    return draw(st.sampled_from(POLICY_NAMES)), ctx, np.array(draw(st.permutations(short + long)), dtype=np.int64)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_simulated_micro_batch_phase_equals_the_prediction_and_is_never_below_the_bound(case):
    policy, ctx, lens = case
    check_simulated_against_bound(policy, ctx, lens, OPTIONS.get(policy, {}))


def test_a_short_document_packed_beside_a_long_one_does_not_undercut_the_bound():
    # Attention is priced over blocks of a micro-batch's mean length: two tokens beside 619009 move the
    # mean from just past a 128-key tile boundary to just below it, and the pair prices 0.02% below the
    # long document alone. The bound's single-sequence term must not exceed what the pair costs.
    cost = CostModel(parse_model("llama2-7b"), parse_cluster("1x8xA100-80GB"))
    ctx = ScheduleContext(cost=cost, base=LayerStrategy(zero=2, recompute=True), num_ranks=8)
    lens = np.array([2, 619009])
    pair = float(ctx.microbatch_time(8, 619011.0, cost.attention_sq(0.0, 619009.0) + 4.0))
    assert pair < float(ctx.microbatch_time(8, 619009.0, cost.attention_sq(0.0, 619009.0)))  # the model's dip
    check_simulated_against_bound("balanced", ctx, lens, {})


@settings(max_examples=40, deadline=None)
@given(st.integers(129, 400_000), st.lists(st.integers(1, 64), min_size=1, max_size=8), st.sampled_from([1, 8]))
def test_the_packing_floor_never_charges_a_document_more_than_a_micro_batch_holding_it(long, short, d):
    cost = CostModel(parse_model("llama2-7b"), parse_cluster("1x8xA100-80GB"))
    ctx = ScheduleContext(cost=cost, base=LayerStrategy(zero=2, recompute=True), num_ranks=8)
    floor = ctx.packing_floor()
    sq = cost.attention_sq(0.0, float(long))
    packed = float(ctx.microbatch_time(d, float(long + sum(short)), sq + sum(cost.attention_sq(0.0, float(x))
                                                                             for x in short)))
    alone = float(ctx.microbatch_time(d, float(long), sq))
    assert float(floor.microbatch_time(d, float(long), sq)) <= min(packed, alone) * (1 + 1e-12)


@pytest.mark.parametrize("model, zero, lockstep", [("llama2-7b", 3, True), ("llama2-7b", 2, False),
                                                   ("tiny-moe", 2, True)])
def test_zero3_ranks_run_in_lockstep_and_zero2_ranks_do_not(model, zero, lockstep):
    """Unless experts exchanged over the data ranks pair their micro-batches, as ZeRO-3's gathers do."""
    from flexmesh.layout.step import Group, Piece, StepSchedule

    cost = CostModel(parse_model(model), parse_cluster("2xA100-80GB"))
    # Rank 0 runs three micro-batches, rank 1 one: under ZeRO-3 rank 1 also runs two empty ones.
    sched = StepSchedule(lengths=(4000, 3000, 2000, 5000), policy="test", groups=(
        Group((0,), ((Piece(0, 0, 4000),), (Piece(1, 0, 3000),), (Piece(2, 0, 2000),))),
        Group((1,), ((Piece(3, 0, 5000),),))))
    ctx = ScheduleContext(cost=cost, base=LayerStrategy(zero=zero, recompute=True), num_ranks=2)
    own = float(ctx.microbatch_time(1, 5000, 5000**2))
    empty = float(ctx.microbatch_time(1, 1, 1))  # one document of cp * tp tokens, as the runtime pads
    expect = own + 2 * empty if lockstep else own
    assert ctx.in_lockstep is lockstep
    assert simulate_step(ctx, sched).work_end[1] == pytest.approx(expect, rel=1e-12)


def test_one_rule_decides_ring_or_ulysses_for_scheduler_and_runtime():
    cost = CostModel(parse_model("llama2-7b"), parse_cluster("8x8xA100-80GB"))  # 32 heads
    ctx = ScheduleContext(cost=cost, base=LayerStrategy(zero=3, recompute=True), num_ranks=64)
    assert [str(ctx.group_strategy(d).cp_kind) for d in (1, 8, 32, 64)] == ["none", "ulysses", "ulysses", "ring"]
    assert group_cp_kind("ulysses", 32, 64) == ctx.group_strategy(64).cp_kind
