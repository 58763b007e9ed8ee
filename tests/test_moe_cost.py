"""The cost model and the search with mixtures of experts (flexmesh.cost.training.experts).

What is checked: parameter and FLOP counts of the presets against their published totals; the most
loaded rank sets the experts' time (imbalance); fully sharded experts keep 1/N of their states and
exchange their weights, EP keeps E/ep experts and syncs them once per step; one rank exchanges
nothing; with tensor parallelism experts spread over every rank of the stage; baselines price
static placement; a routing trace replays into the imbalance the plan uses.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexmesh.cost import CostModel
from flexmesh.cost.training.experts import ExpertParallel, expert_params
from flexmesh.cost.training.parts import Parts
from flexmesh.errors import PlanError, SpecError
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec import MODEL_PRESETS, parse_cluster
from flexmesh.spec.moe import MoESpec

MIXTRAL = MODEL_PRESETS["mixtral-8x7b"]


@pytest.mark.parametrize("name, total, active", [
    # the published totals (billions): model cards of Mixtral-8x7B (46.7B, 12.9B active), Qwen2-57B-A14B,
    # Qwen3-30B-A3B (30.5B, 3.3B active) and OLMoE-1B-7B (6.9B, 1.3B active)
    ("mixtral-8x7b", 46.7, 12.9), ("qwen2-57b-a14b", 57.4, 14.2), ("qwen3-30b-a3b", 30.5, 3.3),
    ("olmoe-1b-7b", 6.9, 1.3),
])
def test_preset_parameters(name, total, active):
    m = MODEL_PRESETS[name]
    assert m.total_params / 1e9 == pytest.approx(total, abs=0.06)
    emb = m.embedding_params + m.head_params
    assert (m.num_layers * m.layer_active_linear_params + emb) / 1e9 == pytest.approx(active, abs=0.1)
    # FLOPs count what a token multiplies with, the weights held count every expert
    assert m.layer_linear_flops_per_token == 2 * m.layer_active_linear_params < 2 * m.layer_linear_params


def test_dense_layers_are_counted_apart():
    m = replace(MODEL_PRESETS["tiny-moe"], moe=replace(MODEL_PRESETS["tiny-moe"].moe, dense_layers=(0, 2)))
    per = [m.dense_mlp_params if not m.is_moe_layer(i) else m.moe.total_params(m.hidden) for i in range(4)]
    assert m.total_params == 4 * (m.layer_params - m.layer_linear_params) + 4 * m.attention_linear_params + sum(per) \
        + m.embedding_params + m.head_params
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def _layer(experts: ExpertParallel, strategy: str = "tp1-dp32z2", cluster: str = "4x8xA100-80GB"):
    cm = CostModel(MIXTRAL, parse_cluster(cluster), parts=Parts(experts=experts))
    s = LayerStrategy.parse(strategy)
    return cm, cm.layer(s, cm.layer_work(s, 32 * s.dp // 32, 8192))


def test_the_most_loaded_rank_sets_the_time():
    _, even = _layer(ExpertParallel(imbalance=1.0))
    _, skewed = _layer(ExpertParallel(imbalance=1.7))
    assert skewed.fwd > even.fwd and skewed.comm_fwd > even.comm_fwd
    # the routed experts are most of a Mixtral layer's FLOPs: 1.7x their time is more than 1.4x the layer's
    assert skewed.fwd / even.fwd > 1.4
    _, static = _layer(ExpertParallel("static"))
    _, laer = _layer(ExpertParallel("laer"))
    assert static.fwd > laer.fwd  # the measured imbalances (IMBALANCE)


def test_fully_sharded_experts_keep_a_share_and_exchange_weights():
    cm, fsep = _layer(ExpertParallel(imbalance=1.0))
    w, g, o = cm.weight_bytes, cm.grad_bytes, cm.optim_bytes
    dense = MIXTRAL.layer_params - expert_params(MIXTRAL)
    # ZeRO-2 over 32 ranks for the rest, 1/32 of every expert's states
    assert fsep.states == pytest.approx(dense * (w + g / 32 + o / 32) + expert_params(MIXTRAL) / 32 * (w + g + o))
    assert fsep.grad_sync < 0.1  # only the dense weights' reduction: experts' gradients arrive in their shards
    _, ep = _layer(ExpertParallel("static", ep=8, imbalance=1.0))
    # whole experts: E / ep = 1 expert's weights and gradients per rank, its optimizer states over the 4 holding it
    assert ep.states == pytest.approx(dense * (w + g / 32 + o / 32) + expert_params(MIXTRAL) / 8 * (w + g + o / 4))
    assert ep.grad_sync > fsep.grad_sync  # EP's replicas reduce their gradients once per step
    assert fsep.comm_fwd > ep.comm_fwd  # FSEP gathers its experts' weights every micro-batch
    _, one = _layer(ExpertParallel(), strategy="tp1-dp1z0", cluster="1xA100-80GB")
    assert one.comm_fwd == one.comm_bwd == 0.0  # one rank: every expert local, nothing exchanged


def test_prefetched_exchanges_hide_under_compute():
    _, exposed = _layer(ExpertParallel(imbalance=1.3))
    _, hidden = _layer(ExpertParallel(imbalance=1.3, prefetch=True))
    # exact: prefetching moves the exchange only: the same compute terms
    assert hidden.comm_fwd < exposed.comm_fwd and hidden.fwd == exposed.fwd


def test_experts_spread_over_every_rank_of_a_stage_tp_included():
    """With tensor parallelism each tp rank routes its slice of the sequence: the experts spread over
    dp x tp ranks alike (the same expert states per rank as over as many data ranks), the router and
    shared expert stay whole on every tp rank."""
    from flexmesh.cost.training.experts import tp_whole_params
    from flexmesh.search.space import candidate_strategies

    assert {s.tp for s in candidate_strategies(MIXTRAL, parse_cluster("8xA100-80GB"), 8)} > {1}
    cm, dp32 = _layer(ExpertParallel(imbalance=1.0))
    _, tp2 = _layer(ExpertParallel(imbalance=1.0), strategy="tp2-dp16z2")
    w, g, o = cm.weight_bytes, cm.grad_bytes, cm.optim_bytes
    dense = MIXTRAL.layer_params - expert_params(MIXTRAL)
    whole = tp_whole_params(MIXTRAL)
    assert tp2.states == pytest.approx((dense - whole) / 2 * (w + g / 16 + o / 16) + whole * (w + g / 16 + o / 16)
                                       + expert_params(MIXTRAL) / 32 * (w + g + o))
    assert tp2.fwd < dp32.fwd  # half the tokens per rank through the experts and the attention's GEMMs


def test_baselines_price_static_placement():
    from flexmesh.search.space import SearchRequest
    from flexmesh.search.uniform_baselines import baselines

    request = SearchRequest(MIXTRAL, parse_cluster("4x8xA100-80GB"), 8192, 128).resolved()
    found = baselines(request)
    static = request.cost_model().replace(parts=Parts(experts=ExpertParallel("static")))
    z3 = found["zero3-ulysses"]
    assert z3 is not None and static.evaluate(z3.plan).step_time == pytest.approx(z3.evaluation.step_time)
    assert request.cost_model().evaluate(z3.plan).step_time < z3.evaluation.step_time  # laer on the same layout


def _trace(tmp_path, steps: int = 12, experts: int = 8):
    """A persistent skew: expert e gets 100 * (e + 1)^2 tokens, a little noise step to step."""
    rows = [{"step": t, "layer": layer, "expert_tokens": [100 * (e + 1) ** 2 + 7 * ((t * 5 + e) % 3)
                                                          for e in range(experts)]}
            for t in range(1, steps + 1) for layer in (0, 1)]
    path = tmp_path / "routing.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_routing_trace_replays_into_the_imbalance(tmp_path):
    from flexmesh.commands.experts_args import experts_of
    from flexmesh.schedule.expert_placement import read_trace, trace_imbalance

    path = _trace(tmp_path)
    rows = read_trace(path)
    static, laer = trace_imbalance(rows, "static", 4), trace_imbalance(rows, "laer", 4)
    assert static > 1.5 and laer < 1.15  # load-following placement evens a load that persists
    spec = replace(MIXTRAL, moe=replace(MIXTRAL.moe, num_experts=8))
    ex = experts_of(spec, 8, "laer", routing=str(path))
    assert ex.imbalance_at(4) == pytest.approx(laer)
    assert replace(ex, placement="static").imbalance_at(4) == pytest.approx(static)
    with pytest.raises(SpecError, match="routes to \\[8\\] experts but model .* has 16"):
        experts_of(replace(MIXTRAL, moe=MoESpec(16, 2, 14336)), 8, "laer", routing=str(path))
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "layer": 0}\n')
    with pytest.raises(PlanError, match="line 1 is not a routing record"):
        read_trace(tmp_path / "bad.jsonl")


def test_a_model_profiles_layer_grows_with_the_imbalance(recwarn):
    """A model profile measures a MoE layer on one rank (every expert local: even); the experts' share
    of it (the analytic one) grows with the imbalance of the ranks it runs on, and micro-batches of no
    tokens price without a division by zero."""
    import numpy as np
    from helpers import flat_model_profile

    from flexmesh.profile.timing import ProfiledTiming

    spec = MODEL_PRESETS["tiny-moe"]
    profile = flat_model_profile(model=spec.to_dict())
    cluster = parse_cluster("2xA100-80GB")
    s = LayerStrategy.parse("tp1-dp2z2")
    times = {}
    for imbalance in (1.0, 1.5):
        cm = CostModel(spec, cluster, timing=ProfiledTiming(profile),
                       parts=Parts(experts=ExpertParallel(imbalance=imbalance)))
        times[imbalance] = cm.layer_pricing.phases(s, np.array([0.0, 4096.0]), np.array([0.0, 4096.0 ** 2]))
    assert times[1.5][0][1] > times[1.0][0][1] and times[1.5][0][0] == times[1.0][0][0]
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_a_model_profiles_shared_expert_does_not_grow_with_the_imbalance():
    """Only the routed experts run more tokens on the most loaded rank: a shared expert (every token,
    every rank alike) adds to the layer's time that does not grow, so the same measured layer grows
    less with the imbalance with one than without (grown with the rest, it would grow more)."""
    from helpers import flat_model_profile

    from flexmesh.profile.timing import ProfiledTiming

    tiny = MODEL_PRESETS["tiny-moe"]
    assert tiny.moe is not None
    cluster = parse_cluster("2xA100-80GB")
    s = LayerStrategy.parse("tp1-dp2z2")
    growth = {}
    for width in (0, 8 * tiny.moe.top_k * tiny.moe.expert_ffn):
        spec = replace(tiny, moe=replace(tiny.moe, shared_ffn=width, shared_gate=width > 0))
        fwd = []
        for imbalance in (1.0, 2.0):
            cm = CostModel(spec, cluster, timing=ProfiledTiming(flat_model_profile(model=spec.to_dict())),
                           parts=Parts(experts=ExpertParallel(imbalance=imbalance)))
            fwd.append(cm.layer_pricing.phases(s, 4096.0, 4096.0 ** 2)[0])
        growth[width] = fwd[1] / fwd[0] - 1.0
    alone, shared = growth.values()
    assert 0.0 < shared < alone


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0.0, 1e6), min_size=2, max_size=12), st.integers(1, 8), st.integers(0, 3))
def test_load_following_placement_hosts_every_expert_within_the_slots(load, ranks, extra):
    """Every expert on at least one rank, no rank above its slots or holding an expert twice, and the
    busiest rank no busier than static placement's (the greedy replicates and packs the hot experts)."""
    from flexmesh.cost.training.experts import default_slots
    from flexmesh.schedule.expert_placement import balanced_placement, static_placement

    slots = max(default_slots(len(load), ranks), -(-len(load) // ranks)) + extra
    p = balanced_placement(load, ranks, slots)
    assert len(p.hosts) == ranks and all(len(h) <= slots and len(set(h)) == len(h) for h in p.hosts)
    assert {e for h in p.hosts for e in h} == set(range(len(load)))
    if ranks <= len(load):
        assert max(p.rank_loads(load)) <= max(static_placement(len(load), ranks).rank_loads(load)) * (1 + 1e-9) + 1e-9


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_load_that_is_no_count_is_refused_in_one_line(bad):
    from flexmesh.schedule.expert_placement import balanced_placement

    with pytest.raises(PlanError, match=r"expert loads must be finite numbers >= 0; expert 2 has"):
        balanced_placement([5.0, 1.0, bad, 3.0], ranks=2)
