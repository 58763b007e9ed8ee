"""What a sliced step keeps: the profiler's fit of a carried piece's extra bytes, and the simulator's
peak of saved activations per stage from the step's order (flexmesh.sim.memory)."""

from __future__ import annotations

import pytest

from flexmesh.layout.step import Group, Piece, StepSchedule


def test_the_carried_fit_predicts_pieces_it_was_not_fitted_on():
    import torch

    from flexmesh.profile.activations import _carried_extra, measure_carried
    from flexmesh.spec.model import parse_model

    spec = parse_model("tiny")
    fit = measure_carried(spec, [64, 128, 256], torch.float32, "cpu")
    for p, n in ((300, 100), (700, 200), (96, 240)):
        got = _carried_extra(spec, p, n, torch.float32, "cpu")
        want = (fit["per_prefix_token"] * p + fit["per_prefix_query_pair"] * p * n + fit["per_query_sq"] * n * n
                + fit["per_query"] * n)
        assert want == pytest.approx(got, rel=0.01), (p, n)
    assert fit["per_prefix_token"] > 0  # the prefix's keys and values are kept


def test_a_unit_holds_its_slices_and_their_carried_bytes():
    from flexmesh.cost import CostModel, Work
    from flexmesh.layout.strategy import LayerStrategy
    from flexmesh.schedule.context import ScheduleContext
    from flexmesh.sim.memory import stage_activation_peaks
    from flexmesh.spec import parse_cluster, parse_model

    ctx = ScheduleContext(cost=CostModel(parse_model("llama2-7b"), parse_cluster("2xA100-80GB")),
                          base=LayerStrategy(), num_ranks=1, pp=2, pipeline_schedule="1f1b")
    cut = StepSchedule((4096, 4096), (Group((0,), ((Piece(0, 0, 2048),), (Piece(0, 2048, 4096),),
                                                   (Piece(1, 0, 2048),), (Piece(1, 2048, 4096),))),), "t")
    whole = StepSchedule((2048,) * 4, (Group((0,), tuple((Piece(i, 0, 2048),) for i in range(4))),), "t")
    c, s = ctx.cost, ctx.group_strategy(1)
    layer = c.layer(s, Work(tokens=2048.0, sq_tokens=float(c.attention_sq(0.0, 2048.0)))).act
    later = c.layer(s, Work(tokens=2048.0, sq_tokens=float(c.attention_sq(2048.0, 4096.0)))).act
    carried = c.timing.carried_bytes(s, 2048.0, 2048.0)
    emb = c.timing.embedding_activation_bytes(s, 2048.0)
    # stage 0 of 1F1B holds 2 micro-batches; a unit acts as one, so with units of two it holds all four
    # slices, the later ones with what their carry keeps
    assert stage_activation_peaks(ctx, whole)[0] == pytest.approx(2 * (16 * layer + emb))
    got = stage_activation_peaks(ctx, cut)[0]
    assert got == pytest.approx(2 * (16 * layer + emb) + 2 * (16 * (later + carried) + emb))
    assert carried == pytest.approx(2 * 32 * 128 * 2048 * 2)  # analytic: the prefix's keys and values, bf16
