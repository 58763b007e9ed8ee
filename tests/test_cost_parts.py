"""The cost model assembled from parts (flexmesh.cost.training.parts): one constructor, variants through
CostModel.replace, adapters and experts held and asked together, and the same parts in every group of a
plan of replica groups."""

from __future__ import annotations

from dataclasses import replace

import pytest

from flexmesh.cost import CostModel, Work
from flexmesh.cost.device.kernels import Kernels
from flexmesh.cost.training.adapters import AdapterCosts
from flexmesh.cost.training.experts import ExpertParallel
from flexmesh.cost.training.parts import Parts
from flexmesh.cost.training.weights import FullTraining
from flexmesh.layout.overlap import FASTEST
from flexmesh.layout.strategy import LayerStrategy
from flexmesh.spec import MODEL_PRESETS, parse_cluster, parse_model
from flexmesh.spec.tasks import Task, TaskSet

TASKS = TaskSet((Task(name="chat", rank=8, alpha=16, targets=("q_proj", "v_proj")),))


def test_a_variant_of_the_step_overlap_shares_the_layer_pricing():
    cm = CostModel(parse_model("llama2-7b"), parse_cluster("8xA100-80GB"))
    other = cm.replace(step_overlap=FASTEST)
    assert other.step_overlap == FASTEST and cm.step_overlap != FASTEST
    assert other.layer_pricing is cm.layer_pricing  # its caches
    assert cm.replace(parts=Parts()) is cm and cm.replace(step_overlap=cm.step_overlap) is cm


def test_parts_are_held_together():
    """A mixture of experts fine-tuned with LoRA keeps both its adapters and its experts' placement."""
    spec = MODEL_PRESETS["tiny-moe"]
    experts = ExpertParallel("static", ep=2)
    cm = CostModel(spec, parse_cluster("8xA100-80GB"), parts=Parts(experts=experts, tasks=TASKS))
    assert isinstance(cm.trained, AdapterCosts) and cm.experts == experts
    assert cm.layer_pricing.experts is not None and cm.layer_pricing.experts.parallel == experts
    moved = cm.replace(parts=replace(cm.parts, experts=ExpertParallel("laer")))
    assert isinstance(moved.trained, AdapterCosts) and moved.experts.placement == "laer"
    full = cm.replace(parts=replace(cm.parts, tasks=None))
    assert isinstance(full.trained, FullTraining)
    s, w = LayerStrategy(dp=8, zero=1), Work(4096.0, 4096.0**2)
    assert cm.layer(s, w).states < full.layer(s, w).states  # the base keeps no gradients nor optimizer states


def test_a_lower_bound_kernel_model_is_a_variant_too():
    cm = CostModel(parse_model("llama2-7b"), parse_cluster("8xA100-80GB"), parts=Parts(tasks=TASKS))
    env = cm.replace(kernels=Kernels.envelope)
    assert isinstance(env.trained, AdapterCosts) and env.hw is not cm.hw
    s = LayerStrategy(dp=8)
    assert env.microbatch_time(s, 4096.0, 4096.0**2) <= cm.microbatch_time(s, 4096.0, 4096.0**2)


def test_the_groups_of_a_lora_plan_sync_the_adapters_alone():
    """Two replica groups of the same model: across groups the full model's gradients, or the adapters'."""
    from flexmesh.cost.training.mixed import MixedCosts, gradient_sync
    from flexmesh.layout.plan import ReplicaGroup, StagePlan
    from flexmesh.spec.cluster import parse_mixed_cluster

    spec = parse_model("llama2-7b")
    cluster = parse_mixed_cluster("1x8xA100-80GB")
    st = (StagePlan(0, 32, (LayerStrategy(tp=4),) * 32),)
    groups = [ReplicaGroup(((0, 1, 2, 3),), st, 1, 4), ReplicaGroup(((4, 5, 6, 7),), st, 1, 4)]
    full = gradient_sync(MixedCosts(spec, cluster), groups)[0][0]
    lora = gradient_sync(MixedCosts(spec, cluster, parts=Parts(tasks=TASKS)), groups)[0][0]
    assert 0 < lora < full / 10  # latency, mostly
    assert MixedCosts(spec, cluster, parts=Parts(tasks=TASKS)).groups[0].parts.tasks == TASKS


def test_a_model_profile_prices_no_other_stack():
    from helpers import flat_model_profile

    from flexmesh.errors import SpecError
    from flexmesh.layout.stack import Stack
    from flexmesh.profile.timing import ProfiledTiming

    cm = CostModel(MODEL_PRESETS["tiny"], parse_cluster("2xA100-80GB"), timing=ProfiledTiming(flat_model_profile()))
    assert cm.replace(kernels=Kernels.floor) is cm  # measured times stay as measured
    with pytest.raises(SpecError, match="drop --model-profile"):
        cm.replace(parts=Parts(stack=Stack(dropout=True)))
