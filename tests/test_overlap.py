"""Overlap options: priced by the cost model, recorded in the plan, chosen by the search."""

import json
from dataclasses import replace

import pytest

from flexmesh.cost import CostModel, Work
from flexmesh.errors import PlanError
from flexmesh.layout import LayerStrategy as S
from flexmesh.layout import Plan, StagePlan
from flexmesh.layout.overlap import NO_OVERLAP, RUNTIME, Overlap
from flexmesh.search import SearchRequest, best_plans
from flexmesh.search.check import overlap_warnings
from flexmesh.search.space import SearchSpace
from flexmesh.spec import MODEL_PRESETS, parse_cluster

MODEL = MODEL_PRESETS["llama2-7b"]
WORK = Work(8192, 8192.0**2)


def cost():
    return CostModel(MODEL, parse_cluster("2x8xH100"))


TP2 = (S(tp=2),)


def plan(overlap=None, strategies=TP2):
    kw = {} if overlap is None else {"overlap": overlap}
    return Plan.uniform("tiny", "2xA100-80GB", 2, 1, "1f1b", 2, 128, 4, (StagePlan(0, len(strategies),
                        strategies),), **kw)


def test_plan_file_round_trips_overlap_and_old_files_read_as_the_runtime(tmp_path):
    p = plan(Overlap(tp_comm=True, grad_reduce="last", zero3_prefetch=False))
    p.save(tmp_path / "p.json")
    raw = json.loads((tmp_path / "p.json").read_text())
    assert raw["overlap"] == {"tp_comm": True, "grad_reduce": "last", "zero3_prefetch": False}
    assert Plan.load(tmp_path / "p.json").overlap == p.overlap
    del raw["overlap"]
    assert Plan.from_dict(raw).overlap == RUNTIME
    with pytest.raises(PlanError, match="grad_reduce"):
        Plan.from_dict({**raw, "overlap": {"grad_reduce": "sometimes"}})
    with pytest.raises(PlanError, match="unknown field.*tp_overlap"):
        Plan.from_dict({**raw, "overlap": {"tp_overlap": True}})


def test_tp_overlap_hides_tp_collectives_under_the_gemms_only_where_tp_communicates():
    cm = cost()
    on, off = Overlap(tp_comm=True), NO_OVERLAP
    a, b = cm.layer(S(tp=4, dp=4), WORK, on), cm.layer(S(tp=4, dp=4), WORK, off)
    assert a.comm_fwd < b.comm_fwd and a.comm_bwd < b.comm_bwd
    assert (a.fwd, a.bwd) == (b.fwd, b.bwd)  # exact: overlap moves the collectives only: the same compute terms
    # exposed is what does not fit under the GEMMs, with Galvatron's slowdown: at least (1 - overlap) of it
    assert a.comm_fwd >= (1 - cm.hw.overlap) * b.comm_fwd - 1e-12
    assert a.transient > b.transient  # userbuffers
    assert cm.layer(S(dp=16), WORK, on) == cm.layer(S(dp=16), WORK, off)


def test_zero3_prefetch_trades_one_layer_of_gathered_weights_for_hidden_gathers():
    cm = cost()
    s = S(dp=16, zero=3)
    pre, wait = cm.layer(s, WORK, Overlap(zero3_prefetch=True)), cm.layer(s, WORK, Overlap(zero3_prefetch=False))
    assert pre.comm_fwd < wait.comm_fwd and pre.comm_bwd < wait.comm_bwd
    weights = MODEL.layer_params * MODEL.dtype_bytes
    assert pre.transient - wait.transient == pytest.approx(weights)


def test_grad_reduce_last_reduces_once_with_unsharded_gradients():
    cm = cost()
    s = S(dp=16, zero=2)
    every, once = cm.layer(s, WORK, Overlap(grad_reduce="bucketed")), cm.layer(s, WORK, Overlap(grad_reduce="last"))
    assert every.comm_bwd > 0 and once.comm_bwd == 0
    assert once.grad_sync > every.grad_sync  # the one reduce-scatter moves to the step's sync
    grads = MODEL.layer_params * cm.grad_bytes
    assert once.states - every.states == pytest.approx(grads * (1 - 1 / 16))
    # ZeRO-0/1 reduce once either way
    # exact: one reduction either way: the same terms
    assert cm.layer(S(dp=16, zero=1), WORK, Overlap(grad_reduce="last")) == cm.layer(S(dp=16, zero=1), WORK)
    # with one micro-batch, its backward is the last: the two are one thing
    chunks = [[s] * MODEL.num_layers]
    a = cm.evaluate_stages(chunks, 1, "1f1b", 1, 1, 16, 4096, Overlap(grad_reduce="last"))
    b = cm.evaluate_stages(chunks, 1, "1f1b", 1, 1, 16, 4096, Overlap(grad_reduce="bucketed"))
    # exact: one reduction either way: the same terms
    assert (a.step_time, a.peak_memory) == (b.step_time, b.peak_memory)
    c = cm.evaluate_stages(chunks, 1, "1f1b", 8, 1, 16, 4096, Overlap(grad_reduce="last"))
    d = cm.evaluate_stages(chunks, 1, "1f1b", 8, 1, 16, 4096, Overlap(grad_reduce="bucketed"))
    assert c.step_time < d.step_time and c.peak_memory > d.peak_memory


def test_plan_evaluation_uses_the_plans_overlap():
    cm = cost()
    strategies = (S(tp=4, dp=4),) * MODEL.num_layers
    p = Plan.uniform(MODEL.name, "2x8xH100", 16, 1, "1f1b", 4, 4096, 16, (StagePlan(0, MODEL.num_layers, strategies),),
             overlap=Overlap(tp_comm=True))
    assert cm.evaluate(p).step_time < cm.evaluate(replace(p, overlap=NO_OVERLAP)).step_time


def test_search_prices_overlap_and_records_it():
    model, cluster = MODEL_PRESETS["tiny"], parse_cluster("4xH100")
    small = SearchSpace(pipeline_schedules=("1f1b",), recompute=(False,), pp=(1,), microbatches=(2,))
    r = best_plans(SearchRequest(model, cluster, 2048, 8, space=small, mode="exact", top=1), with_baselines=False)
    best = r.best
    assert best.evaluation.step_time == pytest.approx(CostModel(model, cluster).evaluate(best.plan).step_time)
    # forcing the options off never makes the best plan faster
    off_space = replace(small, overlaps=(NO_OVERLAP,))
    off = best_plans(SearchRequest(model, cluster, 2048, 8, space=off_space, mode="exact", top=1),
                     with_baselines=False)
    assert off.best.plan.overlap == NO_OVERLAP
    assert best.evaluation.step_time <= off.best.evaluation.step_time * (1 + 1e-12)


def test_check_warns_when_the_runtime_runs_other_options():
    assert overlap_warnings(plan(RUNTIME)) == []
    assert any("tp_comm" in w for w in overlap_warnings(plan(Overlap(tp_comm=True))))
    assert overlap_warnings(plan(Overlap(tp_comm=True), strategies=(S(dp=2),))) == []  # no tp: nothing to overlap
