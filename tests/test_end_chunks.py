"""Pipeline chunks of the embedding alone or the head alone (Llama 3's pipeline, 2407.21783 section
3.3.2: one layer fewer on the first and the last stage, so the first chunk holds only the embedding and
the last only the output projection and loss): priced, validated and shown. The runtime trains such a
plan as the single-process reference does (tests/test_runtime_recompute.py, layout ``end_chunks``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flexmesh.cost import CostModel
from flexmesh.errors import PlanError
from flexmesh.layout import LayerStrategy as S
from flexmesh.layout.plan import Plan, StagePlan
from flexmesh.layout.strategy import chunk_anchors
from flexmesh.search import SearchRequest, SearchSpace, best_plans
from flexmesh.search.check import check_plan
from flexmesh.search.partition import compositions
from flexmesh.search.space import outer_configurations
from flexmesh.spec import MODEL_PRESETS, parse_cluster, parse_model

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


def test_anchors_are_the_layout_of_the_rank_running_the_chunk():
    a, b = S(tp=1), S(tp=2)
    assert chunk_anchors([[], [a], [b, b], []]) == [a, a, b, b]  # one rank: the nearest chunk with layers
    # pp 2: rank 0 runs chunks 0 and 2, rank 1 chunks 1 and 3
    assert chunk_anchors([[], [a], [b, b], []], pp=2) == [b, a, b, a]
    assert chunk_anchors([[], [a], [b]], pp=3) == [a, a, b]  # a rank with no layer: the nearest chunk's
    with pytest.raises(PlanError, match="no chunk holds a layer"):
        chunk_anchors([[], []])


def test_an_empty_first_chunk_is_priced_on_its_own_ranks_layout():
    cm = CostModel(MODEL, CLUSTER)
    L, other = MODEL.num_layers, S(tp=2, dp=2, zero=3)
    half = L // 2
    chunks = [[], [other] * half, [STRATEGY] * (L - half), []]  # rank 0: embedding + chunk 2 (STRATEGY)
    ev = cm.evaluate_stages(chunks, 2, "interleaved", 8, 2, 1, 4096)
    work = cm.layer_work(STRATEGY, 1, 4096)
    rank0 = cm.stage_cost([STRATEGY] * (L - half), 1, 4096, False, False)
    assert ev.memory[0]["states"] == pytest.approx(cm.ends(STRATEGY, work, True, False).states + rank0.states)


def test_the_search_runs_a_heavy_head_alone_where_that_is_faster():
    model = replace(MODEL_PRESETS["tiny"], vocab=16384)  # the head costs about two layers
    cluster = parse_cluster("2xA100-80GB")
    space = SearchSpace(pp=(2,), pipeline_schedules=("interleaved",), virtual_stages=(2,))
    cm = CostModel(model, cluster)
    for mode in ("exact", "fast"):
        best = best_plans(SearchRequest(model, cluster, 1024, 8, space=space, mode=mode), with_baselines=False).best
        stages, m = best.plan.group.stages, best.plan.group.num_microbatches
        assert stages[-1].start == stages[-1].end == model.num_layers, best.plan.layout
        assert best.estimate == pytest.approx(best.evaluation.step_time, rel=1e-9)
        s = stages[1].strategies[0]
        every_chunk_a_layer = min(cm.evaluate_stages([[s] * n for n in sizes], 2, "interleaved", m, 2, 8 // m,
                                                     1024).step_time for sizes in compositions(model.num_layers, 4))
        assert best.evaluation.step_time < every_chunk_a_layer


def test_interleaving_counts_the_embedding_and_loss_as_layers_where_that_evens_the_chunks():
    m126 = replace(MODEL, num_layers=126)  # Llama 3 405B's depth: 16 x 8 chunks with both ends alone
    space = SearchSpace(pp=(16,), virtual_stages=(2, 3, 4, 5, 8))
    vs = {v for _, schedule, v, _ in outer_configurations(m126, 128, 16, space) if schedule == "interleaved"}
    assert vs == {2, 4, 8}


def test_the_first_and_last_stage_hold_the_ends_alone_and_a_middle_one_relays():
    L = MODEL.num_layers
    plan = plan_of([(0, 0), (0, 16), (16, L), (L, L)])
    ev = check_plan(plan, MODEL, CLUSTER)
    assert ev.fits and ev.step_time > 0
    assert plan.layout.startswith("pp2 interleavedx2 m8 | [0,0) embedding | [0,16) 16x")
    assert plan.layout.endswith(f"[{L},{L}) head")
    assert plan.group.data_ranks == 2  # the chunks with layers say it, not the empty first one
    # a middle chunk of no layers passes activations on (priced; the runtime refuses it: tests/test_plan_groups.py):
    # here rank 0 then holds every layer, rank 1 the head alone
    relay = plan_of([(0, 16), (16, 16), (16, L), (L, L)])
    assert "[16,16) relay" in relay.layout
    assert check_plan(relay, MODEL, CLUSTER).step_time > ev.step_time
