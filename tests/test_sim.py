"""Simulator: pipeline orders and timeline invariants, against the cost model's closed forms."""

from __future__ import annotations

import numpy as np
import pytest

from flexmesh.cost import CostModel, pipeline_time
from flexmesh.errors import FlexmeshError, ScheduleError
from flexmesh.layout.step import Group, Piece, StepSchedule
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.schedule.context import ScheduleContext
from flexmesh.sim.pipeline import rank_order, run_pipeline
from flexmesh.sim.plots import gantt_png, load_png
from flexmesh.sim.timeline import KINDS, lane_speeds, simulate_step
from flexmesh.spec import parse_cluster, parse_model


def _ctx(num_ranks=4, pp=1, schedule="1f1b", tp=1, cluster=None) -> ScheduleContext:
    cl = parse_cluster(cluster or f"{max(1, num_ranks * pp * tp // 8)}x{min(8, num_ranks * pp * tp)}xA100-80GB")
    return ScheduleContext(cost=CostModel(parse_model("llama2-7b"), cl),
                           base=LayerStrategy(tp=tp, zero=3, recompute=True),
                           num_ranks=num_ranks, pp=pp, pipeline_schedule=schedule)


def _one_per_rank(lengths_per_rank: list[list[int]]) -> StepSchedule:
    """Each rank its own group; rank r runs one micro-batch per listed length."""
    lengths, groups = [], []
    for r, ls in enumerate(lengths_per_rank):
        mbs = []
        for n in ls:
            mbs.append((Piece(len(lengths), 0, n),))
            lengths.append(n)
        groups.append(Group(ranks=(r,), microbatches=tuple(mbs)))
    return StepSchedule(lengths=tuple(lengths), groups=tuple(groups), policy="hand")


# ---- pipeline orders ------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)])
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 4), (4, 4), (4, 8), (3, 9)])
def test_equal_microbatches_reproduce_pipeline_time(schedule, v, pp, m):
    f, b = 0.4, 0.9  # per rank, all chunks together
    run = run_pipeline(schedule, np.full((pp * v, m), f / v), np.full((pp * v, m), b / v), v)
    assert run.end.max() == pytest.approx(pipeline_time(schedule, [f + b] * pp, m, v), rel=1e-12)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_every_pass_runs_once_and_respects_dependencies(schedule, v):
    rng = np.random.default_rng(0)
    pp, m = 4, 8
    f, b = rng.uniform(0.1, 1, (pp * v, m)), rng.uniform(0.2, 2, (pp * v, m))
    run = run_pipeline(schedule, f, b, v)
    assert all(len(o) == 2 * m * v for o in run.orders)
    assert np.allclose(run.end - run.start, np.stack([f, b]))
    assert (run.start[0, 1:] >= run.end[0, :-1] - 1e-12).all()  # forward flows down the stages
    assert (run.start[1, :-1] >= run.end[1, 1:] - 1e-12).all()  # backward flows up
    assert (run.start[1, -1] >= run.end[0, -1] - 1e-12).all()
    for r, order in enumerate(run.orders):  # a rank runs one pass at a time, in its order
        ends = [run.end[int(p.backward), p.chunk * pp + r, p.mb] for p in order]
        starts = [run.start[int(p.backward), p.chunk * pp + r, p.mb] for p in order]
        assert all(s >= e - 1e-12 for s, e in zip(starts[1:], ends[:-1]))


def test_1f1b_keeps_at_most_pp_minus_rank_in_flight():
    pp, m = 4, 8
    for r in range(pp):
        live = peak = 0
        for p in rank_order("1f1b", pp, r, m):
            live += -1 if p.backward else 1
            peak = max(peak, live)
        assert peak == pp - r


def test_no_rank_finishes_before_its_own_work_with_unequal_microbatches():
    rng = np.random.default_rng(1)
    f = rng.uniform(0.1, 1, (4, 6))
    # Same passes, different order: both are valid schedules of the same work; neither loses any.
    for s in ("gpipe", "1f1b"):
        run = run_pipeline(s, f, 2 * f)
        busy = 3 * f.sum(axis=1)
        assert (run.finish >= busy - 1e-12).all()


def test_unknown_schedule_is_a_clear_error():
    with pytest.raises(FlexmeshError, match="1f1b"):
        rank_order("zigzag", 2, 0, 4)


# ---- timelines ------------------------------------------------------------------------------------
def test_kinds_add_up_to_step_and_utilisation_in_range():
    ctx = _ctx(num_ranks=4)
    tl = simulate_step(ctx, _one_per_rank([[4000, 2000], [300], [8000], [100, 100, 100]]), detail=True)
    total = tl.compute + tl.comm + tl.bubble + tl.wait
    assert np.allclose(total, tl.step_time)
    assert ((tl.utilisation >= 0) & (tl.utilisation <= 1)).all()
    for lane, segs in enumerate(tl.segments):
        assert {s.kind for s in segs} <= set(KINDS)
        assert segs[0].start == 0 and segs[-1].end == pytest.approx(tl.step_time)
        assert all(a.end == pytest.approx(b.start) for a, b in zip(segs, segs[1:]))  # contiguous, no overlap
        for kind in KINDS:
            assert sum(s.end - s.start for s in segs if s.kind == kind) == pytest.approx(
                getattr(tl, kind)[lane], abs=1e-12)


def test_durations_come_from_the_cost_model():
    ctx = _ctx(num_ranks=2)
    tl = simulate_step(ctx, _one_per_rank([[4000, 1000], [6000]]))
    # ZeRO-3 runs in lockstep: rank 1 also runs an empty micro-batch of cp * tp = 1 token, as the runtime does.
    expect = [ctx.microbatch_time(1, 4000, 4000**2) + ctx.microbatch_time(1, 1000, 1000**2),
              ctx.microbatch_time(1, 6000, 6000**2) + ctx.microbatch_time(1, 1, 1)]
    assert np.allclose(tl.work_end, expect, rtol=1e-12)
    sync, optim = ctx.cost.step_grad_sync(ctx.base, 2)
    # The sync hides under the slowest rank's last backward (rank 1's empty micro-batch) by the cost
    # model's rule, and only the rest of it lengthens the step.
    last_bwd = float(ctx.cost.microbatch_phases(ctx.group_strategy(1), 1, 1, layers=ctx.layers_per_stage).bwd)
    exposed = ctx.cost.exposed_sync(sync, last_bwd, ctx.layers_per_stage)
    assert exposed < sync
    assert tl.step_time == pytest.approx(max(expect) + exposed + optim)


def test_faster_ranks_wait_at_gradient_sync():
    ctx = _ctx(num_ranks=4)
    tl = simulate_step(ctx, _one_per_rank([[8000], [2000], [2000], [8000]]), detail=True)
    assert tl.wait[1] > 0 and tl.wait[2] > 0
    assert tl.wait[1] == pytest.approx(tl.work_end[0] - tl.work_end[1])
    assert tl.wait[0] == pytest.approx(0, abs=1e-12)
    waits = [s for s in tl.segments[1] if s.kind == "wait"]
    sync = [s for s in tl.segments[1] if s.label == "grad sync"]
    assert waits and sync and waits[0].end == pytest.approx(sync[0].start)  # the wait is at the sync
    assert tl.imbalance == pytest.approx(tl.work_end.max() / tl.work_end.mean())


def test_half_speed_rank_doubles_its_compute():
    ctx = _ctx(num_ranks=2)
    sched = _one_per_rank([[6000], [6000]])
    base = simulate_step(ctx, sched)
    slow = simulate_step(ctx, sched, speed=[1.0, 0.5])
    ph = ctx.cost.microbatch_phases(ctx.group_strategy(1), 6000.0, 6000.0**2, layers=ctx.layers_per_stage)
    comp, comm = float(ph.fwd + ph.bwd), float(ph.comm_fwd + ph.comm_bwd)
    assert slow.work_end[1] == pytest.approx(2 * comp + comm)
    assert slow.work_end[0] == pytest.approx(base.work_end[0])
    # The step grows by the extra compute and the slow rank's longer optimizer step; the fast rank
    # waits exactly that long.
    optim = ctx.cost.step_grad_sync(ctx.base, 2)[1]
    assert slow.step_time - base.step_time == pytest.approx(comp + optim, rel=1e-9)
    assert slow.wait[0] == pytest.approx(comp + optim, rel=1e-9)


def test_a_group_moves_at_its_slowest_member():
    ctx = _ctx(num_ranks=2)
    sched = StepSchedule(lengths=(20000,), policy="hand",
                         groups=(Group(ranks=(0, 1), microbatches=((Piece(0, 0, 20000),),)),))
    fast = simulate_step(ctx, sched)
    slow = simulate_step(ctx, sched, speed=[1.0, 0.5])
    assert slow.work_end[0] == slow.work_end[1] > fast.work_end[0]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_timeline_matches_closed_form_with_equal_microbatches(schedule):
    ctx = _ctx(num_ranks=2, pp=4, schedule=schedule)
    m = 6
    sched = _one_per_rank([[3000] * m, [3000] * m])
    tl = simulate_step(ctx, sched)
    s = ctx.group_strategy(1)
    L = ctx.layers_per_stage
    p2p = [ctx.cost.pipeline_p2p(s, s.dp, 3000.0, ctx.pp, x) for x in ctx.cost.pipeline_crossings(ctx.pp)]
    stage = [float(ctx.cost.microbatch_phases(s, 3000.0, 3000.0**2, layers=L, head=r == ctx.pp - 1).total) + p2p[r]
             for r in range(ctx.pp)]
    # With the LM head on the last stage, stages differ; the closed form still bounds from below and
    # is exact for the equal stages without the head.
    assert tl.work_end.max() >= pipeline_time(schedule, stage, m) - 1e-9
    no_head = [stage[0]] * ctx.pp
    run = run_pipeline(schedule, np.full((4, m), stage[0] / 3), np.full((4, m), 2 * stage[0] / 3))
    assert run.end.max() == pytest.approx(pipeline_time(schedule, no_head, m))
    assert (tl.bubble >= 0).all() and tl.bubble.sum() > 0
    assert np.allclose(tl.compute + tl.comm + tl.bubble + tl.wait, tl.step_time)


def test_interleaved_has_smaller_bubble_than_1f1b():
    m = 8
    one = simulate_step(_ctx(num_ranks=1, pp=4, schedule="1f1b"), _one_per_rank([[2000] * m]))
    inter = simulate_step(_ctx(num_ranks=1, pp=4, schedule="interleaved"), _one_per_rank([[2000] * m]),
                          virtual_stages=2)
    assert inter.bubble.sum() < one.bubble.sum()


def test_slot_tokens_charge_padding():
    ctx = _ctx(num_ranks=1)
    sched = _one_per_rank([[1000]])
    assert simulate_step(ctx, sched, slot_tokens=8000).step_time > simulate_step(ctx, sched).step_time
    assert simulate_step(ctx, sched, slot_tokens=8000).tokens[0] == 1000  # padding is not trained tokens


def test_bad_inputs_say_what_to_change():
    ctx = _ctx(num_ranks=4)
    with pytest.raises(ScheduleError, match="data ranks"):
        simulate_step(ctx, _one_per_rank([[100], [100]]))
    with pytest.raises(ScheduleError, match="speed"):
        simulate_step(ctx, _one_per_rank([[100]] * 4), speed=[1.0, 1.0])
    with pytest.raises(ScheduleError, match="positive"):
        simulate_step(ctx, _one_per_rank([[100]] * 4), speed=[1.0, 0.0, 1.0, 1.0])


def test_lane_speeds_take_the_slowest_tp_member():
    from dataclasses import replace
    c = replace(parse_cluster("8xA100-80GB"), speed_factors=(1, 1, 0.5, 1, 1, 1, 1, 0.8))
    sp = lane_speeds(c, tp=2, pp=2)
    assert sp.tolist() == [[1.0, 0.5], [1.0, 0.8]]


def test_microbatch_phases_sum_to_microbatch_time():
    cost = CostModel(parse_model("llama2-7b"), parse_cluster("2x8xA100-40GB"))
    t = np.array([100.0, 5000.0, 120000.0])
    for text in ("tp1-u8-dp1z3-ac", "tp2-r4-dp1z3", "tp4-u4-dp1z2", "tp1-dp1z3"):
        s = LayerStrategy.parse(text)
        assert np.allclose(cost.microbatch_phases(s, t, t * t, layers=7).total,
                           cost.microbatch_time(s, t, t * t, layers=7), rtol=1e-12)


def test_step_grad_sync_grows_off_node_and_zero_shards_optimizer():
    cost = CostModel(parse_model("llama2-7b"), parse_cluster("4x8xA100-40GB"))
    s = LayerStrategy(zero=3, recompute=True)
    intra, inter = cost.step_grad_sync(s, 8)[0], cost.step_grad_sync(s, 32)[0]
    assert inter > intra > 0
    assert cost.step_grad_sync(s, 32)[1] < cost.step_grad_sync(LayerStrategy(zero=0), 32)[1]
    assert cost.step_grad_sync(s, 1) == (0.0, pytest.approx(cost.step_grad_sync(s, 1)[1]))


# ---- plots --------------------------------------------------------------------------------------------
def test_plots_are_png_files(tmp_path):
    ctx = _ctx(num_ranks=2, pp=2)
    tl = simulate_step(ctx, _one_per_rank([[3000, 1000], [500, 500, 500]]), detail=True)
    for f in (gantt_png(tl, tmp_path / "g.png", "test"), load_png(tl, tmp_path / "l.png", "test")):
        data = f.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_gantt_needs_detail(tmp_path):
    tl = simulate_step(_ctx(num_ranks=1), _one_per_rank([[100]]))
    with pytest.raises(FlexmeshError, match="detail"):
        gantt_png(tl, tmp_path / "g.png")
