"""The search's space covers what people run: pipeline depths and worlds that are not powers of two,
interleaving with a chosen number of chunks, and selective recomputation, each priced and written."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from flexmesh.cli import main
from flexmesh.cost import CostModel, Work, in_flight, pipeline_time
from flexmesh.layout.plan import Plan
from flexmesh.layout.strategy import LayerStrategy, Recompute
from flexmesh.search import SearchRequest, SearchSpace, best_plans, candidate_strategies, check_plan, uniform_plan
from flexmesh.search.fast import groups
from flexmesh.search.space import outer_configurations, pipeline_degrees
from flexmesh.spec import MODEL_PRESETS, parse_cluster
from flexmesh.spec.model import ModelSpec, gpt

# Shapes as published: BLOOM-176B (BigScience, 2211.05100: 70 layers, hidden 14336, 112 heads, vocab
# 250880, seq 2048, trained on 48 nodes of 8 A100-80GB with tp 4, pp 12, dp 8, global batch 2048);
# MT-NLG 530B (Smith et al., 2201.11990: 105 layers, hidden 20480, 128 heads, seq 2048, 280 DGX A100
# nodes of 8 with tp 8, pp 35, dp 8, global batch 1920). Both GPT-style (LayerNorm, GeLU, biases).
BLOOM = gpt(70, 14336, 112, 250880, name="bloom-176b")
MTNLG = gpt(105, 20480, 128, 51200, name="mt-nlg-530b")
BLOOM_CLI = "gpt:70:14336:112:250880"
MTNLG_CLI = "gpt:105:20480:128:51200"


def plan_json(capsys, model: str, cluster: str, seq: int, gb: int) -> dict:
    """``flexmesh plan --json`` for these inputs (the best plan and its figures)."""
    assert main(["plan", "--model", model, "--cluster", cluster, "--seq-len", str(seq), "--global-batch", str(gb),
                 "--top", "1", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_pipeline_degrees_are_divisors_that_keep_stages_on_whole_nodes():
    assert pipeline_degrees(384, 70, 8) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert 35 in pipeline_degrees(2240, 105, 8)
    for world, layers, per in ((384, 70, 8), (2240, 105, 8), (24, 32, 8), (96, 80, 4), (12, 7, 6)):
        got = pipeline_degrees(world, layers, per)
        assert got[0] == 1 and got == sorted(set(got))
        for p in got:
            stage = world // p
            assert world % p == 0 and p <= layers and (stage % per == 0 or per % stage == 0)
    assert 32 not in pipeline_degrees(384, 70, 8)  # stages of 12 devices: a node and a half


def test_the_space_contains_the_published_pipelines():
    for model, world, gb, pp in ((BLOOM, 384, 2048, 12), (MTNLG, 2240, 1920, 35)):
        pps = {c[0] for c in outer_configurations(model, world, gb, SearchSpace(), per_node=8)}
        assert pp in pps
        assert all(world % p == 0 for p in pps)
    # tp any divisor of the node that divides the heads: 6 devices per node and 12 heads give tp 3 and 6
    m12 = ModelSpec("m12", num_layers=4, hidden=768, num_heads=12, num_kv_heads=12, ffn_hidden=2048, vocab=1000)
    tps = {s.tp for s in candidate_strategies(m12, parse_cluster("2x6xA100-80GB"), 6)}
    assert tps == {1, 2, 3, 6}
    dps = {s.dp for s in candidate_strategies(m12, parse_cluster("2x6xA100-80GB"), 12)}
    assert 3 in dps and 12 in dps  # dp any integer


@pytest.mark.parametrize("model, cluster, gb, tp, pp, dp, m", [
    (BLOOM, "48x8xA100-80GB", 2048, 4, 12, 8, 256),
    (MTNLG, "280x8xA100-80GB", 1920, 8, 35, 8, 240),
])
def test_published_layouts_are_expressible_and_priced(model, cluster, gb, tp, pp, dp, m):
    c = parse_cluster(cluster)
    cost = CostModel(model, c)
    cand = uniform_plan(model, c, LayerStrategy(tp=tp, dp=dp, zero=1), pp, "1f1b", m, 2048, gb, cost)
    plan = Plan.from_dict(json.loads(json.dumps(cand.plan.to_dict())))  # through the file format
    assert (plan.pp, plan.world_size, plan.stages[0].strategies[0]) == (pp, c.world_size, LayerStrategy(tp=tp, dp=dp,
                                                                                                          zero=1))
    ev = check_plan(plan, model, c, cost)  # valid for the model and cluster, and fits
    assert ev.fits and ev.step_time > 0 and 0.05 < ev.mfu < 1
    # uneven stages where the layers do not divide: 70 layers over 12 stages
    assert sorted({s.num_layers for s in plan.stages}) == ([5, 6] if pp == 12 else [3])


@pytest.mark.slow
def test_plan_finds_a_layout_for_24_gpus_and_a_batch_of_256(capsys):
    d = plan_json(capsys, "llama2-7b", "3x8xA100-80GB", 4096, 256)
    plan = Plan.from_dict(d["best"]["plan"])
    assert plan.world_size == 24 and 24 % plan.pp == 0
    mbs = plan.microbatch_size
    assert all(mbs % s.dp == 0 for s in plan.layer_strategies())  # dp 3 cannot split 256: another factorization
    check_plan(plan, MODEL_PRESETS["llama2-7b"], parse_cluster("3x8xA100-80GB"))


@pytest.mark.slow
def test_plan_finds_bloom_on_384_gpus(capsys, no_recommendation):
    # The search and its baselines only: the policy this plan is recommended is what the same command in
    # docs/cli-plan.md prints (tests/test_docs_examples.py), and its simulated steps are most of the command's time.
    d = plan_json(capsys, BLOOM_CLI, "48x8xA100-80GB", 2048, 2048)
    plan = Plan.from_dict(d["best"]["plan"])
    assert plan.world_size == 384 and d["best"]["mfu"] > 0.3
    check_plan(plan, replace(BLOOM, name=plan.model), parse_cluster("48x8xA100-80GB"))
    # never slower than BLOOM's own layout priced by the same cost model
    base = d["baselines"]["megatron-3d"]
    assert base is not None and d["best"]["step_time_s"] <= base["step_time_s"] * (1 + 1e-12)


@pytest.mark.slow
def test_plan_finds_mt_nlg_on_2240_gpus(capsys, no_recommendation):  # the search only, as above
    d = plan_json(capsys, MTNLG_CLI, "280x8xA100-80GB", 2048, 1920)
    plan = Plan.from_dict(d["best"]["plan"])
    assert plan.world_size == 2240 and d["best"]["mfu"] > 0.3
    check_plan(plan, replace(MTNLG, name=plan.model), parse_cluster("280x8xA100-80GB"))


# ---- interleaving with v chunks -------------------------------------------------------------------------
def test_interleaving_searches_more_than_two_chunks():
    model = replace(MODEL_PRESETS["tiny"], name="tiny-16", num_layers=16)
    space = SearchSpace(pipeline_schedules=("interleaved",), virtual_stages=(2, 3, 4))
    configs = list(outer_configurations(model, 4, 8, space, per_node=4))
    vs = {(pp, v) for pp, _, v, _ in configs}
    # 16 layers with the embedding and the loss counted as one each split into 6 chunks of 3 (the first
    # and last a layer lighter), but into 12 chunks neither alone nor with one or both ends counted
    assert {(2, 2), (2, 3), (2, 4), (4, 2), (4, 4)} <= vs
    assert (4, 3) not in vs
    assert all(m % pp == 0 and pp * v <= 16 + 2 for pp, _, v, m in configs)
    cluster = parse_cluster("4xA100-80GB")
    r = best_plans(SearchRequest(model, cluster, 1024, 8, space, mode="fast", top=8), with_baselines=False)
    assert {c.plan.virtual_stages for c in r.plans} >= {2, 4}
    for c in r.plans:
        p = Plan.from_dict(c.plan.to_dict())
        assert len(p.stages) == p.pp * p.virtual_stages and p.virtual_stages == c.plan.virtual_stages
        assert check_plan(p, model, cluster).step_time == pytest.approx(c.evaluation.step_time)


def test_more_chunks_shrink_the_bubble_and_hold_more_than_1f1b_in_flight():
    times = [1.0, 1.0, 1.0, 1.0]
    assert pipeline_time("interleaved", times, 8, 4) < pipeline_time("interleaved", times, 8, 2)
    for v in (2, 3, 4):  # Megatron's warm-up: (pp - r - 1) * 2 + (v - 1) * pp + 1 chunks of 1/v stage
        assert in_flight("interleaved", 4, 0, 8, v) == pytest.approx((3 * 2 + (v - 1) * 4 + 1) / v)
        assert in_flight("interleaved", 4, 0, 8, v) > in_flight("1f1b", 4, 0, 8)


def test_gpipe_never_beats_1f1b_in_the_cost_model():
    """The search skips GPipe when 1F1B is allowed; this is the pricing that makes it safe."""
    for pp, m in ((2, 4), (4, 8), (3, 3)):
        t = [1.0 + r for r in range(pp)]
        assert pipeline_time("gpipe", t, m) == pipeline_time("1f1b", t, m)
        assert all(in_flight("gpipe", pp, r, m) >= in_flight("1f1b", pp, r, m) for r in range(pp))


# ---- selective recomputation ----------------------------------------------------------------------------
def test_selective_is_written_read_and_old_forms_still_parse():
    s = LayerStrategy.parse("tp2-u2-dp2z3-sac")
    assert s.recompute is Recompute.SELECTIVE and str(s) == "tp2-u2-dp2z3-sac"
    assert LayerStrategy.parse("tp2-dp2z3-ac").recompute is Recompute.FULL
    assert LayerStrategy(recompute=True) == LayerStrategy(recompute="full")
    assert LayerStrategy(recompute=False).recompute is Recompute.NONE
    assert not LayerStrategy(recompute="selective").recompute  # truthy only for full (the old bool's meaning)


def test_selective_recomputation_is_priced():
    model, cluster = MODEL_PRESETS["llama2-7b"], parse_cluster("8xA100-80GB")
    cost = CostModel(model, cluster)
    w = Work.uniform(2, 4096)
    none, sel, full = (cost.layer(LayerStrategy(tp=2, dp=4, recompute=r), w) for r in ("none", "selective", "full"))
    attention = cost.timing.layer_times(LayerStrategy(tp=2, dp=4), w.tokens, w.sq_tokens).attention
    assert sel.fwd == pytest.approx(none.fwd)
    assert sel.bwd == pytest.approx(none.bwd + attention)  # the attention core runs again in backward
    assert none.bwd < sel.bwd < full.bwd
    # flash-style attention keeps no s^2 term: selective keeps what no recomputation keeps (analytic count)
    assert sel.act == none.act and full.act < sel.act


def test_fast_groups_pair_every_two_recompute_kinds():
    a, b, c = (LayerStrategy(dp=2, zero=1, recompute=r) for r in ("none", "selective", "full"))
    assert groups([c, a, b]) == [(a, b), (a, c), (b, c)]
    assert groups([a, c]) == [(a, c)]
    assert groups([b]) == [(b, None)]


def test_search_never_worse_with_selective_in_the_space():
    model = ModelSpec("m3", num_layers=3, hidden=256, num_heads=8, num_kv_heads=8, ffn_hidden=512, vocab=2048)
    cluster = parse_cluster("2xA100-80GB")
    old = SearchSpace(recompute=(False, True), microbatches=(2, 4), cp_kinds=("ring",), zero_stages=(0, 3))
    new = replace(old, recompute=(Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL))
    for mode in ("exact", "fast"):
        a = best_plans(SearchRequest(model, cluster, 2048, 8, old, mode=mode), with_baselines=False).best
        b = best_plans(SearchRequest(model, cluster, 2048, 8, new, mode=mode), with_baselines=False).best
        assert b.evaluation.step_time <= a.evaluation.step_time * (1 + 1e-9)


@pytest.mark.parametrize("model, cluster, seq, gb", [("llama2-7b", "8xA100-80GB", 2048, 64),
                                                      ("llama2-13b", "2x8xA100-40GB", 4096, 64)])
def test_fast_search_skips_only_overlap_options_that_cannot_win(model, cluster, seq, gb):
    # The fast method prices grad_reduce="last" and the lean options only where a bound says they may
    # win; pricing every option on every configuration must find nothing better.
    from flexmesh.search.driver import search
    from flexmesh.search.space import FASTEST, LEAN, REDUCE_ONCE, SearchRequest, SearchSpace
    from flexmesh.spec import MODEL_PRESETS, parse_cluster

    req = SearchRequest(MODEL_PRESETS[model], parse_cluster(cluster), seq, gb, top=1, mode="fast")
    pruned = search(req).candidates[0]
    every = search(replace(req, space=SearchSpace(overlaps=(FASTEST, REDUCE_ONCE, LEAN)))).candidates[0]
    assert pruned.evaluation.step_time == pytest.approx(every.evaluation.step_time, rel=1e-9)


def test_the_megatron_baselines_floor_never_passes_a_layouts_price(monkeypatch):
    """megatron_3d skips pricing a layout whose floor reaches the best step found so far: the floor must
    stay at or below the priced step of every layout it may skip (compute at a slow cluster's pace too),
    and the baseline is the one pricing every layout finds."""
    from flexmesh.search import uniform_baselines
    from flexmesh.search.space import FASTEST
    from flexmesh.search.uniform_baselines import _floor, _priced, megatron_3d

    model = MODEL_PRESETS["llama2-7b"]
    for cluster in (parse_cluster("4x8xA100-40GB"), replace(parse_cluster("4x8xA100-40GB"), speed_factors=(0.5,) * 32)):
        cost = CostModel(model, cluster)
        for tp, pp, m, schedule, v, ac in ((1, 1, 8, "1f1b", 1, False), (2, 4, 32, "1f1b", 1, True),
                                           (4, 8, 16, "interleaved", 2, False), (8, 2, 64, "interleaved", 2, True)):
            s = LayerStrategy(tp=tp, dp=32 // (tp * pp), zero=1, recompute=ac)
            floor = _floor(cost, s, model.num_layers, pp, schedule, m, v, 4096, 256, FASTEST)
            step = _priced(model, cluster, s, pp, schedule, m, 4096, 256, cost, v, FASTEST).evaluation.step_time
            assert 0.5 * step < floor <= step, (tp, pp, m, schedule)
    c = parse_cluster("4x8xA100-40GB")
    pruned = megatron_3d(model, c, 4096, 256, CostModel(model, c))
    monkeypatch.setattr(uniform_baselines, "_floor", lambda *a: float("-inf"))  # price every layout
    every = megatron_3d(model, c, 4096, 256, CostModel(model, c))
    assert pruned is not None and every is not None and pruned.plan.layout == every.plan.layout
    # exact: the floor skips layouts, pricing the rest the same way
    assert pruned.evaluation.step_time == every.evaluation.step_time
