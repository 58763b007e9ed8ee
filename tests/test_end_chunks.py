"""Pipeline chunks of the embedding alone or the head alone (Llama 3's pipeline, 2407.21783 section
3.3.2: one layer fewer on the first and the last stage, so the first chunk holds only the embedding and
the last only the output projection and loss): priced, validated and shown. The runtime trains such a
plan as the single-process reference does (tests/test_runtime_recompute.py, layout ``end_chunks``)."""

from __future__ import annotations

import pytest

from flexmesh.cost import CostModel
from flexmesh.errors import PlanError
from flexmesh.layout import LayerStrategy as S
from flexmesh.layout.plan import Plan, StagePlan
from flexmesh.layout.strategy import chunk_anchors
from flexmesh.plan.check import check_plan
from flexmesh.spec import parse_cluster, parse_model

MODEL = parse_model("llama2-7b")
CLUSTER = parse_cluster("8xA100-80GB")
STRATEGY = S(tp=2, dp=2, zero=1)  # pp 2 x tp 2 x dp 2 = 8 devices


def plan_of(layers: list[tuple[int, int]]) -> Plan:
    stages = tuple(StagePlan(a, b, (STRATEGY,) * (b - a)) for a, b in layers)
    return Plan.uniform(model="llama2-7b", cluster="8xA100-80GB", world_size=8, pp=2, pipeline_schedule="interleaved",
                        virtual_stages=2, num_microbatches=8, seq_len=4096, global_batch=16, stages=stages)


def test_an_embedding_only_chunk_carries_the_embedding_and_the_head_only_chunk_the_head():
    cm = CostModel(MODEL, CLUSTER)
    L = MODEL.num_layers
    chunks = [[], [STRATEGY] * (L // 2), [STRATEGY] * (L - L // 2), []]
    ev = cm.evaluate_stages(chunks, 2, "interleaved", 8, 2, 1, 4096)
    work = cm.layer_work(STRATEGY, 1, 4096)
    embedding = cm.ends(STRATEGY, work, True, False)
    head = cm.ends(STRATEGY, work, False, True)
    assert embedding.states > 0 and head.states > 0 and head.fwd > embedding.fwd
    first = cm.stage_cost([], 1, 4096, True, False, anchor=STRATEGY)
    assert first.states == pytest.approx(embedding.states) and first.fwd == pytest.approx(embedding.fwd)
    half = cm.stage_cost([STRATEGY] * (L // 2), 1, 4096, False, False)
    # rank 0 holds chunk 0 (the embedding) and chunk 2 (the second half of the layers), rank 1 the rest
    assert ev.memory[0]["states"] == pytest.approx(embedding.states + half.states)
    assert ev.memory[1]["states"] == pytest.approx(half.states + head.states)
    assert ev.memory[1]["logits"] > 0 and ev.memory[0]["logits"] == 0
    # without an anchor a chunk of no layers has nothing to run its embedding on
    assert cm.stage_cost([], 1, 4096, True, False).fwd == 0


def test_anchors_are_the_nearest_chunk_with_layers():
    a, b = S(tp=1), S(tp=2)
    assert chunk_anchors([[], [a], [b, b], []]) == [a, a, b, b]
    with pytest.raises(PlanError, match="no chunk holds a layer"):
        chunk_anchors([[], []])


def test_the_first_and_last_stage_may_hold_no_layers_and_no_other():
    L = MODEL.num_layers
    plan = plan_of([(0, 0), (0, 16), (16, L), (L, L)])
    ev = check_plan(plan, MODEL, CLUSTER)
    assert ev.fits and ev.step_time > 0
    assert plan.layout.startswith("pp2 interleavedx2 m8 | [0,0) embedding | [0,16) 16x")
    assert plan.layout.endswith(f"[{L},{L}) head")
    assert plan.group.data_ranks == 2  # the chunks with layers say it, not the empty first one
    with pytest.raises(PlanError, match="only the first stage may hold the embedding alone"):
        check_plan(plan_of([(0, 16), (16, 16), (16, L), (L, L)]), MODEL, CLUSTER)
